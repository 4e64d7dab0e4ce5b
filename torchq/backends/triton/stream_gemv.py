"""A streaming GEMV for 4-bit weights at ``M <= STREAM_MAX_M`` rows (decode): the weight is read
once, in long contiguous runs, by a large grid of short programs.

Weight bytes are the layouts' own (no CUDA-only packing): ``[N, Kp / 2]`` uint8, element ``2j`` of
a row in the high nibble of byte ``j``, read here as little-endian int32 words (8 codes each), so a
row ``Kp / 8`` words long (``Kp`` a multiple of 8, the row start 4-byte aligned). Formats, as in
:mod:`.dequant_linear`: ``AFFINE`` (``(u + code_base + shift) · scale + zero`` per row group) and
``CODEBOOK`` (``codebook[u] · absmax``, absmax plain or double-quantized).

Program ``(n block, K slice)`` covers ``BLOCK_N`` rows and ``K slice`` words in steps of
``BLOCK_KW`` words; the K slices' fp32 partial sums go to a ``[SPLIT, M, N]`` buffer that a
second kernel adds in slice order (deterministic, no atomics), adds the bias and rounds once.

Decoding costs about one integer and two float instructions per code: the nibble at bit ``p`` of a
word is masked and OR-ed into the mantissa of the float ``2^(23 - p)``, whose unit in the last place
is then ``2^-p``, so subtracting ``2^(23 - p)`` leaves the code as an exact float (no shift, no
int-to-float conversion).

Numeric contract (``AFFINE``): the scale and zero are factored out of each group,
``y = Σ_g [scale_g · (Σ_k x_k·u_k + c_g · Σ_k x_k) + zero_g · Σ_k x_k]`` in fp32 (``c_g`` =
``code_base + shift_g``), rounded once to x's dtype. The reference rounds each weight to the scale
dtype and to x's dtype before multiplying; this kernel uses the exact weight instead, so it
differs from the reference by at most those per-weight roundings, ``|y - y_ref| <= 3·2^-t ·
Σ_k |x_k · w_k|`` (``t`` = 8 for bf16, 11 for fp16 and 24 for fp32 arithmetic), plus fp32
summation error. ``CODEBOOK``: ``y = Σ_b absmax_b · Σ_k x_k·codebook[u_k]``, the same bound with
the one rounding of the weight to x's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .device import cdiv, next_pow2
from .rounding import ROUND_KINDS, round_to

__all__ = ["STREAM_MAX_M", "stream_gemv", "stream_gemv_fits", "words_fit", "StreamTuning", "DotTuning", "DOT_TUNING", "dot_words",
           "sum_slices_kernel", "store_result", "group_params", "add_rows"]

AFFINE, CODEBOOK = 0, 1
STREAM_MAX_M = 4  # rows decoded once and multiplied per program; above it the tensor-core kernel


class StreamTuning:
    """Launch parameters: ``block_n`` rows x ``block_kw`` words (8 codes each) per step, a grid of
    about ``programs_per_sm`` programs per multiprocessor (0: 32 for weights of 2^27 codes or more,
    else 8), ``num_warps`` warps each, ``decode`` (see ``_code``). The defaults are the fastest of
    ``benchmarks/tune_gpu_kernels.py``'s candidates on an H200 (int4 g128, M=1: 1.07-1.14x bf16 on
    8192x8192, 8192x28672 and 28672x8192, 0.75x on 4096x4096)."""

    __slots__ = ("block_n", "block_kw", "programs_per_sm", "num_warps", "decode")

    def __init__(self, block_n: int = 64, block_kw: int = 16, programs_per_sm: int = 0, num_warps: int = 4, decode: int = 2):
        self.block_n, self.block_kw, self.programs_per_sm, self.num_warps = block_n, block_kw, programs_per_sm, num_warps
        self.decode = decode

    def __repr__(self) -> str:
        return (f"StreamTuning(block_n={self.block_n}, block_kw={self.block_kw}, programs_per_sm={self.programs_per_sm}, "
                f"num_warps={self.num_warps}, decode={self.decode})")


DEFAULT_TUNING = StreamTuning()


@triton.jit
def store_result(acc, m_idx, n_idx, mask, out_ptr, part_ptr, bias_ptr, pid_k, M, N, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr,
                 X_KIND: tl.constexpr):
    """A program's fp32 sums ``acc [BLOCK_M, BLOCK_N]``: with ``DIRECT`` (one K slice) ``round(acc +
    bias)`` to ``out [M, N]``, else to its slice of ``part [SPLIT, M, N]`` (:func:`sum_slices_kernel`)."""
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_idx, mask=n_idx < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m_idx[:, None] * N + n_idx[None, :], round_to(acc, X_KIND).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (pid_k * M + m_idx[:, None]) * N + n_idx[None, :], acc, mask=mask)


@triton.jit
def group_params(g, gmask, code_base, w0, w1, w2, w3, w4, w5, FMT: tl.constexpr, OPT_A: tl.constexpr, OPT_B: tl.constexpr):
    """``(scale, offset, zero)`` of the groups ``g`` (fp32): AFFINE ``scale``, ``offset = code_base
    (+ shift)``, ``zero`` (0 without OPT_B); CODEBOOK the block's absmax (double-quantized with
    OPT_A) as ``scale``, offset and zero 0. ``w0..w5``: see :mod:`.dequant_linear`."""
    zero = 0.0
    offset = 0.0
    if FMT == 0:
        scale = tl.load(w0 + g, mask=gmask, other=0.0)
        offset = code_base
        if OPT_A:
            offset = offset + tl.load(w1 + g, mask=gmask, other=0.0)
        if OPT_B:
            zero = tl.load(w2 + g, mask=gmask, other=0.0)
    else:
        if OPT_A:
            c = tl.load(w2 + g, mask=gmask, other=0).to(tl.int32)
            scale = tl.load(w4 + c) * tl.load(w3 + g // 256, mask=gmask, other=0.0) + tl.load(w5)
        else:
            scale = tl.load(w1 + g, mask=gmask, other=0.0)
    return scale, offset, zero


@triton.jit
def add_rows(acc, m_idx, r0, r1, r2, r3, ROWS: tl.constexpr):
    """``acc [BLOCK_M, BLOCK_N]`` plus the per-output sums ``r0..r3`` of rows 0..ROWS-1 (at most 4)."""
    acc += tl.where(m_idx[:, None] == 0, r0[None, :], 0.0)
    if ROWS > 1:
        acc += tl.where(m_idx[:, None] == 1, r1[None, :], 0.0)
    if ROWS > 2:
        acc += tl.where(m_idx[:, None] == 2, r2[None, :], 0.0)
    if ROWS > 3:
        acc += tl.where(m_idx[:, None] == 3, r3[None, :], 0.0)
    return acc


@triton.jit
def _code(words, e: tl.constexpr, DECODE: tl.constexpr):
    """Code ``e`` (0..7) of each int32 word as an exact fp32 value: element ``e`` sits in byte
    ``e // 2``, the high nibble for even ``e``. DECODE 0: shift, then mask and OR into the
    mantissa of 2^23 (one LOP3) and subtract 2^23; 1: shift, mask and convert; 2: mask in place
    and OR into the mantissa of 2^(23 - p) (no shift for the low three bytes)."""
    p: tl.constexpr = 8 * (e // 2) + 4 * (1 - e % 2)
    if DECODE == 1:
        return ((words >> p) & 15).to(tl.float32)
    if DECODE == 2 and p <= 16:
        magic: tl.constexpr = (150 - p) << 23
        return ((words & (15 << p)) | magic).to(tl.float32, bitcast=True) - tl.full((), magic, tl.int32).to(tl.float32, bitcast=True)
    return (((words >> p) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _nibble(words, e: tl.constexpr):
    """Code ``e`` (0..7) of each int32 word as an int32 0..15."""
    p: tl.constexpr = 8 * (e // 2) + 4 * (1 - e % 2)
    return (words >> p) & 15


@triton.jit
def _row_part(ux, xs, scale, offset, zero, FMT: tl.constexpr, OPT_B: tl.constexpr):
    """One row's sums over a step, per output (``[BN]``): the word's group scale (and zero) applied per word."""
    if FMT == 0:
        part = scale * (ux + offset * xs[None, :])
        if OPT_B:
            part += zero * xs[None, :]
    else:
        part = scale * ux
    return tl.sum(part, axis=1)


@triton.jit
def _step_rows(words, scale, offset, zero, w0, x_ptr, stride_xm, k_base, K, FMT: tl.constexpr, OPT_B: tl.constexpr,
               DECODE: tl.constexpr, ROWS: tl.constexpr):
    """``Σ_k x[r, k] · W[n, k]`` over one step's words (``[BN, BKW]``) for rows ``r < ROWS`` (at
    most 4; the others 0), per output ``n``: each code decoded once and multiplied by every row."""
    ux0 = tl.zeros(words.shape, dtype=tl.float32)
    ux1 = tl.zeros(words.shape, dtype=tl.float32)
    ux2 = tl.zeros(words.shape, dtype=tl.float32)
    ux3 = tl.zeros(words.shape, dtype=tl.float32)
    xs0 = tl.zeros((words.shape[1],), dtype=tl.float32)
    xs1 = tl.zeros((words.shape[1],), dtype=tl.float32)
    xs2 = tl.zeros((words.shape[1],), dtype=tl.float32)
    xs3 = tl.zeros((words.shape[1],), dtype=tl.float32)
    for e in tl.static_range(8):
        k = k_base + e
        kmask = k < K
        if FMT == 0:
            v = _code(words, e, DECODE)
        else:
            v = tl.load(w0 + _nibble(words, e))
        x0 = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        ux0 += v * x0[None, :]
        xs0 += x0
        if ROWS > 1:
            x1 = tl.load(x_ptr + stride_xm + k, mask=kmask, other=0.0).to(tl.float32)
            ux1 += v * x1[None, :]
            xs1 += x1
        if ROWS > 2:
            x2 = tl.load(x_ptr + 2 * stride_xm + k, mask=kmask, other=0.0).to(tl.float32)
            ux2 += v * x2[None, :]
            xs2 += x2
        if ROWS > 3:
            x3 = tl.load(x_ptr + 3 * stride_xm + k, mask=kmask, other=0.0).to(tl.float32)
            ux3 += v * x3[None, :]
            xs3 += x3
    r0 = _row_part(ux0, xs0, scale, offset, zero, FMT, OPT_B)
    r1 = r0 * 0.0
    r2 = r0 * 0.0
    r3 = r0 * 0.0
    if ROWS > 1:
        r1 = _row_part(ux1, xs1, scale, offset, zero, FMT, OPT_B)
    if ROWS > 2:
        r2 = _row_part(ux2, xs2, scale, offset, zero, FMT, OPT_B)
    if ROWS > 3:
        r3 = _row_part(ux3, xs3, scale, offset, zero, FMT, OPT_B)
    return r0, r1, r2, r3


@triton.jit
def _stream_gemv_kernel(x_ptr, part_ptr, out_ptr, bias_ptr, M, N, K, stride_xm, words_per_row, groups_per_row, words_per_split,
                        packed_ptr, w0, w1, w2, w3, w4, w5, code_base,
                        FMT: tl.constexpr, OPT_A: tl.constexpr, OPT_B: tl.constexpr, GROUP: tl.constexpr,
                        HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, X_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, DECODE: tl.constexpr):
    """``part[pid_k, m, n] = Σ_{k in slice} x[m, k] · W[n, k]`` (fp32), or with ``DIRECT`` (one
    slice) ``out[m, n] = round(that + bias[n])``; ``ROWS`` = M (compiled per row count), ``BLOCK_M``
    the power of two above it. ``w0..w5``: see :mod:`.dequant_linear`. Every tensor is 2-D
    ``[BLOCK_N, BLOCK_KW]`` in the words' own layout: the 8 codes of a word are taken one at a
    time, each against the x values at its 8 K positions."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < N
    WPG: tl.constexpr = GROUP // 8  # words per group
    m_idx = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_start = pid_k * words_per_split
    for w_lo in range(w_start, w_start + words_per_split, BLOCK_KW):
        kw = w_lo + tl.arange(0, BLOCK_KW)
        wmask = n_ok[:, None] & (kw[None, :] < words_per_row)
        words = tl.load(packed_ptr + n_idx[:, None] * words_per_row + kw[None, :], mask=wmask, other=0)
        if WPG >= BLOCK_KW:  # one group per step: one scale per row
            g = (n_idx * groups_per_row + w_lo // WPG)[:, None]
            gmask = n_ok[:, None]
        else:  # a scale per word, gathered (cached)
            g = n_idx[:, None] * groups_per_row + (kw // WPG)[None, :]
            gmask = wmask
        scale, offset, zero = group_params(g, gmask, code_base, w0, w1, w2, w3, w4, w5, FMT, OPT_A, OPT_B)
        r0, r1, r2, r3 = _step_rows(words, scale, offset, zero, w0, x_ptr, stride_xm, kw * 8, K, FMT, OPT_B, DECODE, ROWS)
        acc = add_rows(acc, m_idx, r0, r1, r2, r3, ROWS)
    store_result(acc, m_idx, n_idx, (m_idx[:, None] < M) & n_ok[None, :], out_ptr, part_ptr, bias_ptr, pid_k, M, N, HAS_BIAS, DIRECT, X_KIND)


@triton.jit
def _dot_words_kernel(x_ptr, part_ptr, out_ptr, bias_ptr, M, N, K, stride_xm, words_per_row, groups_per_row, words_per_split,
                      packed_ptr, w0, w1, w2, w3, w4, w5, code_base,
                      FMT: tl.constexpr, OPT_A: tl.constexpr, OPT_B: tl.constexpr, ROUND_MUL: tl.constexpr,
                      ROUND_ADD: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr,
                      X_KIND: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_KW: tl.constexpr, DECODE: tl.constexpr):
    """Program (m block, n block, K slice): ``x[m block] @ W[n block].T`` over its slice on tensor
    cores. Each step loads ``[BLOCK_N, BLOCK_KW]`` int32 words; code ``e`` of every word forms
    the weights at K positions ``8·word + e`` exactly as the reference forms them (the same fp32
    operations and roundings, cast to x's dtype), multiplied by the x columns at those positions:
    8 dots of depth ``BLOCK_KW`` per step (a dot's sum does not depend on the order of K). fp32 x:
    fp32 dots (no TF32); ``DOT_F32``: operands widened to fp32 (triton's CPU interpreter multiplies
    bf16 operands wrongly, triton 3.9). Partial sums to ``part [SPLIT, M, N]``, or with ``DIRECT``
    the rounded result (+ bias) to ``out``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < N
    m_ok = m_idx < M
    WPG: tl.constexpr = GROUP // 8
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_start = pid_k * words_per_split
    for w_lo in range(w_start, w_start + words_per_split, BLOCK_KW):
        kw = w_lo + tl.arange(0, BLOCK_KW)
        wmask = n_ok[:, None] & (kw[None, :] < words_per_row)
        words = tl.load(packed_ptr + n_idx[:, None] * words_per_row + kw[None, :], mask=wmask, other=0)
        if WPG >= BLOCK_KW:
            g = (n_idx * groups_per_row + w_lo // WPG)[:, None]
            gmask = n_ok[:, None]
        else:
            g = n_idx[:, None] * groups_per_row + (kw // WPG)[None, :]
            gmask = wmask
        # offset = code_base + shift: integers, so u + offset is the reference's (u + code_base) + shift exactly
        scale, offset, zero = group_params(g, gmask, code_base, w0, w1, w2, w3, w4, w5, FMT, OPT_A, OPT_B)
        for e in tl.static_range(8):
            k = kw * 8 + e
            xe = tl.load(x_ptr + m_idx[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0)
            if FMT == 0:
                v = round_to((_code(words, e, DECODE) + offset) * scale, ROUND_MUL)
                if OPT_B:
                    v = round_to(v + zero, ROUND_ADD)
            else:
                v = tl.load(w0 + _nibble(words, e)) * scale
            v = tl.where(k[None, :] < K, v, 0.0)
            wt = tl.trans(round_to(v, X_KIND).to(xe.dtype))
            if X_KIND == 0 or DOT_F32:
                acc += tl.dot(xe.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(xe, wt)
    store_result(acc, m_idx, n_idx, m_ok[:, None] & n_ok[None, :], out_ptr, part_ptr, bias_ptr, pid_k, M, N, HAS_BIAS, DIRECT, X_KIND)


@triton.jit
def _stream_gemv_lut_kernel(x_ptr, part_ptr, out_ptr, bias_ptr, M, N, K, stride_xm, words_per_row, groups_per_row, words_per_split,
                            packed_ptr, w0, w1, w2, w3, w4, w5, code_base,
                            FMT: tl.constexpr, OPT_A: tl.constexpr, OPT_B: tl.constexpr, GROUP: tl.constexpr,
                            HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, X_KIND: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """:func:`_stream_gemv_kernel` for the codebook formats (``FMT`` 1), on ``[BLOCK_N, BLOCK_KW, 8]``
    tiles: the codes of a whole step looked up at once, then reshaped by group. On an H200 this
    measured 118 us against 273 us for the 2-D kernel's per-code lookups (NF4, 8192x28672, M=1); the
    mantissa decode of the affine formats measured 3.5x slower on such 3-D tiles than in the 2-D kernel."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < N
    # code j of a word (0..7): bits 4*(j % 4) of the low (j < 4) or high half-word; its element
    # index within the word's 8 (the high nibble of each byte comes first)
    j = tl.arange(0, 8)
    pos = (j % 4) * 4
    elem = (j // 4) * 4 + ((j % 4) // 2) * 2 + 1 - (j % 2)
    high_half = (j >= 4)[None, None, :]
    WPG: tl.constexpr = GROUP // 8  # words per group
    GPT: tl.constexpr = BLOCK_KW // WPG if WPG < BLOCK_KW else 1  # groups per step
    m_idx = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_start = pid_k * words_per_split
    for w_lo in range(w_start, w_start + words_per_split, BLOCK_KW):
        kw = w_lo + tl.arange(0, BLOCK_KW)
        words = tl.load(packed_ptr + n_idx[:, None] * words_per_row + kw[None, :],
                        mask=n_ok[:, None] & (kw[None, :] < words_per_row), other=0)
        src = tl.where(high_half, (words >> 16)[:, :, None], words[:, :, None])  # [BN, BKW, 8]
        q = tl.reshape(tl.load(w0 + ((src >> pos[None, None, :]) & 15)), (BLOCK_N, GPT, BLOCK_KW // GPT * 8))
        gi = w_lo // WPG + tl.arange(0, GPT)
        scale, _, _ = group_params(n_idx[:, None] * groups_per_row + gi[None, :], n_ok[:, None] & (gi[None, :] < groups_per_row),
                                   code_base, w0, w1, w2, w3, w4, w5, FMT, OPT_A, OPT_B)
        k_idx = kw[:, None] * 8 + elem[None, :]  # [BKW, 8]
        for mi in tl.static_range(ROWS):
            xv = tl.load(x_ptr + mi * stride_xm + k_idx, mask=k_idx < K, other=0.0).to(tl.float32)
            qx = tl.sum(q * tl.reshape(xv, (GPT, BLOCK_KW // GPT * 8))[None, :, :], axis=2)  # [BN, GPT]
            acc = tl.where(m_idx[:, None] == mi, acc + tl.sum(scale * qx, axis=1)[None, :], acc)
    store_result(acc, m_idx, n_idx, (m_idx[:, None] < M) & n_ok[None, :], out_ptr, part_ptr, bias_ptr, pid_k, M, N, HAS_BIAS, DIRECT, X_KIND)


@triton.jit
def sum_slices_kernel(part_ptr, out_ptr, bias_ptr, MN, N, SPLIT, HAS_BIAS: tl.constexpr, X_KIND: tl.constexpr,
                       BLOCK: tl.constexpr):
    """``out = round(Σ_s part[s] (+ bias))`` over fp32 ``[SPLIT, M, N]`` partial sums, in slice order."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.load(part_ptr + i, mask=mask, other=0.0)
    for s in range(1, SPLIT):
        acc += tl.load(part_ptr + s * MN + i, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, round_to(acc, X_KIND).to(out_ptr.dtype.element_ty), mask=mask)


def words_fit(packed, group: int) -> bool:
    """Whether the weight bytes can be read as int32 words: rows whole words long, 4-byte aligned
    (true of every layout's own tensors; a view that starts mid-word is not)."""
    return (packed.dim() == 2 and packed.stride(1) == 1 and packed.shape[1] % 4 == 0
            and packed.stride(0) % 4 == 0 and packed.data_ptr() % 4 == 0 and group % 8 == 0)


def stream_gemv_fits(packed, m: int, group: int) -> bool:
    """Whether :func:`stream_gemv` takes ``m`` rows on these bytes (:func:`words_fit`)."""
    return 0 < m <= STREAM_MAX_M and words_fit(packed, group)



def stream_gemv(x2, out, n: int, k: int, packed, groups_per_row: int, group: int, tensors: tuple, code_base: float, fmt: int,
                opt_a: bool, opt_b: bool, bias, sm_count: int, tuning: StreamTuning | None = None, part=None):
    """``out [M, N] = x2 [M, K] @ W.T (+ bias)``; ``x2`` rows contiguous, ``M <= STREAM_MAX_M``;
    ``packed`` passes :func:`stream_gemv_fits`; ``tensors`` ``w0..w5`` (any tensor for unused ones).
    Returns ``out``."""
    import torch

    tuning = DEFAULT_TUNING if tuning is None else tuning
    m = x2.shape[0]
    words = packed.view(torch.int32)
    words_per_row = words.stride(0)
    block_n, block_kw = tuning.block_n, tuning.block_kw
    block_kw = min(block_kw, next_pow2(words.shape[1]))
    n_blocks = cdiv(n, block_n)
    steps = cdiv(words.shape[1], block_kw)
    pps = tuning.programs_per_sm or (32 if n * k >= 1 << 27 else 8)
    split = max(1, min(steps, cdiv(pps * sm_count, n_blocks)))
    steps_per_split = cdiv(steps, split)
    split = cdiv(steps, steps_per_split)
    direct = split == 1
    if not direct and part is None:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x2.device)
    b = words if bias is None else bias
    x_kind = ROUND_KINDS[x2.dtype]
    args = (x2, part if not direct else out, out, b, m, n, k, x2.stride(0), words_per_row, groups_per_row, steps_per_split * block_kw,
            words, *tensors, float(code_base))
    meta = dict(FMT=fmt, OPT_A=bool(opt_a), OPT_B=bool(opt_b), GROUP=group, HAS_BIAS=bias is not None, DIRECT=direct, X_KIND=x_kind,
                ROWS=m, BLOCK_M=next_pow2(m), BLOCK_N=block_n, BLOCK_KW=block_kw, num_warps=tuning.num_warps)
    if fmt == AFFINE:
        _stream_gemv_kernel[(n_blocks, split)](*args, **meta, DECODE=tuning.decode)
    else:
        _stream_gemv_lut_kernel[(n_blocks, split)](*args, **meta)
    if not direct:
        sum_slices_kernel[(cdiv(m * n, 1024),)](part, out, b, m * n, n, split, HAS_BIAS=bias is not None,
                                                         X_KIND=x_kind, BLOCK=1024)
    return out


class DotTuning:
    """Launch parameters of the tensor-core kernel: ``block_m x block_n`` outputs per program,
    ``block_kw`` words (8 codes each) per step, at least 16 (the depth of each of its 8 dots),
    about ``programs_per_sm`` programs per multiprocessor; ``decode`` as :class:`StreamTuning`'s."""

    __slots__ = ("block_m", "block_n", "block_kw", "num_warps", "num_stages", "programs_per_sm", "decode")

    def __init__(self, block_m: int = 64, block_n: int = 64, block_kw: int = 16, num_warps: int = 4, num_stages: int = 3,
                 programs_per_sm: int = 4, decode: int = 0):
        self.block_m, self.block_n, self.block_kw, self.num_warps = block_m, block_n, block_kw, num_warps
        self.num_stages, self.programs_per_sm, self.decode = num_stages, programs_per_sm, decode


DOT_TUNING = DotTuning()


def dot_words(x2, out, n: int, k: int, packed, groups_per_row: int, group: int, tensors: tuple, code_base: float, fmt: int,
              opt_a: bool, opt_b: bool, round_mul: int, round_add: int, bias, sm_count: int, tuning: DotTuning | None = None):
    """``out [M, N] = x2 [M, K] @ W.T (+ bias)`` by :func:`_dot_words_kernel`, split over K until
    the grid fills the device; ``packed`` passes :func:`stream_gemv_fits` (any M). Returns ``out``."""
    import torch

    t = DOT_TUNING if tuning is None else tuning
    m = x2.shape[0]
    words = packed.view(torch.int32)
    words_per_row = words.stride(0)
    block_m = max(16, min(t.block_m, next_pow2(m)))
    block_n, block_kw = t.block_n, max(16, t.block_kw)
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    steps = cdiv(words.shape[1], block_kw)
    split = max(1, min(steps, cdiv(t.programs_per_sm * sm_count, tiles)))
    steps_per_split = cdiv(steps, split)
    split = cdiv(steps, steps_per_split)
    direct = split == 1
    part = out if direct else torch.empty(split, m, n, dtype=torch.float32, device=x2.device)
    b = words if bias is None else bias
    x_kind = ROUND_KINDS[x2.dtype]
    _dot_words_kernel[(cdiv(m, block_m), cdiv(n, block_n), split)](
        x2, part, out, b, m, n, k, x2.stride(0), words_per_row, groups_per_row, steps_per_split * block_kw,
        words, *tensors, float(code_base), FMT=fmt, OPT_A=bool(opt_a), OPT_B=bool(opt_b), ROUND_MUL=round_mul,
        ROUND_ADD=round_add, GROUP=group, HAS_BIAS=bias is not None, DIRECT=direct, X_KIND=x_kind,
        DOT_F32=x2.device.type != "cuda", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw, DECODE=t.decode,
        num_warps=t.num_warps, num_stages=t.num_stages, enable_fp_fusion=False)
    if not direct:
        sum_slices_kernel[(cdiv(m * n, 1024),)](part, out, b, m * n, n, split, HAS_BIAS=bias is not None,
                                                        X_KIND=x_kind, BLOCK=1024)
    return out
