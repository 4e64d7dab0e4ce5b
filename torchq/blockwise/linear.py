"""``torchq::blockwise_4bit_linear``: ``F.linear`` with an NF4 / FP4 weight, plus autograd.

``blockwise_4bit_linear(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape,
blocksize, quant_type, bias) = x @ W.T + bias`` in ``x``'s dtype, for the ``[N, K]`` weight
``W = codebook[nibbles of packed] * absmax`` (bitsandbytes' bytes; ``absmax`` fp32 per block, or
double-quantized in the three ``nested_*`` tensors; see :mod:`torchq.layouts.blockwise_4bit`).

* Reference (every device, the executable spec): dequantize to fp32, cast once to ``x``'s
  dtype, ``F.linear``.
* CPU with the native library (:mod:`torchq.native`), for decode-sized inputs: one
  fused pass that unpacks each weight to the same fp32 value as the reference, multiplies with
  ``x`` in fp32 and accumulates in fp32, rounding once to ``x``'s dtype (so bf16/fp16 results
  are at least as accurate as the reference's). More rows (prefill): the same kernel up to 64
  rows, or weight tiles dequantized natively (exactly the reference's values) and multiplied
  with ``torch.mm``: in bf16 for bf16 inputs on CPUs with native bf16 matmul (the reference's
  arithmetic), else in fp32. ``torchq::gemv_4bit`` and ``torchq::gemm_4bit`` use the same paths on
  the CPU.

Gradients flow to ``x`` (``grad @ W``) and ``bias``; the quantized weight is frozen (QLoRA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import native
from ..dispatch import check_op_devices
from ..prefill import tile_dtype, tiled_linear, use_tiles
from .codebooks import codebook, dynamic_map
from .nested import NESTED_BLOCKSIZE, double_dequantize
from .ops import (
    check_blocksize,
    check_gemm_4bit,
    check_gemv_4bit,
    dequantize_4bit,
    gemm_4bit_absmax,
    gemm_4bit_reference,
    gemv_4bit_reference,
)

__all__ = ["blockwise_4bit_linear"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _absmax(absmax, nested_codes, nested_absmax, nested_offset) -> torch.Tensor:
    if absmax is not None:
        return absmax
    return double_dequantize(nested_codes.reshape(-1), nested_absmax, nested_offset)


def _check(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias) -> None:
    check_blocksize(blocksize)
    if len(shape) != 2:
        raise ValueError(f"shape: expected [N, K], got {list(shape)}")
    n, k = shape
    if x.dtype not in _FLOATS:
        raise TypeError(f"x: expected fp32, bf16 or fp16, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dimension K={k}, got shape {list(x.shape)}")
    if k % blocksize:
        raise ValueError(f"shape: K={k} must be a multiple of blocksize {blocksize}")
    if packed.dtype != torch.uint8 or packed.numel() != n * k // 2:
        raise ValueError(f"packed: expected uint8 with {n * k // 2} bytes for shape {list(shape)}, got {packed.dtype} with {packed.numel()}")
    groups = n * k // blocksize
    if (absmax is None) == (nested_codes is None):
        raise ValueError("absmax, nested_codes: pass exactly one of the plain fp32 absmax and the double-quantized form")
    if absmax is not None and (absmax.dtype != torch.float32 or absmax.numel() != groups):
        raise ValueError(f"absmax: expected fp32 with {groups} entries, got {absmax.dtype} with {absmax.numel()}")
    if nested_codes is not None:
        if nested_absmax is None or nested_offset is None:
            raise ValueError("nested_absmax, nested_offset: required with nested_codes")
        if nested_codes.dtype != torch.uint8 or nested_codes.numel() != groups:
            raise ValueError(f"nested_codes: expected uint8 with {groups} entries, got {nested_codes.dtype} with {nested_codes.numel()}")
        want = -(-groups // NESTED_BLOCKSIZE)
        if nested_absmax.dtype != torch.float32 or nested_absmax.numel() != want:
            raise ValueError(f"nested_absmax: expected fp32 with {want} entries, got {nested_absmax.dtype} with {nested_absmax.numel()}")
        if nested_offset.dtype != torch.float32 or nested_offset.numel() != 1:
            raise ValueError(f"nested_offset: expected one fp32 value, got {nested_offset.dtype} with {nested_offset.numel()}")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias: expected {n} entries, got shape {list(bias.shape)}")


def _weight(packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, dtype) -> torch.Tensor:
    scale = _absmax(absmax, nested_codes, nested_absmax, nested_offset).reshape(-1)
    return dequantize_4bit(packed, scale, blocksize, quant_type, list(shape), dtype)


@torch.library.custom_op("torchq::blockwise_4bit_linear", mutates_args=())
def blockwise_4bit_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor | None,
    nested_codes: torch.Tensor | None,
    nested_absmax: torch.Tensor | None,
    nested_offset: torch.Tensor | None,
    shape: Sequence[int],
    blocksize: int,
    quant_type: str,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: dequantize to fp32, cast once to x's dtype, ``F.linear``."""
    _check(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)
    w = _weight(packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, x.dtype)
    return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))


@blockwise_4bit_linear.register_fake
def _(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias=None):
    check_op_devices("blockwise_4bit_linear", x, packed=packed, absmax=absmax, nested_codes=nested_codes,
                     nested_absmax=nested_absmax, nested_offset=nested_offset, bias=bias)
    return x.new_empty((*x.shape[:-1], shape[0]))


