"""Tensor cores on the raw 4-bit codes, the group scales factored out (bf16 / fp16 activations).

The layouts' own bytes (``[N, Kp / 2]`` uint8, element ``2j`` in the high nibble of byte ``j``) are
read as int32 words, ``BLOCK_K / 8`` words per row and step; the step's codes ``u`` (0..15) are
spread to a ``[BLOCK_N, BLOCK_K]`` tile in K order and converted to x's dtype, exactly (affine
formats), or looked up in the codebook and rounded once to x's dtype (NF4 / FP4). One ``tl.dot``
of depth ``BLOCK_K`` against the activations ``x [BLOCK_M, BLOCK_K]`` gives ``D = Σ_k x_k·u_k``
(products exact, fp32 sums); a step lies inside one group, so the group's parameters apply once
per step and output in fp32:

* ``AFFINE`` (``w = (u + c_g)·s_g + z_g``, ``c_g = code_base + shift_g``):
  ``acc += s_g·(D + c_g·X) + z_g·X`` with ``X = Σ_k x_k`` over the step;
* ``CODEBOOK`` (``w = codebook[u]·absmax_b``): ``acc += absmax_b·D``.

K slices (split-K when the output tiles do not fill the device) add in slice order
(:func:`~.stream_gemv.sum_slices_kernel`, deterministic); the result is rounded once to x's dtype.

Numeric contract, as :mod:`.stream_gemv`'s: the weight is the exact ``(u + c_g)·s_g + z_g``
(or ``codebook[u]`` in x's dtype times ``absmax``), not the reference's per-weight roundings, so
``|y - y_ref| <= 3·2^-t·Σ_k |x_k·w_k|`` (``t`` = 8 for bf16, 11 for fp16) plus fp32 summation error
``(K/BLOCK_K + 8)·2^-23·Σ_k |x_k|·(|u_k + c_g|·|s_g| + |z_g|)``, then the rounding to x's dtype.
fp32 activations are not taken (the reference-exact kernels serve them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .device import cdiv, next_pow2
from .rounding import ROUND_KINDS, round_to
from .stream_gemv import group_params, store_result, sum_slices_kernel

__all__ = ["FactoredTuning", "FACTORED_TUNING", "factored_dot", "factored_dot_fits"]

AFFINE, CODEBOOK = 0, 1


class FactoredTuning:
    """Launch parameters: ``block_m x block_n`` outputs per program (``block_m`` capped at the rows'
    power of two, at least 16), ``block_k`` codes per step (capped at the group), ``num_warps``,
    ``num_stages``, a grid of about ``programs_per_sm`` programs per multiprocessor (K slices
    added until it fills), and the affine codes' ``decode``: 0 converts ``u`` to x's dtype; 1 ORs it
    into the bits of 128 (bf16) or 1024 (fp16), whose last place is 1, and takes the bias off with
    the group's offset (``D + (c_g - bias)·X``; products still exact, sums larger by the bias).
    The defaults are ``benchmarks/tune_gpu_kernels.py --kernels factored``'s fastest on an H200
    (int4 g128: 0.38-0.47x bf16 cuBLAS at M=16, 0.35-0.44x at M=64; the two decodes within 3%, and
    decode 0 keeps the sums small: fp16's bias of 1024 cost ~10 dB of SQNR;
    reading a ``[block_k, block_n]`` tile of words instead, each K position its word, measured
    10x slower: the rows' words are not contiguous along N)."""

    __slots__ = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "programs_per_sm", "decode")

    def __init__(self, block_m: int = 64, block_n: int = 128, block_k: int = 128, num_warps: int = 4, num_stages: int = 3,
                 programs_per_sm: int = 2, decode: int = 0):
        self.block_m, self.block_n, self.block_k = block_m, block_n, block_k
        self.num_warps, self.num_stages, self.programs_per_sm, self.decode = num_warps, num_stages, programs_per_sm, decode

    def __repr__(self) -> str:
        return (f"FactoredTuning(block_m={self.block_m}, block_n={self.block_n}, block_k={self.block_k}, "
                f"num_warps={self.num_warps}, num_stages={self.num_stages}, programs_per_sm={self.programs_per_sm}, decode={self.decode})")


FACTORED_TUNING = FactoredTuning()


