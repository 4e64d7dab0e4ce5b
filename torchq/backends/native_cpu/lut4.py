"""The native CPU implementations of the 4-bit lookup-table linear ops: ``blockwise_4bit_linear``,
``gemv_4bit``, ``gemm_4bit`` (:mod:`torchq.ops.blockwise`) and ``int4_groupwise_linear``
(:mod:`torchq.ops.int4`), through the lut4 kernel of torchq's native library
(:func:`torchq.backends.native_cpu.library.lut4_weight`: a 16-entry fp32 table of code values, per-group scales and,
for int4, the shift / zero / rounding kinds that make each weight the reference's value).

For decode-sized inputs one fused pass unpacks each weight to the same fp32 value as the
reference, multiplies with ``x`` in fp32 and accumulates in fp32, rounding once to ``x``'s dtype
(so bf16/fp16 results are at least as accurate as the reference's). More rows (prefill): the same
kernel up to 64 rows, or weight tiles dequantized natively (exactly the reference's values) and
multiplied with ``torch.mm`` (:mod:`torchq.prefill`). Without the library each op runs its
reference, with a one-time :class:`~torchq.native.NativeMissingWarning`.
"""

from __future__ import annotations

import torch

from ... import native
from ...activation import PerBlockInt8
from ...blockwise.codebooks import codebook, dynamic_map
from ...blockwise.nested import NESTED_BLOCKSIZE
from ...ops.blockwise import (
    blockwise_4bit_linear,
    blockwise_4bit_reference,
    bnb_cpu_packed_to_standard,
    check_blocksize,
    check_blockwise_4bit_linear_args,
    check_gemm_4bit,
    check_gemv_4bit,
    fp32_statistic,
    gemm_4bit,
    gemm_4bit_absmax,
    gemm_4bit_reference,
    gemv_4bit,
    gemv_4bit_reference,
    is_bnb_cpu_packed,
)
from ...ops.int4 import (
    INT4_GROUPWISE_GROUP_SIZES,
    check_int4_groupwise_linear_args,
    int4_groupwise_linear,
    int4_groupwise_reference,
)
from ...ops.int8act import (
    blockwise_4bit_a8_reference,
    blockwise_4bit_linear_a8,
    check_int4_a8_args,
    int4_a8_reference,
    int4_groupwise_linear_a8,
)
from ...prefill import tile_dtype, tiled_linear
from . import library as native_library
from .registration import register_cpu_kernel

__all__ = ["TABLES", "blockwise_4bit_native_weight", "blockwise_4bit_linear_cpu", "blockwise_linear_cpu", "gemv_4bit_cpu", "gemm_4bit_cpu",
           "int4_groupwise_linear_cpu", "int4_native_weight", "int4_linear_cpu", "int4_a8_cpu", "blockwise_a8_cpu",
           "int4_groupwise_linear_a8_cpu", "blockwise_4bit_linear_a8_cpu", "INT8_ACTIVATION_MAX_M", "int8_activation_rejects"]


def blockwise_4bit_native_weight(packed, table, absmax, nested_codes, nested_absmax, nested_offset, n: int, k: int, blocksize: int) -> native_library.NativeWeight:
    """An ``[n, k]`` weight for the native kernel from contiguous CPU tensors, each checked to hold
    what the kernel reads; ``table`` is the 16-entry codebook."""
    op = "blockwise_4bit_linear"
    check_blocksize(blocksize)
    if k % blocksize:
        raise ValueError(f"torchq {op}: K={k} must be a multiple of blocksize {blocksize}")
    nested = nested_codes is not None
    if nested == (absmax is not None) or (nested and (nested_absmax is None or nested_offset is None)):
        raise ValueError(f"torchq {op}: absmax, nested_*: pass exactly one of absmax and the three nested tensors")
    return native_library.lut4_weight(op, n, k, blocksize, packed, table, scales=absmax,
                              nested=(nested_codes, nested_absmax, nested_offset, _DYNAMIC) if nested else None)


def _contiguous(ts):
    return tuple(None if t is None else t.contiguous() for t in ts)


def _in_place(given, used) -> bool:
    """Whether every tensor of ``used`` (the contiguous forms of ``given``) is ``given``'s own memory."""
    return all(a is None or a.data_ptr() == b.data_ptr() for a, b in zip(given, used))


def _blockwise_weight(packed, table, absmax, nested_codes, nested_absmax, nested_offset, n, k, blocksize) -> native_library.NativeWeight:
    """The native weight of a blockwise call, cached per packed tensor
    (:func:`~torchq.backends.native_cpu.library.op_weight`) when it needs no copies; otherwise
    built on contiguous copies (referenced by the weight for the call)."""
    given = (packed, table, absmax, nested_codes, nested_absmax, nested_offset)

    def build() -> tuple[native_library.NativeWeight, bool]:
        used = _contiguous(given)
        return blockwise_4bit_native_weight(*used, n, k, blocksize), _in_place(given, used)

    return native_library.op_weight(packed, given[1:], ("blockwise", n, k, blocksize), build)


