"""Triton dequantize-GEMM / split-K GEMV for 4-bit weights (CUDA implementations of
``torchq::int4_groupwise_linear`` and ``torchq::blockwise_4bit_linear``).

Both formats store a ``[N, K]`` weight as bytes ``[N, Kp/2]`` with element ``2j`` of a row in the
high nibble of byte ``j``, and one scale per row group:

* ``AFFINE`` (:class:`~torchq.layouts.Int4NativeLayout`, tinygemm / integer / symmetric
  zero points): ``v = R_mul((u + code_base + shift) · scale)``, then ``R_add(v + zero)``, fp32
  tensors ``[N, G]``, ``R`` the rounding to the scale dtype;
* ``CODEBOOK`` (NF4 / FP4, bitsandbytes bytes): ``v = codebook[u] · absmax`` with fp32 absmax per
  block, or double-quantized ``absmax = dyn[c] · absmax2[b // 256] + offset``.

Kernels by the number of rows ``M`` (measured on an H200, ``benchmarks/tune_gpu_kernels.py``):

* ``M <= STREAM_MAX_M`` (4), bytes readable as int32 words (every layout's own tensors):
  :mod:`.stream_gemv`'s streaming GEMV, which factors the scales out of each group (its numeric
  contract is stated there: within the reference's per-weight roundings, not bit for bit);
* ``FACTORED_ROWS`` (5-64), affine formats, bf16 / fp16 x: :mod:`.factored_dot`, tensor cores on
  the raw codes with the group's scale, offset and zero applied per step (its contract is stated
  there: within the reference's per-weight roundings);
* ``M <= DOT_MAX_M`` (16), other affine calls (fp32 x): :func:`.stream_gemv.dot_words`, tensor
  cores on the reference's own weights (bit for bit; sums in fp32);
* otherwise (and for codebook formats above 4 rows, whose per-code lookups measured 4x slower
  in the tensor-core kernel) the weight is written once in x's dtype (``_dequant_kernel``, bit
  for bit the reference's) and multiplied by PyTorch's float GEMM (cuBLAS);
* bytes that are not whole aligned words (a view starting mid-word): the one-row split-K GEMV
  (``_gemv_kernel``) and the byte-tile tensor-core kernel (``_dot_kernel``), both on the reference's
  weights.

Kernels are launched with ``enable_fp_fusion=False`` so that no multiply-add of the dequantization
is contracted into an FMA: the weights are bit for bit the reference's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ...blockwise.codebooks import codebook, dynamic_map
from ...blockwise.nested import NESTED_BLOCKSIZE
from ...ops.blockwise import check_blockwise_4bit_linear_args
from ...ops.int4 import check_int4_groupwise_linear_args
from .device import as_rows, cdiv, next_pow2
from .device import sm_count as _sm_count
from .factored_dot import factored_dot, factored_dot_fits
from .rounding import ROUND_KINDS, round_to
from .stream_gemv import STREAM_MAX_M, dot_words, store_result, stream_gemv, stream_gemv_fits, sum_slices_kernel, words_fit

__all__ = ["int4_groupwise_linear", "blockwise_4bit_linear", "dequant_linear", "GEMV_MAX_M"]

AFFINE, CODEBOOK = 0, 1
# The GEMV reads the weight once per row: at M=4 it took 1312 us against 515 us for dequantize + cuBLAS
# at M=16 (8192x28672 bf16, H100), so only single rows take it.
GEMV_MAX_M = 1
# Up to DOT_MAX_M rows the tensor-core kernel reads the weight once for all rows; above it the
# weight is dequantized once and multiplied by cuBLAS. Launch parameters of the tensor-core kernel:
DOT_MAX_M = 16  # H200, int4 g128: the tensor-core kernel 0.28-0.30x bf16 at M=16, dequantize + cuBLAS faster at 64
DOT_TUNING = dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=3, programs_per_sm=4)
# Rows (first, last) that the factored tensor-core kernel (:mod:`.factored_dot`) takes: affine formats,
# bf16 / fp16 x. H200, int4 g128: 0.38-0.47x bf16 at M=16 and 0.35-0.44x at M=64 against 0.26-0.31x
# for dot_words / dequantize + cuBLAS; slower than the streaming GEMV up to 4 rows and than dequantize
# + cuBLAS from 128; codebook formats 2-6x slower than dequantize + cuBLAS (per-code lookups).
FACTORED_ROWS = (STREAM_MAX_M + 1, 64)


@triton.jit
def _weight_tile(n_idx, k0, N, K, packed_ptr, stride_pn, stride_gn, w0, w1, w2, w3, w4, w5, code_base,
                 FMT: tl.constexpr, OPT_A: tl.constexpr, OPT_B: tl.constexpr, ROUND_MUL: tl.constexpr,
                 ROUND_ADD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 weights ``W[n_idx, k0 : k0 + BLOCK_K]`` (``[BLOCK_N, BLOCK_K]``), 0 outside ``[N, K]``;
    ``k0`` a multiple of ``BLOCK_K`` (so a tile holds whole groups, or lies in one group).

    The tile's ``BLOCK_K / 2`` bytes per row load as one contiguous run and split into nibbles
    (element ``2j`` = the high nibble of byte ``j``); the scales load once per row and group
    (``[BLOCK_N, groups in the tile]``) and broadcast over the group's elements.

    AFFINE: ``w0`` scale, ``w1`` shift (OPT_A), ``w2`` zero (OPT_B). CODEBOOK: ``w0`` the 16
    values, ``w1`` absmax, or (OPT_A, double-quantized) ``w2`` codes, ``w3`` absmax2, ``w4``
    the 256-value map, ``w5`` the offset."""
    GPT: tl.constexpr = BLOCK_K // GROUP if GROUP < BLOCK_K else 1  # groups per tile
    GW: tl.constexpr = BLOCK_K // GPT  # elements of a tile row per group
    n_ok = n_idx < N
    j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = tl.load(packed_ptr + n_idx[:, None] * stride_pn + j[None, :], mask=n_ok[:, None] & (j[None, :] < stride_pn),
                   other=0).to(tl.int32)
    nib = tl.reshape(tl.join(byte >> 4, byte & 0xF), (BLOCK_N, GPT, GW))
    gi = k0 // GROUP + tl.arange(0, GPT)
    gmask = n_ok[:, None] & (gi[None, :] < stride_gn)
    g = n_idx[:, None] * stride_gn + gi[None, :]
    if FMT == 0:
        v = nib.to(tl.float32) + code_base
        if OPT_A:
            v = v + tl.load(w1 + g, mask=gmask, other=0.0)[:, :, None]
        v = round_to(v * tl.load(w0 + g, mask=gmask, other=0.0)[:, :, None], ROUND_MUL)
        if OPT_B:
            v = round_to(v + tl.load(w2 + g, mask=gmask, other=0.0)[:, :, None], ROUND_ADD)
    else:
        if OPT_A:
            c = tl.load(w2 + g, mask=gmask, other=0).to(tl.int32)
            absmax = tl.load(w4 + c) * tl.load(w3 + g // 256, mask=gmask, other=0.0) + tl.load(w5)
        else:
            absmax = tl.load(w1 + g, mask=gmask, other=0.0)
        v = tl.load(w0 + nib) * absmax[:, :, None]
    v = tl.reshape(v, (BLOCK_N, BLOCK_K))
    k_idx = k0 + tl.arange(0, BLOCK_K)
    return tl.where(n_ok[:, None] & (k_idx[None, :] < K), v, 0.0)


@triton.jit
def _gemv_kernel(x_ptr, out_ptr, bias_ptr, M, N, K, stride_xm, k_per_split,
                 packed_ptr, stride_pn, stride_gn, w0, w1, w2, w3, w4, w5, code_base,
                 FMT: tl.constexpr, OPT_A: tl.constexpr, OPT_B: tl.constexpr, ROUND_MUL: tl.constexpr,
                 ROUND_ADD: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                 X_KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n block, K slice, row m): ``sum_k x[m, k] · W[n, k]`` over its slice, in fp32.
    Products accumulate per tile position and are reduced across K once at the end (no
    cross-thread reduction per K step)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + m * stride_xm + k_idx, mask=k_idx < K, other=0.0)
        w = _weight_tile(n_idx, k0, N, K, packed_ptr, stride_pn, stride_gn, w0, w1, w2, w3, w4, w5, code_base,
                         FMT, OPT_A, OPT_B, ROUND_MUL, ROUND_ADD, GROUP, BLOCK_N, BLOCK_K)
        w = round_to(w, X_KIND)  # the reference's one cast of each weight to x's dtype
        acc += w * xv.to(tl.float32)[None, :]
    total = tl.sum(acc, axis=1)
    n_mask = n_idx < N
    if SPLIT_K == 1:
        if HAS_BIAS:
            total += tl.load(bias_ptr + n_idx, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * N + n_idx, round_to(total, X_KIND).to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(out_ptr + (pid_k * M + m) * N + n_idx, total, mask=n_mask)


@triton.jit
def _dot_kernel(x_ptr, part_ptr, out_ptr, bias_ptr, M, N, K, stride_xm, k_per_split,
                packed_ptr, stride_pn, stride_gn, w0, w1, w2, w3, w4, w5, code_base,
                FMT: tl.constexpr, OPT_A: tl.constexpr, OPT_B: tl.constexpr, ROUND_MUL: tl.constexpr,
                ROUND_ADD: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr,
                X_KIND: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Program (m block, n block, K slice): ``x[m block, slice] @ W[n block, slice].T`` on tensor
    cores, each weight tile formed bit for bit as the reference forms it and cast to x's dtype
    (fp32 x: an fp32 dot, no TF32), products summed in fp32; the K slices' partial sums to
    ``part [SPLIT, M, N]``, or with ``DIRECT`` (one slice) the rounded result to ``out``.
    ``DOT_F32``: both operands widened to fp32 first (the same exact products): triton's CPU
    interpreter multiplies bf16 operands wrongly (triton 3.9)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m_idx = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        k_idx = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + m_idx[:, None] * stride_xm + k_idx[None, :], mask=(m_idx[:, None] < M) & (k_idx[None, :] < K),
                     other=0.0)
        w = _weight_tile(n_idx, k0, N, K, packed_ptr, stride_pn, stride_gn, w0, w1, w2, w3, w4, w5, code_base,
                         FMT, OPT_A, OPT_B, ROUND_MUL, ROUND_ADD, GROUP, BLOCK_N, BLOCK_K)
        wt = tl.trans(round_to(w, X_KIND).to(xt.dtype))
        if X_KIND == 0 or DOT_F32:
            acc += tl.dot(xt.to(tl.float32), wt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(xt, wt)
    store_result(acc, m_idx, n_idx, (m_idx[:, None] < M) & (n_idx[None, :] < N), out_ptr, part_ptr, bias_ptr, pid_k, M, N, HAS_BIAS, DIRECT, X_KIND)


@triton.jit
def _dequant_kernel(out_ptr, N, K, packed_ptr, stride_pn, stride_gn, w0, w1, w2, w3, w4, w5, code_base,
                    FMT: tl.constexpr, OPT_A: tl.constexpr, OPT_B: tl.constexpr, ROUND_MUL: tl.constexpr,
                    ROUND_ADD: tl.constexpr, GROUP: tl.constexpr, X_KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (n block, k block): the weights ``W[n block, k block]`` in ``out``'s dtype (the
    reference's one rounding, done by ``round_to``: the interpreter's own cast truncates),
    ``out`` row-major ``[N, K]``."""
    n_idx = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    k_idx = k0 + tl.arange(0, BLOCK_K)
    w = _weight_tile(n_idx, k0, N, K, packed_ptr, stride_pn, stride_gn, w0, w1, w2, w3, w4, w5, code_base,
                     FMT, OPT_A, OPT_B, ROUND_MUL, ROUND_ADD, GROUP, BLOCK_N, BLOCK_K)
    mask = (n_idx[:, None] < N) & (k_idx[None, :] < K)
    tl.store(out_ptr + n_idx[:, None] * K + k_idx[None, :], round_to(w, X_KIND).to(out_ptr.dtype.element_ty), mask=mask)


def _split_k(programs: int, k: int, block_k: int, device: torch.device) -> int:
    """K slices so that about 8 programs per SM run, each over at least 4 K blocks."""
    want = max(1, (8 * _sm_count(device)) // max(programs, 1))
    return max(1, min(want, k // (4 * block_k), 16))


def dequant_linear(x: torch.Tensor, n: int, k: int, packed: torch.Tensor, stride_pn: int, stride_gn: int, group: int,
                   tensors: tuple, code_base: float, fmt: int, opt_a: bool, opt_b: bool, round_mul: int, round_add: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` in x's dtype for a weight in format ``fmt`` (see module doc);
    ``tensors`` are ``w0..w5`` (None for unused; any tensor stands in for them)."""
    x2 = as_rows(x, k)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    ws = tuple(packed if t is None else t for t in tensors)  # any tensor stands in for an unused pointer
    weight = (packed, stride_pn, stride_gn, *ws, float(code_base))
    flags = dict(FMT=fmt, OPT_A=bool(opt_a), OPT_B=bool(opt_b), ROUND_MUL=round_mul, ROUND_ADD=round_add, GROUP=group)
    bias = None if bias is None else bias.reshape(-1).to(x.dtype).contiguous()  # the reference adds bias in x's dtype
    rows = packed.reshape(n, stride_pn)
    if fmt == AFFINE and FACTORED_ROWS[0] <= m <= FACTORED_ROWS[1] and factored_dot_fits(x.dtype, rows, group, k):
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        factored_dot(x2, out, n, k, rows, stride_gn, group, ws, code_base, fmt, opt_a, opt_b, bias, _sm_count(x.device))
        return out.reshape(*x.shape[:-1], n)
    if m > DOT_MAX_M or (fmt == CODEBOOK and m > STREAM_MAX_M):  # the weight in x's dtype once, then the float GEMM (the reference's own two steps)
        w = torch.empty(n, k, dtype=x.dtype, device=x.device)
        block_n, block_k = 32, 128
        grid = (cdiv(n, block_n), cdiv(k, block_k))
        _launch(_dequant_kernel, grid, (w, n, k, *weight), dict(flags, X_KIND=ROUND_KINDS[x.dtype], BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4),
                (fmt, opt_a, opt_b, x.dtype, x.device))
        return F.linear(x2, w, bias).reshape(*x.shape[:-1], n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if stream_gemv_fits(rows, m, group):
        stream_gemv(x2, out, n, k, rows, stride_gn, group, ws, code_base, fmt, opt_a, opt_b, bias, _sm_count(x.device))
        return out.reshape(*x.shape[:-1], n)
    if words_fit(rows, group):  # tensor cores on the int32 words
        dot_words(x2, out, n, k, rows, stride_gn, group, ws, code_base, fmt, opt_a, opt_b, round_mul, round_add, bias, _sm_count(x.device))
        return out.reshape(*x.shape[:-1], n)
    if m > GEMV_MAX_M:  # tensor cores on the bytes
        return _dot_linear(x2, out, n, k, weight, flags, bias).reshape(*x.shape[:-1], n)
    block_n, block_k = 32, 128
    split = _split_k(cdiv(n, block_n) * m, k, block_k, x.device)
    # slices are whole K blocks; the last one may run past K (masked)
    k_per_split = cdiv(cdiv(k, split), block_k) * block_k
    split = cdiv(k, k_per_split)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    b = packed if bias is None else bias
    args = (x2, target, b, m, n, k, x2.stride(0), k_per_split, *weight)
    meta = dict(flags, HAS_BIAS=bias is not None, X_KIND=ROUND_KINDS[x.dtype], SPLIT_K=split, BLOCK_N=block_n,
                BLOCK_K=block_k, num_warps=4)
    _launch(_gemv_kernel, (cdiv(n, block_n), split, m), args, meta, (fmt, opt_a, opt_b, x.dtype, x.device))
    if split > 1:  # one launch: each host-side torch op costs ~25 us of CPU on an H100 host, more than the sum
        sum_slices_kernel[(cdiv(m * n, 1024),)](target, out, b, m * n, n, split, HAS_BIAS=bias is not None,
                                                         X_KIND=ROUND_KINDS[x.dtype], BLOCK=1024)
    return out.reshape(*x.shape[:-1], n)


def _dot_linear(x2, out, n: int, k: int, weight: tuple, flags: dict, bias) -> torch.Tensor:
    """``out = x2 @ W.T (+ bias)`` by :func:`_dot_kernel`, split over K until the grid fills the device."""
    m = x2.shape[0]
    t = DOT_TUNING
    block_m = max(16, min(t["block_m"], next_pow2(m)))
    block_n, block_k = t["block_n"], t["block_k"]
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    steps = cdiv(k, block_k)
    split = max(1, min(steps, cdiv(t["programs_per_sm"] * _sm_count(x2.device), tiles)))
    k_per_split = cdiv(steps, split) * block_k
    split = cdiv(k, k_per_split)
    part = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x2.device)
    b = weight[0] if bias is None else bias
    x_kind = ROUND_KINDS[x2.dtype]
    args = (x2, part, out, b, m, n, k, x2.stride(0), k_per_split, *weight)
    meta = dict(flags, HAS_BIAS=bias is not None, DIRECT=split == 1, X_KIND=x_kind, DOT_F32=x2.device.type != "cuda", BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_K=block_k, num_warps=t["num_warps"], num_stages=t["num_stages"])
    _launch(_dot_kernel, (cdiv(m, block_m), cdiv(n, block_n), split), args, meta,
            (flags["FMT"], flags["OPT_A"], flags["OPT_B"], x2.dtype, x2.device))
    if split > 1:
        sum_slices_kernel[(cdiv(m * n, 1024),)](part, out, b, m * n, n, split, HAS_BIAS=bias is not None,
                                                         X_KIND=x_kind, BLOCK=1024)
    return out


_STAGES: dict[tuple, int] = {}  # (kernel, format, options, dtype, device, blocks) -> pipeline stages that fit


def _launch(kernel, grid: tuple, args: tuple, meta: dict, key: tuple) -> None:
    """Launch ``kernel``; if its software pipeline needs more shared memory than the device has
    (the codebook formats gather several per-element tiles per K step), retry with fewer stages
    and remember the count that fits for this configuration."""
    wanted = meta.pop("num_stages", 3)
    key = (kernel.fn.__name__, *key, tuple(sorted((k, v) for k, v in meta.items() if k.startswith("BLOCK"))))
    stages = _STAGES.get(key, wanted)
    while True:
        try:
            kernel[grid](*args, **meta, num_stages=stages, enable_fp_fusion=False)
        except OutOfResources:
            if stages <= 1:
                raise
            stages -= 1
            continue
        _STAGES[key] = stages
        return


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, device)
    if key not in _TABLES:
        _TABLES[key] = (dynamic_map() if name == "dynamic" else codebook(name)).to(device).contiguous()
    return _TABLES[key]


def int4_groupwise_linear(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias=None):
    """``torchq::int4_groupwise_linear`` on Triton."""
    check_int4_groupwise_linear_args(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias)
    n, k = shape
    packed, scale = packed.contiguous(), scale.contiguous()
    shift = None if shift is None else shift.contiguous()
    zero = None if zero is None else zero.contiguous()
    return dequant_linear(x, n, k, packed, packed.shape[1], scale.shape[1], group_size, (scale, shift, zero, None, None, None),
                          code_base, AFFINE, shift is not None, zero is not None, round_mul, round_add, bias)


def blockwise_4bit_linear(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias=None):
    """``torchq::blockwise_4bit_linear`` on Triton."""
    check_blockwise_4bit_linear_args(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)
    n, k = shape
    packed = packed.contiguous()
    nested = nested_codes is not None
    tensors = (
        _table(quant_type, x.device),
        None if nested else absmax.contiguous(),
        nested_codes.contiguous() if nested else None,
        nested_absmax.contiguous() if nested else None,
        _table("dynamic", x.device) if nested else None,
        nested_offset.reshape(1).contiguous() if nested else None,
    )
    return dequant_linear(x, n, k, packed, k // 2, k // blocksize, blocksize, tensors, 0.0, CODEBOOK, nested, False, 0, 0, bias)


assert NESTED_BLOCKSIZE == 256  # _weight_tile indexes absmax2 by block // 256