@triton.jit
def _factored_dot_kernel(x_ptr, part_ptr, out_ptr, bias_ptr, M, N, K, stride_xm, words_per_row, groups_per_row, k_per_split,
                         packed_ptr, w0, w1, w2, w3, w4, w5, code_base,
                         FMT: tl.constexpr, OPT_A: tl.constexpr, OPT_B: tl.constexpr, GROUP: tl.constexpr,
                         HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, X_KIND: tl.constexpr, DOT_F32: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DECODE: tl.constexpr):
    """Program (m block, n block, K slice). ``DOT_F32``: the dot's operands widened to fp32
    (exactly) for triton's CPU interpreter, which multiplies bf16 operands wrongly."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m_idx < M
    n_ok = n_idx < N
    BKW: tl.constexpr = BLOCK_K // 8
    MAGIC: tl.constexpr = 0x4300 if X_KIND == 1 else 0x6400
    BIAS: tl.constexpr = (128.0 if X_KIND == 1 else 1024.0) if DECODE == 1 else 0.0
    e = tl.arange(0, 8)
    shifts = 8 * (e // 2) + 4 * (1 - e % 2)  # element e of a word: the high nibble of byte e // 2 for even e
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):  # a step never starts past K: its group exists
        k_idx = k0 + tl.arange(0, BLOCK_K)
        kw = k0 // 8 + tl.arange(0, BKW)
        words = tl.load(packed_ptr + n_idx[:, None] * words_per_row + kw[None, :],
                        mask=n_ok[:, None] & (kw[None, :] < words_per_row), other=0)
        u = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 15, (BLOCK_N, BLOCK_K))  # K order 8·word + e
        xk = tl.load(x_ptr + m_idx[:, None] * stride_xm + k_idx[None, :], mask=m_ok[:, None] & (k_idx[None, :] < K), other=0.0)
        if FMT == 0:
            if DECODE == 1:  # the bits of BIAS + u in x's dtype (bf16 0x4300 = 128, fp16 0x6400 = 1024: unit last place 1)
                wt = (u | MAGIC).to(tl.int16).to(xk.dtype, bitcast=True)
            else:
                wt = u.to(tl.float32).to(xk.dtype)  # 0..15: exact (via fp32: the interpreter converts ints to bf16 wrongly)
        else:
            wt = round_to(tl.load(w0 + u), X_KIND).to(xk.dtype)
        if DOT_F32:
            d = tl.dot(xk.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
        else:
            d = tl.dot(xk, tl.trans(wt))
        g = n_idx * groups_per_row + k0 // GROUP
        scale, offset, zero = group_params(g, n_ok, code_base, w0, w1, w2, w3, w4, w5, FMT, OPT_A, OPT_B)
        if FMT == 0:
            xs = tl.sum(xk.to(tl.float32), axis=1)
            part = scale[None, :] * (d + (offset - BIAS + tl.zeros_like(scale))[None, :] * xs[:, None])
            if OPT_B:
                part += zero[None, :] * xs[:, None]
            acc += part
        else:
            acc += scale[None, :] * d
    store_result(acc, m_idx, n_idx, m_ok[:, None] & n_ok[None, :], out_ptr, part_ptr, bias_ptr, pid_k, M, N, HAS_BIAS, DIRECT, X_KIND)


def factored_dot_fits(x_dtype, packed, group: int, k: int) -> bool:
    """Whether :func:`factored_dot` takes this call: bf16 / fp16 x, the bytes readable as int32 words
    (rows whole words, 4-byte aligned) and groups of at least 16 codes, a power of two."""
    import torch

    return (x_dtype in (torch.bfloat16, torch.float16) and packed.dim() == 2 and packed.stride(1) == 1
            and packed.shape[1] % 4 == 0 and packed.stride(0) % 4 == 0 and packed.data_ptr() % 4 == 0
            and group >= 16 and group & (group - 1) == 0 and 2 * packed.shape[1] >= k)


def factored_dot(x2, out, n: int, k: int, packed, groups_per_row: int, group: int, tensors: tuple, code_base: float, fmt: int,
                 opt_a: bool, opt_b: bool, bias, sm_count: int, tuning: FactoredTuning | None = None):
    """``out [M, N] = x2 [M, K] @ W.T (+ bias)`` (x2 rows contiguous, bf16 or fp16); ``packed``
    passes :func:`factored_dot_fits`; ``tensors`` ``w0..w5`` (any tensor for unused ones). Returns ``out``."""
    import torch

    t = FACTORED_TUNING if tuning is None else tuning
    m = x2.shape[0]
    words = packed.view(torch.int32)
    block_m = max(16, min(t.block_m, next_pow2(m)))
    block_k = max(16, min(t.block_k, group))
    block_n = t.block_n
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    steps = cdiv(k, block_k)
    split = max(1, min(steps, cdiv(t.programs_per_sm * sm_count, tiles)))
    k_per_split = cdiv(steps, split) * block_k
    split = cdiv(k, k_per_split)
    direct = split == 1
    part = out if direct else torch.empty(split, m, n, dtype=torch.float32, device=x2.device)
    b = words if bias is None else bias
    x_kind = ROUND_KINDS[x2.dtype]
    _factored_dot_kernel[(cdiv(m, block_m), cdiv(n, block_n), split)](
        x2, part, out, b, m, n, k, x2.stride(0), words.stride(0), groups_per_row, k_per_split,
        words, *tensors, float(code_base), FMT=fmt, OPT_A=bool(opt_a), OPT_B=bool(opt_b), GROUP=group,
        HAS_BIAS=bias is not None, DIRECT=direct, X_KIND=x_kind, DOT_F32=x2.device.type != "cuda",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DECODE=t.decode, num_warps=t.num_warps, num_stages=t.num_stages)
    if not direct:
        sum_slices_kernel[(cdiv(m * n, 1024),)](part, out, b, m * n, n, split, HAS_BIAS=bias is not None, X_KIND=x_kind, BLOCK=1024)
    return out
