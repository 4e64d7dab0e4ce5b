"""Triton: one-byte weight codes with one fp32 scale per row on CUDA: ``torchq::int8_weight_linear``
(int8 codes) and ``torchq::float8_weight_linear`` (float8_e4m3fn codes; a per-tensor scale is
used as every row's), by the number of rows ``M``:

* ``M <= STREAM_MAX_M`` (4): a streaming GEMV. The codes are read as little-endian int32 words
  (4 codes each, code ``b`` of a word at ``k = 4·word + b``), each code made an exact float without
  an int-to-float conversion (int8: its biased byte XOR-ed into the mantissa of 2^23; e4m3fn: its
  exponent and mantissa bits moved into an fp32's and the exponent rebiased, subnormal codes as
  ``mantissa · 2^-9``), multiplied by x in fp32, the K slices summed in a fixed order (as
  :mod:`.stream_gemv`);
* ``M <= DOT_MAX_M`` (64): tensor cores, the codes cast to x's dtype (exact: |q| <= 128; an
  e4m3fn value has a 4-bit significand and exponents within bf16's and fp16's) against x, fp32
  sums;
* above, or codes that are not whole aligned words: the weight ``(q·s)`` written once in x's
  dtype (bit for bit the reference's) and cuBLAS.

Numeric contract (GEMV and tensor cores): the row scale is factored out,
``y = s_n · Σ_k x_k·q_nk`` in fp32, rounded once to x's dtype (bias added in fp32 first). The
reference rounds each weight ``q·s`` to x's dtype before multiplying; the difference is at most
that rounding, ``|y - y_ref| <= 2^-t · Σ_k |x_k·w_k|`` (``t`` = 8 bf16, 11 fp16, 24 fp32), plus
fp32 summation error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ...ops.float8 import check_float8_weight_args
from ...ops.int8 import check_int8_weight_args
from .device import as_rows, cdiv, next_pow2
from .device import sm_count as _sm_count
from .rounding import ROUND_KINDS, round_to
from .stream_gemv import add_rows, store_result, sum_slices_kernel

__all__ = ["int8_weight_linear", "float8_weight_linear", "STREAM_MAX_M", "DOT_MAX_M"]

STREAM_MAX_M = 4
DOT_MAX_M = 64


INT8, E4M3 = 0, 1  # the CODE kinds: int8 codes, float8_e4m3fn codes


@triton.jit
def _decode_byte(u, CODE: tl.constexpr):
    """Bytes ``u`` (int32 in 0..255) as exact fp32 values: int8 (two's complement) or e4m3fn."""
    if CODE == 0:
        v = (u ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0  # q + 128 in 2^23's mantissa, minus 2^23 + 128
    else:
        mag = u & 0x7F
        normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)  # 2^(e - 7) · (1 + m / 8)
        v = tl.where(mag < 8, (mag & 7).to(tl.float32) * 0.001953125, normal)  # exponent 0: m · 2^-9
        v = tl.where(u >= 128, -v, v)
    return v


@triton.jit
def _byte_code(words, b: tl.constexpr, CODE: tl.constexpr):
    """Code ``b`` (0..3, little-endian byte) of each int32 word as an exact fp32 value."""
    return _decode_byte((words >> (8 * b)) & 255, CODE)


@triton.jit
def _int8_stream_kernel(x_ptr, part_ptr, out_ptr, bias_ptr, scale_ptr, M, N, K, stride_xm, words_per_row, words_per_split,
                        codes_ptr, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, X_KIND: tl.constexpr, ROWS: tl.constexpr,
                        CODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """Program (n block, K slice): ``s_n · Σ_{k in slice} x[m, k]·q[n, k]`` for ``m < ROWS`` (at most 4)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < N
    m_idx = tl.arange(0, BLOCK_M)
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w_start = pid_k * words_per_split
    for w_lo in range(w_start, w_start + words_per_split, BLOCK_KW):
        kw = w_lo + tl.arange(0, BLOCK_KW)
        words = tl.load(codes_ptr + n_idx[:, None] * words_per_row + kw[None, :],
                        mask=n_ok[:, None] & (kw[None, :] < words_per_row), other=0)
        u0 = tl.zeros(words.shape, dtype=tl.float32)
        u1 = tl.zeros(words.shape, dtype=tl.float32)
        u2 = tl.zeros(words.shape, dtype=tl.float32)
        u3 = tl.zeros(words.shape, dtype=tl.float32)
        for b in tl.static_range(4):
            v = _byte_code(words, b, CODE)
            k = kw * 4 + b
            kmask = k < K
            u0 += v * tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
            if ROWS > 1:
                u1 += v * tl.load(x_ptr + stride_xm + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
            if ROWS > 2:
                u2 += v * tl.load(x_ptr + 2 * stride_xm + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
            if ROWS > 3:
                u3 += v * tl.load(x_ptr + 3 * stride_xm + k, mask=kmask, other=0.0).to(tl.float32)[None, :]
        acc0 += tl.sum(u0, axis=1)
        if ROWS > 1:
            acc1 += tl.sum(u1, axis=1)
        if ROWS > 2:
            acc2 += tl.sum(u2, axis=1)
        if ROWS > 3:
            acc3 += tl.sum(u3, axis=1)
    acc = add_rows(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), m_idx, acc0, acc1, acc2, acc3, ROWS)
    acc = acc * tl.load(scale_ptr + n_idx, mask=n_ok, other=0.0)[None, :]
    store_result(acc, m_idx, n_idx, (m_idx[:, None] < M) & n_ok[None, :], out_ptr, part_ptr, bias_ptr, pid_k, M, N, HAS_BIAS, DIRECT, X_KIND)


@triton.jit
def _int8_dot_kernel(x_ptr, part_ptr, out_ptr, bias_ptr, scale_ptr, M, N, K, stride_xm, words_per_row, words_per_split,
                     codes_ptr, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, X_KIND: tl.constexpr, DOT_F32: tl.constexpr,
                     CODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """Program (m block, n block, K slice): ``s_n · (x @ q.T)`` over its slice on tensor cores: code
    ``b`` of every word against the x columns ``4·word + b`` (4 dots of depth ``BLOCK_KW``).
    ``DOT_F32``: operands widened to fp32 (the CPU interpreter multiplies bf16 operands wrongly)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m_idx < M
    n_ok = n_idx < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_start = pid_k * words_per_split
    for w_lo in range(w_start, w_start + words_per_split, BLOCK_KW):
        kw = w_lo + tl.arange(0, BLOCK_KW)
        words = tl.load(codes_ptr + n_idx[:, None] * words_per_row + kw[None, :],
                        mask=n_ok[:, None] & (kw[None, :] < words_per_row), other=0)
        for b in tl.static_range(4):
            k = kw * 4 + b
            xb = tl.load(x_ptr + m_idx[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0)
            qt = tl.trans(_byte_code(words, b, CODE))
            if X_KIND == 0 or DOT_F32:
                acc += tl.dot(xb.to(tl.float32), qt, input_precision="ieee")
            else:
                acc += tl.dot(xb, qt.to(xb.dtype))
    acc = acc * tl.load(scale_ptr + n_idx, mask=n_ok, other=0.0)[None, :]
    store_result(acc, m_idx, n_idx, m_ok[:, None] & n_ok[None, :], out_ptr, part_ptr, bias_ptr, pid_k, M, N, HAS_BIAS, DIRECT, X_KIND)


@triton.jit
def _int8_dequant_kernel(codes_ptr, scale_ptr, out_ptr, N, K, stride_cn, X_KIND: tl.constexpr, CODE: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[n, k] = round(q[n, k] · s_n)`` in out's dtype: the reference's weight bit for bit
    (``codes_ptr``: the code bytes as uint8)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    mask = (n < N) & (k < K)
    q = _decode_byte(tl.load(codes_ptr + n * stride_cn + k, mask=mask, other=0).to(tl.int32) & 255, CODE)
    w = round_to(q * tl.load(scale_ptr + n, mask=n < N, other=0.0), X_KIND)
    tl.store(out_ptr + n * K + k, w.to(out_ptr.dtype.element_ty), mask=mask)


def _words(codes: torch.Tensor) -> torch.Tensor | None:
    """The codes as int32 words ``[N, K/4]`` (rows whole words, 4-byte aligned), else None."""
    if codes.stride(1) != 1 or codes.shape[1] % 4 or codes.stride(0) % 4 or codes.data_ptr() % 4:
        return None
    return codes.view(torch.int32)


def int8_weight_linear(x, codes, scale, bias=None):
    """``torchq::int8_weight_linear`` on Triton (see the module doc)."""
    check_int8_weight_args(x, codes, scale, bias)
    return _byte_weight_linear(x, codes, scale.reshape(-1), bias, INT8)


def float8_weight_linear(x, codes, scale, bias=None):
    """``torchq::float8_weight_linear`` on Triton (see the module doc)."""
    check_float8_weight_args("float8_weight_linear", x, codes, scale, bias)
    return _byte_weight_linear(x, codes, scale.reshape(-1).expand(codes.shape[0]), bias, E4M3)


def _byte_weight_linear(x, codes, scale, bias, code: int):
    n, k = codes.shape
    x2 = as_rows(x, k)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    scale = scale.reshape(-1).to(torch.float32).contiguous()
    bias = None if bias is None else bias.reshape(-1).to(x.dtype).contiguous()
    words = _words(codes)
    x_kind = ROUND_KINDS[x.dtype]
    if words is None or m > DOT_MAX_M:
        w = torch.empty(n, k, dtype=x.dtype, device=x.device)
        _int8_dequant_kernel[(cdiv(n, 32), cdiv(k, 128))](codes.view(torch.uint8), scale, w, n, k, codes.stride(0),
                                                          X_KIND=x_kind, CODE=code, BLOCK_N=32, BLOCK_K=128, num_warps=4)
        return F.linear(x2, w, bias).reshape(*x.shape[:-1], n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    b = words if bias is None else bias
    per_row = words.stride(0)
    if m <= STREAM_MAX_M:
        block_n, block_kw = 64, 32
        grid_n = cdiv(n, block_n)
        programs = 16 * _sm_count(x.device)
    else:
        block_m, block_n, block_kw = (16 if m <= 16 else 64), 64, 32
        grid_n = cdiv(m, block_m) * cdiv(n, block_n)
        programs = 4 * _sm_count(x.device)
    steps = cdiv(words.shape[1], block_kw)
    split = max(1, min(steps, cdiv(programs, grid_n)))
    per_split = cdiv(steps, split)
    split = cdiv(steps, per_split)
    direct = split == 1
    part = out if direct else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    args = (x2, part, out, b, scale, m, n, k, x2.stride(0), per_row, per_split * block_kw, words)
    if m <= STREAM_MAX_M:
        _int8_stream_kernel[(cdiv(n, block_n), split)](
            *args, HAS_BIAS=bias is not None, DIRECT=direct, X_KIND=x_kind, ROWS=m, CODE=code, BLOCK_M=next_pow2(m),
            BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=4)
    else:
        _int8_dot_kernel[(cdiv(m, block_m), cdiv(n, block_n), split)](
            *args, HAS_BIAS=bias is not None, DIRECT=direct, X_KIND=x_kind, DOT_F32=x.device.type != "cuda", CODE=code,
            BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=4, num_stages=3)
    if not direct:
        sum_slices_kernel[(cdiv(m * n, 1024),)](part, out, b, m * n, n, split, HAS_BIAS=bias is not None, X_KIND=x_kind,
                                                        BLOCK=1024)
    return out.reshape(*x.shape[:-1], n)
