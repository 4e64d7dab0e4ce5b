"""Triton: the int8-activation 4-bit ops on CUDA, ``torchq::int4_groupwise_linear_a8`` and
``torchq::blockwise_4bit_linear_a8``.

The activations are quantized per 32-element block (:class:`~torchq.activation.PerBlockInt8`, the
ops' own first step, bit for bit): int8 codes ``q`` and one fp32 scale ``a`` per block.

**int4, more than** ``STREAM_MAX_M`` **(4) rows, groups a multiple of 32: int8 tensor cores.**
Per 32-element K step (one activation block inside one weight group ``g``), the 4-bit codes
``c`` (0..15, read from the layout's own bytes, high nibble first) go into ``tl.dot`` against
``q`` in int32, exact: ``D = Σ q·c`` and ``Q = Σ q``. The weight is
``w = (c + code_base + shift_g)·s_g + zero_g``, so the block adds
``a · (s_g·(D + (code_base + shift_g)·Q) + zero_g·Q)`` to an fp32 accumulator; bias in fp32, one
rounding to x's dtype. Numeric contract: the integer sums are exact; the difference from the
reference (fp32 ``a·q`` times the fp32 weight, fp32 sums) is fp32 rounding only,
``|y - y_ref| <= (K/32 + 8)·2^-23·Σ_k |a·q_k·w_k|`` before the final rounding to x's dtype.

**NF4 / FP4, more than 4 rows: int8 tensor cores** on the codebook rounded to int8,
``T[c] = rint(127 · codebook[c] / max|codebook|)`` (as the native CPU kernel): per 32-element K
step, ``tl.dot`` of ``q`` against ``T[c]`` (exact int32), times ``a`` and the block's absmax
(double-quantized absmax decoded once per call), ``/ 127`` at the end. Contract: each weight is
off by at most ``absmax · max|c| / 254`` from the exact codebook's (the rounding of ``T``), plus
fp32 rounding as above.

**Otherwise** (up to 4 rows, other group sizes): the block-dequantized activations ``a·q`` (fp32)
go through the 4-bit kernels of :mod:`.dequant_linear` in fp32 (fp32 weights), one rounding to x's
dtype, within each path's own contract.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...blockwise.codebooks import codebook
from ...blockwise.nested import double_dequantize
from ...ops.blockwise import check_blockwise_4bit_linear_args
from ...ops.int8act import ACTIVATIONS, check_int4_a8_args
from . import dequant_linear
from .device import as_rows, cdiv
from .rounding import ROUND_KINDS, round_to

__all__ = ["int4_groupwise_linear_a8", "blockwise_4bit_linear_a8", "int8_codebook", "STREAM_MAX_M"]

STREAM_MAX_M = 4
ACT_BLOCK = 32


@triton.jit
def _int4_a8_dot_kernel(q_ptr, a_ptr, packed_ptr, scale_ptr, shift_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K,
                        stride_qm, stride_am, stride_pn, stride_sn, stride_hn, stride_zn, group_size, code_base,
                        HAS_SHIFT: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, X_KIND: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (M block, N block): the whole K, one 32-element activation block per step."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m_idx < M
    n_ok = n_idx < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        k_ok = k_idx < K
        q = tl.load(q_ptr + m_idx[:, None] * stride_qm + k_idx[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0)
        byte = tl.load(packed_ptr + n_idx[None, :] * stride_pn + (k_idx // 2)[:, None], mask=n_ok[None, :] & k_ok[:, None],
                       other=0).to(tl.int32)
        c = ((byte >> ((1 - k_idx % 2) * 4)[:, None]) & 15).to(tl.int8)  # element 2j: the high nibble of byte j
        d = tl.dot(q, c, out_dtype=tl.int32).to(tl.float32)  # exact
        qsum = tl.sum(q.to(tl.int32), axis=1).to(tl.float32)  # exact
        a = tl.load(a_ptr + m_idx * stride_am + k0 // BLOCK_K, mask=m_ok, other=0.0)
        g = k0 // group_size
        s = tl.load(scale_ptr + n_idx * stride_sn + g, mask=n_ok, other=0.0)
        base = tl.zeros((BLOCK_N,), dtype=tl.float32) + code_base
        if HAS_SHIFT:
            base += tl.load(shift_ptr + n_idx * stride_hn + g, mask=n_ok, other=0.0)
        block = s[None, :] * (d + base[None, :] * qsum[:, None])
        if HAS_ZERO:
            block += tl.load(zero_ptr + n_idx * stride_zn + g, mask=n_ok, other=0.0)[None, :] * qsum[:, None]
        acc += a[:, None] * block
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n_idx, mask=n_ok, other=0.0)[None, :]
    tl.store(out_ptr + m_idx[:, None] * N + n_idx[None, :], round_to(acc, X_KIND).to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _codebook_a8_dot_kernel(q_ptr, a_ptr, packed_ptr, table_ptr, absmax_ptr, bias_ptr, out_ptr, M, N, K, stride_qm, stride_am,
                            blocksize, HAS_BIAS: tl.constexpr, X_KIND: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (M block, N block): the whole K, one 32-element activation block per step; the
    nibbles of bitsandbytes' row-major bytes (high nibble first) through the int8 table."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m_idx < M
    n_ok = n_idx < N
    row_bytes = K // 2
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_ptr + m_idx[:, None] * stride_qm + k_idx[None, :], mask=m_ok[:, None], other=0)
        byte = tl.load(packed_ptr + n_idx[None, :].to(tl.int64) * row_bytes + (k_idx // 2)[:, None], mask=n_ok[None, :],
                       other=0).to(tl.int32)
        c = (byte >> ((1 - k_idx % 2) * 4)[:, None]) & 15
        t = tl.load(table_ptr + c)  # int8 [BLOCK_K, BLOCK_N]
        d = tl.dot(q, t, out_dtype=tl.int32).to(tl.float32)  # exact
        a = tl.load(a_ptr + m_idx * stride_am + k0 // BLOCK_K, mask=m_ok, other=0.0)
        am = tl.load(absmax_ptr + (n_idx.to(tl.int64) * K + k0) // blocksize, mask=n_ok, other=0.0)
        acc += (a[:, None] * d) * am[None, :]
    acc = tl.math.div_rn(acc, 127.0)  # IEEE division: triton's `/` is approximate on CUDA
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n_idx, mask=n_ok, other=0.0)[None, :]
    tl.store(out_ptr + m_idx[:, None] * N + n_idx[None, :], round_to(acc, X_KIND).to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


_INT8_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def int8_codebook(quant_type: str, device: torch.device) -> torch.Tensor:
    """``rint(127 · codebook / max|codebook|)`` as int8 ``[16]`` on ``device`` (cached)."""
    key = (quant_type, device)
    table = _INT8_TABLES.get(key)
    if table is None:
        values = codebook(quant_type)
        table = _INT8_TABLES[key] = torch.round(127 * values / values.abs().max()).to(torch.int8).to(device)
    return table


def _codebook_a8_dot(x2, packed, absmax, nested_codes, nested_absmax, nested_offset, n, k, blocksize, quant_type, bias,
                     out_dtype):
    m = x2.shape[0]
    q, a = ACTIVATIONS.quantize(x2)  # the reference's codes and scales
    out = torch.empty(m, n, dtype=out_dtype, device=x2.device)
    if m == 0 or n == 0:
        return out
    if absmax is None:
        absmax = double_dequantize(nested_codes.reshape(-1), nested_absmax, nested_offset)
    absmax = absmax.reshape(-1).contiguous()
    b = _fp32(bias)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 32 else 128
    _codebook_a8_dot_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
        q, a, packed.reshape(-1).contiguous(), int8_codebook(quant_type, x2.device), absmax,
        absmax if b is None else b.contiguous(), out, m, n, k, q.stride(0), a.stride(0), blocksize, HAS_BIAS=b is not None,
        X_KIND=ROUND_KINDS[out_dtype], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=ACT_BLOCK, num_warps=4, num_stages=3,
        enable_fp_fusion=False)
    return out


def _fp32(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.to(torch.float32)


def _int4_a8_dot(x2: torch.Tensor, packed, scale, shift, zero, n: int, k: int, group_size: int, code_base: float,
                 bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``[M, N]`` of ``x2 [M, K]`` on int8 tensor cores (module doc)."""
    m = x2.shape[0]
    q, a = ACTIVATIONS.quantize(x2)  # int8 [M, Kp], fp32 [M, Kp / 32]: the reference's codes and scales
    out = torch.empty(m, n, dtype=out_dtype, device=x2.device)
    if m == 0 or n == 0:
        return out
    scale = scale.contiguous()
    shift = None if shift is None else shift.contiguous()
    zero = None if zero is None else zero.contiguous()
    packed = packed.contiguous()
    b = _fp32(bias)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64 if m <= 32 else 128
    grid = (cdiv(m, block_m), cdiv(n, block_n))
    _int4_a8_dot_kernel[grid](q, a, packed, scale, scale if shift is None else shift, scale if zero is None else zero,
                              scale if b is None else b.contiguous(), out, m, n, k, q.stride(0), a.stride(0), packed.stride(0),
                              scale.stride(0), 0 if shift is None else shift.stride(0), 0 if zero is None else zero.stride(0),
                              group_size, float(code_base), HAS_SHIFT=shift is not None, HAS_ZERO=zero is not None,
                              HAS_BIAS=b is not None, X_KIND=ROUND_KINDS[out_dtype], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=ACT_BLOCK,
                              num_warps=4, num_stages=3, enable_fp_fusion=False)
    return out


