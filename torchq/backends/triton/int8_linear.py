"""Triton per-token int8 activations x int8 weights (CUDA implementation of
``torchq::int8_dynamic_linear``), bit for bit the reference.

1. ``_quantize_rows_kernel``: one program per row of ``x [M, K]``: ``s = amax|x| / denom`` (fp32;
   NaN if the row has a NaN), ``s = max(s, eps)``, codes ``clamp(rint(x · (1/s)), qmin, qmax)``
   (NaN -> 0), stored as int8 ``[M, Kp]`` (``Kp`` = K rounded up to 16, zero-padded) with ``s``.
2. ``_int8_gemm_kernel``: ``acc = codes_x @ codes_w.T`` in int32 (tensor cores, exact), then the
   fused epilogue ``y = (acc · s_x) · s_w`` in fp32, one rounding to x's dtype, ``+ bias`` in x's
   dtype (the reference adds the bias after that rounding).

3. ``torchq::int8_static_linear`` (static activations, :class:`torchq.activation.StaticInt8`):
   ``_quantize_rows_static_kernel`` quantizes with the fixed scale (``1/s`` computed once on the
   host in fp32; codes ``clamp(rint(x · (1/s)), qmin - z, qmax - z) + z``, the row's scale NaN if
   it holds a NaN), and ``_int8_gemm_kernel`` subtracts ``z · rowsum(q_w)`` (int32, computed once
   per weight and cached) from the accumulator before the same epilogue: the reference's bits while
   ``|Σ (q_x - z) q_w|`` fits int32 (K up to 66051 at any zero point) and the products stay normal fp32
   (CUDA flushes subnormal results to zero).

Both divisions use ``tl.math.div_rn`` (correctly rounded): triton's ``/`` on fp32 compiles to
the approximate ``div.full.f32`` on CUDA (up to 2 ulp off), which changes codes at rounding ties.
``rint`` is formed as ``(v + 1.5·2^23) - 1.5·2^23`` on values already clamped to the int8 range,
exact round-half-to-even in fp32 on any backend (kernels launch without FMA contraction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...identity_cache import IdentityCache
from ...ops.int8 import check_int8_dynamic_linear_args, check_int8_static_linear_args
from .device import cdiv
from .rounding import ROUND_KINDS, round_to

__all__ = ["int8_dynamic_linear", "int8_static_linear", "quantize_rows", "quantize_rows_static"]

_ROW_SUMS = IdentityCache()


@triton.jit
def _quantize_rows_kernel(x_ptr, codes_ptr, scale_ptr, K, Kp, stride_xm, denom, eps, qmin, qmax, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    has_nan = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        a = tl.abs(tl.load(x_ptr + m * stride_xm + k_idx, mask=k_idx < K, other=0.0).to(tl.float32))
        has_nan = tl.maximum(has_nan, (a != a).to(tl.int32))
        amax = tl.where(a > amax, a, amax)
    s = tl.math.div_rn(tl.max(amax, axis=0), denom)  # IEEE division: triton's `/` is approximate on CUDA
    s = tl.where(s < eps, eps, s)
    s = tl.where(tl.max(has_nan, axis=0) > 0, float("nan"), s)
    tl.store(scale_ptr + m, s)
    r = tl.math.div_rn(1.0, s)
    for k0 in range(0, Kp, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + m * stride_xm + k_idx, mask=k_idx < K, other=0.0).to(tl.float32) * r
        v = tl.where(v != v, 0.0, v)
        v = tl.minimum(tl.maximum(v, qmin), qmax)
        v = (v + 12582912.0) - 12582912.0  # round half to even (|v| <= 128)
        tl.store(codes_ptr + m * Kp + k_idx, v.to(tl.int8), mask=k_idx < Kp)


@triton.jit
def _quantize_rows_static_kernel(x_ptr, codes_ptr, scale_ptr, K, Kp, stride_xm, act_scale, r, zp, lo, hi, BLOCK_K: tl.constexpr):
    m = tl.program_id(0)
    has_nan = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for k0 in range(0, Kp, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + m * stride_xm + k_idx, mask=k_idx < K, other=0.0).to(tl.float32)
        has_nan = tl.maximum(has_nan, (v != v).to(tl.int32))
        v = v * r
        v = tl.where(v != v, 0.0, v)
        v = tl.minimum(tl.maximum(v, lo), hi)  # in float: inf and huge values saturate
        v = (v + 12582912.0) - 12582912.0  # round half to even (|v| <= 255)
        tl.store(codes_ptr + m * Kp + k_idx, (v.to(tl.int32) + zp).to(tl.int8), mask=k_idx < Kp)
    s = tl.where(tl.max(has_nan, axis=0) > 0, float("nan"), act_scale)
    tl.store(scale_ptr + m, s)


@triton.jit
def _int8_gemm_kernel(a_ptr, w_ptr, xs_ptr, ws_ptr, bias_ptr, zc_ptr, out_ptr, M, N, K, Kp, HAS_BIAS: tl.constexpr,
                      HAS_ZC: tl.constexpr, X_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + m_idx[:, None] * Kp + k_idx[None, :], mask=(m_idx[:, None] < M) & (k_idx[None, :] < K), other=0)
        w = tl.load(w_ptr + n_idx[:, None] * K + k_idx[None, :], mask=(n_idx[:, None] < N) & (k_idx[None, :] < K), other=0)
        acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
    m_mask = m_idx < M
    n_mask = n_idx < N
    if HAS_ZC:  # the zero point's correction, exact in int32
        acc = acc - tl.load(zc_ptr + n_idx, mask=n_mask, other=0)[None, :]
    xs = tl.load(xs_ptr + m_idx, mask=m_mask, other=0.0)
    ws = tl.load(ws_ptr + n_idx, mask=n_mask, other=0.0)
    y = round_to((acc.to(tl.float32) * xs[:, None]) * ws[None, :], X_KIND)
    if HAS_BIAS:
        y = round_to(y + tl.load(bias_ptr + n_idx, mask=n_mask, other=0.0).to(tl.float32)[None, :], X_KIND)
    tl.store(out_ptr + m_idx[:, None] * N + n_idx[None, :], y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def quantize_rows(x2: torch.Tensor, quant_min: int, quant_max: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row int8 codes ``[M, Kp]`` (zero-padded to a multiple of 16) and fp32 scales ``[M]``
    of a row-contiguous ``x2 [M, K]``: :class:`torchq.activation.PerTokenInt8` bit for bit."""
    m, k = x2.shape
    kp = -(-k // 16) * 16
    codes = torch.empty(m, kp, dtype=torch.int8, device=x2.device)
    scale = torch.empty(m, dtype=torch.float32, device=x2.device)
    if m:
        _quantize_rows_kernel[(m,)](x2, codes, scale, k, kp, x2.stride(0), (quant_max - quant_min) / 2, float(eps),
                                    float(quant_min), float(quant_max), BLOCK_K=512, enable_fp_fusion=False)
    return codes, scale


def quantize_rows_static(x2: torch.Tensor, act_scale: float, zero_point: int, quant_min: int,
                         quant_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Static int8 codes ``[M, Kp]`` (Kp = K rounded up to 16) and fp32 row scales ``[M]`` (``act_scale``,
    NaN for rows with a NaN) of a row-contiguous ``x2 [M, K]``: :class:`torchq.activation.StaticInt8`
    bit for bit."""
    m, k = x2.shape
    kp = -(-k // 16) * 16
    codes = torch.empty(m, kp, dtype=torch.int8, device=x2.device)
    scale = torch.empty(m, dtype=torch.float32, device=x2.device)
    if m:
        s32 = torch.tensor(act_scale, dtype=torch.float32, device="cpu")
        r = float(1.0 / s32)  # the fp32 reciprocal, exact as a float argument
        _quantize_rows_static_kernel[(m,)](x2, codes, scale, k, kp, x2.stride(0), float(s32), r, int(zero_point),
                                           float(quant_min - zero_point), float(quant_max - zero_point), BLOCK_K=512,
                                           enable_fp_fusion=False)
    return codes, scale


def _zero_correction(codes: torch.Tensor, zero_point: int) -> torch.Tensor:
    """``zero_point · Σ_k codes[n, k]`` (int32 ``[N]``); the row sums cached per codes tensor (and its version)."""
    found = _ROW_SUMS.get(codes)
    if found is None or found[0] != codes._version:
        found = _ROW_SUMS.set(codes, (codes._version, codes.to(torch.int32).sum(dim=1, dtype=torch.int32).contiguous()))
    return found[1] * zero_point


def _gemm(x, x2, xq, xs, codes, scale, bias, zc):
    n = codes.shape[0]
    m, k = x2.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        codes = codes.contiguous()
        ws = scale.reshape(-1).to(torch.float32).contiguous()
        b = None if bias is None else bias.reshape(-1).to(x.dtype).contiguous()
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
        block_n = 64 if m <= 64 else 128
        grid = (cdiv(m, block_m), cdiv(n, block_n))
        _int8_gemm_kernel[grid](xq, codes, xs, ws, codes if b is None else b, codes if zc is None else zc, out, m, n, k,
                                xq.shape[1], HAS_BIAS=b is not None, HAS_ZC=zc is not None,
                                X_KIND=ROUND_KINDS[x.dtype], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
                                num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=3, enable_fp_fusion=False)
    return out.reshape(*x.shape[:-1], n)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 and x2.stride(0) == k else x2.contiguous()


def int8_static_linear(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias=None):
    """``torchq::int8_static_linear`` on Triton."""
    check_int8_static_linear_args(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias)
    x2 = _rows(x, codes.shape[1])
    if not (x2.shape[0] and codes.shape[0]):
        return _gemm(x, x2, None, None, codes, scale, bias, None)
    xq, xs = quantize_rows_static(x2, act_scale, act_zero_point, quant_min, quant_max)
    zc = _zero_correction(codes, act_zero_point) if act_zero_point else None
    return _gemm(x, x2, xq, xs, codes, scale, bias, zc)


def int8_dynamic_linear(x, codes, scale, quant_min, quant_max, eps, bias=None):
    """``torchq::int8_dynamic_linear`` on Triton."""
    check_int8_dynamic_linear_args(x, codes, scale, quant_min, quant_max, eps, bias)
    x2 = _rows(x, codes.shape[1])
    if not (x2.shape[0] and codes.shape[0]):
        return _gemm(x, x2, None, None, codes, scale, bias, None)
    xq, xs = quantize_rows(x2, quant_min, quant_max, eps)
    return _gemm(x, x2, xq, xs, codes, scale, bias, None)