def native_weight(packed, table, absmax, nested_codes, nested_absmax, nested_offset, n: int, k: int, blocksize: int) -> native.NativeWeight:
    """An ``[n, k]`` weight for the native kernel from contiguous CPU tensors, each checked to hold
    what the kernel reads; ``table`` is the 16-entry codebook."""
    op = "blockwise_4bit_linear"
    check_blocksize(blocksize)
    if k % blocksize:
        raise ValueError(f"torchq {op}: K={k} must be a multiple of blocksize {blocksize}")
    nested = nested_codes is not None
    if nested == (absmax is not None) or (nested and (nested_absmax is None or nested_offset is None)):
        raise ValueError(f"torchq {op}: absmax, nested_*: pass exactly one of absmax and the three nested tensors")
    return native.lut4_weight(op, n, k, blocksize, packed, table, scales=absmax,
                              nested=(nested_codes, nested_absmax, nested_offset, _DYNAMIC) if nested else None)


def _native_linear(x, packed, table, absmax, nested_codes, nested_absmax, nested_offset, n, k, blocksize, bias) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias): fused kernel for small M (fp32 arithmetic, one rounding to
    x's dtype), dequantized tiles + torch.mm (see torchq.prefill.use_tiles)."""
    # contiguous copies (none for the layout's own tensors) stay referenced by the weight
    packed, table = packed.contiguous(), table.contiguous()
    absmax = None if absmax is None else absmax.contiguous()
    nested_codes = None if nested_codes is None else nested_codes.contiguous()
    nested_absmax = None if nested_absmax is None else nested_absmax.contiguous()
    weight = native_weight(packed, table, absmax, nested_codes, nested_absmax, nested_offset, n, k, blocksize)
    m = x.numel() // k
    if not use_tiles(m, x.dtype):
        return native.run_linear(weight, x, bias)
    b = native.checked_bias(bias, n, "blockwise_4bit_linear")
    out = tiled_linear(x.reshape(m, k), n, k, lambda n0, n1, w: native.dequantize_rows(weight, n0, n1, w), tile_dtype(x.dtype), b)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


TABLES = {name: codebook(name).contiguous() for name in ("nf4", "fp4")}
_DYNAMIC = dynamic_map().contiguous()


@torch.library.register_kernel("torchq::blockwise_4bit_linear", "cpu")
def blockwise_4bit_linear_cpu(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias=None):
    _check(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)
    return linear_cpu(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)


def linear_cpu(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias=None) -> torch.Tensor:
    """The CPU kernel on checked arguments (a layout's dispatch entry calls it directly in eager mode)."""
    lib = native.library()
    if lib is None or x.numel() == 0:
        if lib is None:
            native.warn_reference("blockwise_4bit_linear")
        w = _weight(packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, x.dtype)
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
    n, k = shape
    return _native_linear(x, packed, TABLES[quant_type], absmax, nested_codes, nested_absmax, nested_offset, n, k, blocksize, bias)


def _setup(ctx, inputs, output) -> None:
    x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias = inputs
    ctx.save_for_backward(packed, absmax, nested_codes, nested_absmax, nested_offset)
    ctx.meta = (list(shape), blocksize, quant_type, x.dtype, bias is not None, None if bias is None else bias.dtype)


def _backward(ctx, grad):
    packed, absmax, nested_codes, nested_absmax, nested_offset = ctx.saved_tensors
    shape, blocksize, quant_type, x_dtype, has_bias, bias_dtype = ctx.meta
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = _weight(packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, grad.dtype)
        grad_x = (grad @ w).to(x_dtype)
    if has_bias and ctx.needs_input_grad[9]:
        grad_bias = grad.reshape(-1, shape[0]).sum(0).to(bias_dtype)
    return grad_x, None, None, None, None, None, None, None, None, grad_bias


torch.library.register_autograd("torchq::blockwise_4bit_linear", _backward, setup_context=_setup)


def _native_4bit_matmul(op: str, A, B, shapeB, table, blocksize, bias, reference, absmax, nested=None) -> torch.Tensor:
    """``A @ W.T (+ bias)`` through the native kernel for a checked ``gemv_4bit`` / ``gemm_4bit``
    call on the CPU (16-value ``table``; ``absmax`` fp32 per block, or with ``nested = (codes,
    offset)`` the per-256 statistics of absmax double-quantized with the dynamic map), or
    ``reference()`` without the library, for blocks that cross rows (the kernel's blocks are row
    groups) and for inconsistent sizes (the reference raises the error)."""
    lib = native.library()
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


@torch.library.register_kernel("torchq::gemv_4bit", "cpu")
def _(A, B, shapeB, absmax, code, blocksize):
    def reference() -> torch.Tensor:
        return gemv_4bit_reference(A, B, shapeB, absmax, code, blocksize)

    check_gemv_4bit(A, B, shapeB, absmax, code, blocksize)
    return _native_4bit_matmul("gemv_4bit", A, B, shapeB, code, blocksize, None, reference, absmax)


@torch.library.register_kernel("torchq::gemm_4bit", "cpu")
def _(A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None, absmax_offset=None):
    def reference() -> torch.Tensor:
        return gemm_4bit_reference(A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset)

    check_gemm_4bit(A, B, shapeB, absmax, blocksize, quant_type, bias, absmax_8bit, absmax_code, absmax_offset)
    table = TABLES[quant_type]
    if absmax_8bit is not None and torch.equal(absmax_code, _DYNAMIC):  # the kernel's own nested path
        return _native_4bit_matmul("gemm_4bit", A, B, shapeB, table, blocksize, bias, reference, absmax, (absmax_8bit, absmax_offset))
    scale = gemm_4bit_absmax(absmax, absmax_8bit, absmax_code, absmax_offset)
    return _native_4bit_matmul("gemm_4bit", A, B, shapeB, table, blocksize, bias, reference, scale)