def int4_groupwise_linear_a8(x, packed, scale, shift, zero, shape, group_size, code_base, bias=None):
    """``torchq::int4_groupwise_linear_a8`` on Triton."""
    check_int4_a8_args(x, packed, scale, shift, zero, shape, group_size, code_base, bias)
    n, k = shape
    x2 = as_rows(x, k)
    if x2.shape[0] > STREAM_MAX_M and group_size % ACT_BLOCK == 0:
        return _int4_a8_dot(x2, packed, scale, shift, zero, n, k, group_size, code_base, bias, x.dtype).reshape(*x.shape[:-1], n)
    xq = ACTIVATIONS.fake_quantize(x.to(torch.float32))
    y = dequant_linear.int4_groupwise_linear(xq, packed, scale, shift, zero, shape, group_size, code_base, 0, 0, _fp32(bias))
    return y.to(x.dtype)


def blockwise_4bit_linear_a8(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type,
                             bias=None):
    """``torchq::blockwise_4bit_linear_a8`` on Triton."""
    check_blockwise_4bit_linear_args(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)
    n, k = shape
    x2 = as_rows(x, k)
    if x2.shape[0] > STREAM_MAX_M and blocksize % ACT_BLOCK == 0:
        return _codebook_a8_dot(x2, packed, absmax, nested_codes, nested_absmax, nested_offset, n, k, blocksize, quant_type, bias,
                                x.dtype).reshape(*x.shape[:-1], n)
    xq = ACTIVATIONS.fake_quantize(x.to(torch.float32))
    y = dequant_linear.blockwise_4bit_linear(xq, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize,
                                             quant_type, _fp32(bias))
    return y.to(x.dtype)
