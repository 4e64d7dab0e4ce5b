"""Triton: tinygemm's tiled int4 weight (:mod:`torchq.layouts.tensor_core_tiled`) written out as
bf16 ``[Np, Kp]``, bit for bit :func:`torchq.ops.int4.tinygemm_dequantize`.

``aten._weight_int4pack_mm`` slows down steeply with the number of rows (on an H200, 8192x28672:
1.7x bf16 cuBLAS at M=1, 0.44x at 16, 0.12x at 64, 0.04x at 1024), so from ``TINYGEMM_MAX_M``
rows the CUDA implementation of ``torchq::int4_tensor_core_mm`` writes the weight once with this
kernel and multiplies by cuBLAS: the op's reference's own two steps.

Each weight is ``(q - 8)·s + z`` rounded once to bf16 (tinygemm's one FMA). In fp32 the product
is exact (a 4-bit code times an 8-bit significand); the sum is added with its exact error
(TwoSum) and rounded to odd, so that the final rounding to bf16 is the single correct rounding
of the exact value. Kernels run with ``enable_fp_fusion=False`` (no contraction into an FMA).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .device import cdiv
from .rounding import round_to

__all__ = ["TINYGEMM_MAX_M", "tiled_dequantize"]

TINYGEMM_MAX_M = 32  # rows from which dequantize + cuBLAS replaces tinygemm (see the module doc)


@triton.jit
def _tiled_dequant_kernel(packed_ptr, sz_ptr, out_ptr, NP, KP, K_TILES, T: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n block, k block): ``out[n, k]`` for its tile. Word ``[nt, kt, lane, j]`` (int32,
    flat) holds row ``8·nt + lane // 4``; code ``k = 16·(kt·T + 2j + tile) + 8·half + 2c + e``
    (``c = lane % 4``) sits in nibble slot ``4e + 2·tile + half``."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    mask = (n < NP) & (k < KP)
    r = k % 16
    half = r // 8
    c = (r % 8) // 2
    e = r % 2
    q16 = k // 16
    kt = q16 // T
    rem = q16 % T
    j = rem // 2
    tile = rem % 2
    lane = 4 * (n % 8) + c
    word = (((n // 8) * K_TILES + kt) * 32 + lane) * (T // 2) + j
    w = tl.load(packed_ptr + word, mask=mask, other=0)
    code = (w >> (4 * (4 * e + 2 * tile + half))) & 15
    g = k // GROUP
    s = tl.load(sz_ptr + (g * NP + n) * 2, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(sz_ptr + (g * NP + n) * 2 + 1, mask=mask, other=0.0).to(tl.float32)
    p = (code - 8).to(tl.float32) * s  # exact
    total = p + z
    bb = total - p
    err = (p - (total - bb)) + (z - bb)  # total + err == p + z exactly
    bits = total.to(tl.int32, bitcast=True)
    # round to odd: an inexact sum with an even last bit moves one unit toward the exact value
    toward = tl.where((err > 0) == (total > 0), 1, -1)
    odd = tl.where((err != 0) & ((bits & 1) == 0) & (total == total), bits + toward, bits)
    v = round_to(odd.to(tl.float32, bitcast=True), 1)
    tl.store(out_ptr + n * KP + k, v.to(out_ptr.dtype.element_ty), mask=mask)


def tiled_dequantize(packed, scales_and_zeros, group_size: int):
    """bf16 ``[Np, Kp]``: the weights of tinygemm's ``packed`` int32 ``[Np/8, Kp/(16t), 32, t/2]``
    with ``scales_and_zeros`` bf16 ``[Kp/g, Np, 2]``."""
    import torch

    np_, kp = scales_and_zeros.shape[1], scales_and_zeros.shape[0] * group_size
    t = packed.shape[-1] * 2
    out = torch.empty(np_, kp, dtype=torch.bfloat16, device=packed.device)
    if out.numel() == 0:
        return out
    block_n, block_k = 32, 128
    _tiled_dequant_kernel[(cdiv(np_, block_n), cdiv(kp, block_k))](
        packed.contiguous(), scales_and_zeros.contiguous(), out, np_, kp, kp // (16 * t), T=t, GROUP=group_size,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, enable_fp_fusion=False)
    return out
