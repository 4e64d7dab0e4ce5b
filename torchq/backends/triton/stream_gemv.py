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

from .rounding import ROUND_KINDS, round_to

__all__ = ["STREAM_MAX_M", "stream_gemv", "stream_gemv_fits", "StreamTuning", "sum_slices_kernel"]

AFFINE, CODEBOOK = 0, 1
STREAM_MAX_M = 4  # rows decoded once and multiplied per program; above it the tensor-core kernel


class StreamTuning:
    """Launch parameters: ``block_n`` rows x ``block_kw`` words (8 codes each) per step, a grid of
    about ``programs_per_sm`` programs per multiprocessor, ``num_warps`` warps each."""

    __slots__ = ("block_n", "block_kw", "programs_per_sm", "num_warps")

    def __init__(self, block_n: int = 64, block_kw: int = 16, programs_per_sm: int = 16, num_warps: int = 4):
        self.block_n, self.block_kw, self.programs_per_sm, self.num_warps = block_n, block_kw, programs_per_sm, num_warps

    def __repr__(self) -> str:
        return (f"StreamTuning(block_n={self.block_n}, block_kw={self.block_kw}, programs_per_sm={self.programs_per_sm}, "
                f"num_warps={self.num_warps})")


DEFAULT_TUNING = StreamTuning()


@triton.jit
def _stream_gemv_kernel(x_ptr, part_ptr, out_ptr, bias_ptr, M, N, K, stride_xm, words_per_row, groups_per_row, words_per_split,
                        packed_ptr, w0, w1, w2, w3, w4, w5, code_base,
                        FMT: tl.constexpr, OPT_A: tl.constexpr, OPT_B: tl.constexpr, GROUP: tl.constexpr,
                        HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, X_KIND: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """``part[pid_k, m, n] = Σ_{k in slice} x[m, k] · W[n, k]`` (fp32), or with ``DIRECT`` (one
    slice) ``out[m, n] = round(that + bias[n])``; ``ROWS`` = M (compiled per row count), ``BLOCK_M``
    the power of two above it. ``w0..w5``: see :mod:`.dequant_linear`."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < N
    # code j of a word (0..7): bits 4*(j % 4) of the low (j < 4) or high half-word; its element
    # index within the word's 8 (the high nibble of each byte comes first)
    j = tl.arange(0, 8)
    pos = (j % 4) * 4
    nib_mask = 15 << pos
    magic = (150 - pos) << 23  # the float 2^(23 - pos): ulp 2^-pos
    magic_f = magic.to(tl.float32, bitcast=True)
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
        if FMT == 0:
            q = ((src & nib_mask[None, None, :]) | magic[None, None, :]).to(tl.float32, bitcast=True) - magic_f[None, None, :]
        else:
            q = tl.load(w0 + ((src >> pos[None, None, :]) & 15))
        q = tl.reshape(q, (BLOCK_N, GPT, BLOCK_KW // GPT * 8))
        gi = w_lo // WPG + tl.arange(0, GPT)
        gmask = n_ok[:, None] & (gi[None, :] < groups_per_row)
        g = n_idx[:, None] * groups_per_row + gi[None, :]
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
        k_idx = kw[:, None] * 8 + elem[None, :]  # [BKW, 8]
        for mi in tl.static_range(ROWS):
            xv = tl.load(x_ptr + mi * stride_xm + k_idx, mask=k_idx < K, other=0.0).to(tl.float32)
            xg = tl.reshape(xv, (GPT, BLOCK_KW // GPT * 8))
            qx = tl.sum(q * xg[None, :, :], axis=2)  # [BN, GPT]
            if FMT == 0:
                xs = tl.sum(xg, axis=1)[None, :]  # [1, GPT]
                part = scale * (qx + offset * xs)
                if OPT_B:
                    part += zero * xs
            else:
                part = scale * qx
            acc = tl.where(m_idx[:, None] == mi, acc + tl.sum(part, axis=1)[None, :], acc)
    mn_mask = (m_idx[:, None] < M) & n_ok[None, :]
    if DIRECT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_idx, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m_idx[:, None] * N + n_idx[None, :], round_to(acc, X_KIND).to(out_ptr.dtype.element_ty), mask=mn_mask)
    else:
        tl.store(part_ptr + (pid_k * M + m_idx[:, None]) * N + n_idx[None, :], acc, mask=mn_mask)


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


def stream_gemv_fits(packed, m: int, group: int) -> bool:
    """Whether the weight bytes can be read as int32 words: rows whole words long, 4-byte aligned
    (true of every layout's own tensors; a view that starts mid-word is not)."""
    return (0 < m <= STREAM_MAX_M and packed.dim() == 2 and packed.stride(1) == 1 and packed.shape[1] % 4 == 0
            and packed.stride(0) % 4 == 0 and packed.data_ptr() % 4 == 0 and group % 8 == 0)


def _next_pow2(v: int) -> int:
    return 1 << (v - 1).bit_length()


def stream_gemv(x2, out, n: int, k: int, packed, groups_per_row: int, group: int, tensors: tuple, code_base: float, fmt: int,
                opt_a: bool, opt_b: bool, bias, sm_count: int, tuning: StreamTuning = DEFAULT_TUNING, part=None):
    """``out [M, N] = x2 [M, K] @ W.T (+ bias)``; ``x2`` rows contiguous, ``M <= STREAM_MAX_M``;
    ``packed`` passes :func:`stream_gemv_fits`; ``tensors`` ``w0..w5`` (any tensor for unused ones).
    Returns ``out``."""
    import torch

    m = x2.shape[0]
    words = packed.view(torch.int32)
    words_per_row = words.stride(0)
    block_n, block_kw = tuning.block_n, tuning.block_kw
    block_kw = min(block_kw, _next_pow2(words.shape[1]))
    n_blocks = triton.cdiv(n, block_n)
    steps = triton.cdiv(words.shape[1], block_kw)
    split = max(1, min(steps, triton.cdiv(tuning.programs_per_sm * sm_count, n_blocks)))
    steps_per_split = triton.cdiv(steps, split)
    split = triton.cdiv(steps, steps_per_split)
    direct = split == 1
    if not direct and part is None:
        part = torch.empty(split, m, n, dtype=torch.float32, device=x2.device)
    b = words if bias is None else bias
    x_kind = ROUND_KINDS[x2.dtype]
    _stream_gemv_kernel[(n_blocks, split)](
        x2, part if not direct else out, out, b, m, n, k, x2.stride(0), words_per_row, groups_per_row, steps_per_split * block_kw,
        words, *tensors, float(code_base), FMT=fmt, OPT_A=bool(opt_a), OPT_B=bool(opt_b), GROUP=group,
        HAS_BIAS=bias is not None, DIRECT=direct, X_KIND=x_kind, ROWS=m, BLOCK_M=_next_pow2(m), BLOCK_N=block_n, BLOCK_KW=block_kw,
        num_warps=tuning.num_warps)
    if not direct:
        sum_slices_kernel[(triton.cdiv(m * n, 1024),)](part, out, b, m * n, n, split, HAS_BIAS=bias is not None,
                                                         X_KIND=x_kind, BLOCK=1024)
    return out