def _native_linear(x, packed, table, absmax, nested_codes, nested_absmax, nested_offset, n, k, blocksize, bias) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias): the fused kernel where it takes these rows (small M, fp32
    arithmetic, one rounding to x's dtype; the bf16 AMX GEMM: :func:`library.takes_fused`), else
    dequantized tiles + torch.mm (see torchq.prefill.use_tiles)."""
    weight = _blockwise_weight(packed, table, absmax, nested_codes, nested_absmax, nested_offset, n, k, blocksize)
    m = x.numel() // k
    if native_library.takes_fused(weight, x):
        return native_library.run_linear(weight, x, bias)
    b = native_library.checked_bias(bias, n, "blockwise_4bit_linear")
    out = tiled_linear(x.reshape(m, k), n, k, lambda n0, n1, w: native_library.dequantize_rows(weight, n0, n1, w), tile_dtype(x.dtype), b, x.dtype)
    return out.reshape(*x.shape[:-1], n)


TABLES = {name: codebook(name).contiguous() for name in ("nf4", "fp4")}
_DYNAMIC = dynamic_map().contiguous()


@register_cpu_kernel(blockwise_4bit_linear)
def blockwise_4bit_linear_cpu(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias=None):
    weight = native_library.cached_op_weight(packed, (TABLES.get(quant_type), absmax, nested_codes, nested_absmax, nested_offset),
                                             ("blockwise", *shape, blocksize))
    if weight is not None and native_library.takes_fused(weight, x):  # a compiled graph's call: checked when built
        return native_library.run_linear(weight, x, bias)
    check_blockwise_4bit_linear_args(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)
    return blockwise_linear_cpu(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)


def blockwise_linear_cpu(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias=None) -> torch.Tensor:
    """The CPU kernel on checked arguments (a layout's dispatch entry calls it directly in eager mode)."""
    lib = native_library.library()
    if lib is None or x.numel() == 0:
        if lib is None:
            native.warn_reference("blockwise_4bit_linear")
        return blockwise_4bit_reference(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)
    n, k = shape
    return _native_linear(x, packed, TABLES[quant_type], absmax, nested_codes, nested_absmax, nested_offset, n, k, blocksize, bias)


def _native_4bit_matmul(op: str, A, B, shapeB, table, blocksize, bias, reference, absmax, nested=None) -> torch.Tensor:
    """``A @ W.T (+ bias)`` through the native kernel for a checked ``gemv_4bit`` / ``gemm_4bit``
    call on the CPU (16-value ``table``; ``absmax`` fp32 per block, or with ``nested = (codes,
    offset)`` the per-256 statistics of absmax double-quantized with the dynamic map; the callers
    widen bf16 / fp16 statistics to fp32 first, exactly, so the kernel computes the reference's
    fp32 weights; such a widened copy is made per call, and the native weight built on it is
    rebuilt per call as well), or
    ``reference()`` without the library, for blocks that cross rows (the kernel's blocks are row
    groups) and for inconsistent sizes (the reference raises the error)."""
    lib = native_library.library()
    if lib is None:
        native.warn_reference(op)
        return reference()
    n, k = shapeB
    if A.numel() == 0:
        return reference()
    if k % blocksize:
        native.warn_reference(op, f"blocks cross rows (K={k} is not a multiple of blocksize {blocksize})")
        return reference()
    packed = B.reshape(-1).view(torch.uint8) if B.dtype != torch.uint8 else B.reshape(-1)
    groups = n * k // blocksize
    if nested is None:
        consistent = absmax.dtype == torch.float32 and absmax.numel() == groups
        scales = (absmax.reshape(-1), None, None, None)
    else:
        codes, offset = nested
        consistent = (codes.dtype == torch.uint8 and codes.numel() == groups and absmax.dtype == torch.float32
                      and absmax.numel() == -(-groups // NESTED_BLOCKSIZE) and offset.numel() == 1)
        scales = (None, codes.reshape(-1), absmax.reshape(-1), offset.float().reshape(()))
    if packed.numel() != n * k // 2 or not consistent:
        return reference()
    return _native_linear(A, packed, table, *scales, n, k, blocksize, bias)


@register_cpu_kernel(gemv_4bit)
def gemv_4bit_cpu(A, B, shapeB, absmax, code, blocksize):
    def reference() -> torch.Tensor:
        return gemv_4bit_reference(A, B, shapeB, absmax, code, blocksize)

    check_gemv_4bit(A, B, shapeB, absmax, code, blocksize)
    if is_bnb_cpu_packed(B, shapeB, absmax, blocksize):
        B, absmax = bnb_cpu_packed_to_standard(B, shapeB, absmax)
    return _native_4bit_matmul("gemv_4bit", A, B, shapeB, code, blocksize, None, reference, fp32_statistic(absmax))


@register_cpu_kernel(gemm_4bit)
def gemm_4bit_cpu(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None, absmax_offset=None):
    def reference() -> torch.Tensor:
        return gemm_4bit_reference(A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset)

    check_gemm_4bit(A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset)
    table = TABLES[quant_type]
    if absmax_8bit is not None and torch.equal(absmax_code, _DYNAMIC):  # the kernel's own nested path
        return _native_4bit_matmul("gemm_4bit", A, B, shapeB, table, blocksize, bias, reference, fp32_statistic(absmax),
                                   (absmax_8bit, absmax_offset))
    scale = gemm_4bit_absmax(absmax, absmax_8bit, absmax_code, absmax_offset)
    return _native_4bit_matmul("gemm_4bit", A, B, shapeB, table, blocksize, bias, reference, scale)


# -- int4_groupwise_linear ----------------------------------------------------------------------------
_CODEBOOKS: dict[float, torch.Tensor] = {}


def _int4_codebook(code_base: float) -> torch.Tensor:
    if code_base not in _CODEBOOKS:
        _CODEBOOKS[code_base] = torch.arange(16, dtype=torch.float32) + code_base
    return _CODEBOOKS[code_base]


@register_cpu_kernel(int4_groupwise_linear)
def int4_groupwise_linear_cpu(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias=None):
    """Native: fused dequantize + dot in fp32 (weights exactly the reference's values, one
    rounding to x's dtype at the end; :func:`library.takes_fused`), or dequantized tiles + torch.mm (:func:`torchq.prefill.use_tiles`)."""
    weight = native_library.cached_op_weight(packed, (scale, shift, zero), ("int4", *shape, group_size, code_base, round_mul, round_add))
    if weight is not None and native_library.takes_fused(weight, x):  # a compiled graph's call: checked when built
        return native_library.run_linear(weight, x, bias)
    check_int4_groupwise_linear_args(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias)
    return int4_linear_cpu(x, packed, scale, shift, zero, shape[0], shape[1], group_size, code_base, round_mul, round_add, bias)


def int4_native_weight(packed, scale, shift, zero, n, k, group_size, code_base, round_mul, round_add) -> native_library.NativeWeight:
    """An ``[n, k]`` weight for the native kernel, every buffer checked to hold what the kernel
    reads (contiguous CPU tensors)."""
    op = "int4_groupwise_linear"
    if group_size not in INT4_GROUPWISE_GROUP_SIZES:
        raise ValueError(f"torchq {op}: group_size: expected one of {INT4_GROUPWISE_GROUP_SIZES}, got {group_size}")
    return native_library.lut4_weight(op, n, k, group_size, packed, _int4_codebook(code_base), scales=scale, shifts=shift, zeros=zero,
                              round_mul=round_mul, round_add=round_add)


def _int4_weight(packed, scale, shift, zero, n, k, group_size, code_base, round_mul, round_add) -> native_library.NativeWeight:
    """The native weight of an int4 call, cached per packed tensor
    (:func:`~torchq.backends.native_cpu.library.op_weight`) when it needs no copies; otherwise
    built on contiguous copies (referenced by the weight for the call)."""
    given = (packed, scale, shift, zero)

    def build() -> tuple[native_library.NativeWeight, bool]:
        used = _contiguous(given)
        return int4_native_weight(*used, n, k, group_size, code_base, round_mul, round_add), _in_place(given, used)

    return native_library.op_weight(packed, given[1:], ("int4", n, k, group_size, code_base, round_mul, round_add), build)


def int4_linear_cpu(x, packed, scale, shift, zero, n, k, group_size, code_base, round_mul, round_add, bias) -> torch.Tensor:
    """The CPU kernel of ``int4_groupwise_linear`` on checked arguments (the layout's dispatch
    entry calls it directly in eager mode)."""
    lib = native_library.library()
    if lib is None or x.numel() == 0:
        if lib is None:
            native.warn_reference("int4_groupwise_linear")
        return int4_groupwise_reference(x, packed, scale, shift, zero, n, k, group_size, code_base, round_mul, round_add, bias)
    weight = _int4_weight(packed, scale, shift, zero, n, k, group_size, code_base, round_mul, round_add)
    m = x.numel() // k
    if native_library.takes_fused(weight, x):
        return native_library.run_linear(weight, x, bias)
    kp = weight.row_length

    def dequant_rows(n0: int, n1: int, w: torch.Tensor) -> None:
        # padded rows: dequantize into a [rows, Kp] buffer, keep the first K columns
        full = w if kp == k else torch.empty(n1 - n0, kp, dtype=w.dtype)
        native_library.dequantize_rows(weight, n0, n1, full)
        if full is not w:
            w.copy_(full[:, :k])

    b = native_library.checked_bias(bias, n, "int4_groupwise_linear")
    out = tiled_linear(x.reshape(m, k), n, k, dequant_rows, tile_dtype(x.dtype), b, x.dtype)
    return out.reshape(*x.shape[:-1], n)


# -- int8 activations (torchq.ops.int8act) ---------------------------------------------------------------
@register_cpu_kernel(int4_groupwise_linear_a8)
def int4_groupwise_linear_a8_cpu(x, packed, scale, shift, zero, shape, group_size, code_base, bias=None):
    weight = native_library.cached_op_weight(packed, (scale, shift, zero), ("int4", *shape, group_size, code_base, 0, 0))
    if weight is not None and x.numel():  # a compiled graph's call: checked when built
        return native_library.run_linear(weight.int8_activations(), x, bias)
    check_int4_a8_args(x, packed, scale, shift, zero, shape, group_size, code_base, bias)
    return int4_a8_cpu(x, packed, scale, shift, zero, shape[0], shape[1], group_size, code_base, bias)


def int8_activation_rejects(x: torch.Tensor, act_quant, cuda_rejects=None) -> str | None:
    """Why the int8-activation kernels cannot take input ``x`` for a weight whose dynamic
    activation quantization is ``act_quant`` (None when they can): a layout's kernel condition.
    ``cuda_rejects``: the CUDA kernels' own condition (None: CPU only)."""
    if not isinstance(act_quant, PerBlockInt8):
        act = "no activation quantization" if act_quant is None else act_quant.describe()
        return f"int8-activation kernel (per-32-block int8 activations), weight has {act}"
    if x.device.type == "cuda" and cuda_rejects is not None:
        return cuda_rejects(x)
    if x.device.type != "cpu":
        return f"CPU or CUDA kernel, input is on {x.device}"
    return None


# Rows up to which the library's int8-activation path runs its integer row kernel (kLut4Q8MaxM,
# csrc/lut4_linear.h; its VNNI GEMM form takes calls from 5 rows); above, its integer GEMM form
# (AVX2 / AVX-512 VNNI), or on the portable table the fp32 paths on the fake-quantized activations.
INT8_ACTIVATION_MAX_M = 8


def int4_a8_cpu(x, packed, scale, shift, zero, n, k, group_size, code_base, bias) -> torch.Tensor:
    """The CPU kernel of ``int4_groupwise_linear_a8`` on checked arguments: the native library
    (integer dot products: a row kernel up to :data:`INT8_ACTIVATION_MAX_M` rows, 4 on AVX-512
    VNNI CPUs, a GEMM form above, or the portable table's fp32 paths on the fake-quantized activations: all the reference
    up to fp32 summation order), else the
    reference."""
    lib = native_library.library()
    if lib is None or x.numel() == 0:
        if lib is None:
            native.warn_reference("int4_groupwise_linear_a8")
        return int4_a8_reference(x, packed, scale, shift, zero, n, k, group_size, code_base, bias)
    weight = _int4_weight(packed, scale, shift, zero, n, k, group_size, code_base, 0, 0).int8_activations()
    return native_library.run_linear(weight, x, bias)


@register_cpu_kernel(blockwise_4bit_linear_a8)
def blockwise_4bit_linear_a8_cpu(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type,
                                 bias=None):
    weight = native_library.cached_op_weight(packed, (TABLES.get(quant_type), absmax, nested_codes, nested_absmax, nested_offset),
                                             ("blockwise", *shape, blocksize))
    if weight is not None and x.numel():  # a compiled graph's call: checked when built
        return native_library.run_linear(weight.int8_activations(), x, bias)
    check_blockwise_4bit_linear_args(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)
    return blockwise_a8_cpu(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)


def blockwise_a8_cpu(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type,
                     bias=None) -> torch.Tensor:
    """The CPU kernel of ``blockwise_4bit_linear_a8`` on checked arguments: as :func:`int4_a8_cpu`
    (the codebook rounded to int8; above :data:`INT8_ACTIVATION_MAX_M` rows on the portable table, or
    with the GEMM forms off, the exact codebook)."""
    lib = native_library.library()
    if lib is None or x.numel() == 0:
        if lib is None:
            native.warn_reference("blockwise_4bit_linear_a8")
        return blockwise_4bit_a8_reference(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize,
                                           quant_type, bias)
    n, k = shape
    weight = _blockwise_weight(packed, TABLES[quant_type], absmax, nested_codes, nested_absmax, nested_offset, n, k, blocksize)
    return native_library.run_linear(weight.int8_activations(), x, bias)
