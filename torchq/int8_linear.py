"""``torchq::int8_weight_linear`` and ``torchq::int8_dynamic_linear``: linears with int8 weights.

The weight is symmetric per output channel: int8 codes ``[N, K]`` (one byte each, row-major, as
``PlainLayout`` stores them) and one fp32 scale per row, ``W = q * s``.

* ``int8_weight_linear(x, codes, scale, bias) = x @ W.T + bias``. Reference: ``W`` in fp32, cast
  once to x's dtype, ``F.linear``. Native CPU kernel (fused; see :func:`torchq.prefill.use_tiles`): every
  weight the same fp32 ``q * s`` multiplied with x and summed in fp32 (one rounding to x's dtype at
  the end, so bf16 / fp16 results are at least as accurate as the reference's); prefill-sized
  inputs: dequantized tiles + ``torch.mm`` (:mod:`torchq.prefill`).
* ``int8_dynamic_linear(x, codes, scale, quant_min, quant_max, eps, bias)``: each row of x is
  quantized per token (:class:`torchq.activation.PerTokenInt8` with that range and eps), the
  int8 x int8 products accumulate exactly in int32, ``y = (acc * s_x) * s_w`` in fp32, cast to
  x's dtype, then ``+ bias`` in x's dtype. The native kernel (VNNI or AVX2) gives the same bits
  as the reference, whatever the number of rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native
from .activation import PerTokenInt8
from .dispatch import check_op_devices
from .prefill import tile_dtype, tiled_linear, use_tiles

__all__ = [
    "int8_weight_linear", "int8_dynamic_linear", "int8_weight_linear_cpu", "int8_dynamic_linear_cpu", "weight_linear_cpu",
    "dynamic_linear_cpu",
    "dynamic_native",
    "weight_args",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def weight_args(codes: torch.Tensor, scale: torch.Tensor, n: int, k: int, op: str) -> tuple[int, int, int]:
    """``(codes, N, scale)``: the weight's C arguments of ``tq_int8_linear`` /
    ``tq_int8_dynamic_linear`` for an ``[n, k]`` weight, each buffer checked to hold what the
    kernel reads (contiguous int8 codes ``[n, k]``, fp32 scales ``[n]``, on the CPU)."""
    return native.checked_ptr("codes", codes, torch.int8, n * k, op), n, native.checked_ptr("scale", scale, torch.float32, n, op)


def _check_weight(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dtype not in _FLOATS:
        raise TypeError(f"x: expected fp32, bf16 or fp16, got {x.dtype}")
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"codes: expected int8 [N, K], got {codes.dtype} {list(codes.shape)}")
    n, k = codes.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dimension K={k}, got shape {list(x.shape)}")
    if scale.numel() != n or not scale.is_floating_point():
        raise ValueError(f"scale: expected {n} floating-point entries (one per row), got {scale.dtype} {list(scale.shape)}")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias: expected {n} entries, got shape {list(bias.shape)}")


def _weight(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.to(torch.int32) * scale.reshape(-1, 1).to(torch.float32)).to(dtype)


@torch.library.custom_op("torchq::int8_weight_linear", mutates_args=())
def int8_weight_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: ``F.linear(x, (q * s).to(x.dtype), bias)``."""
    _check_weight(x, codes, scale, bias)
    return F.linear(x, _weight(codes, scale, x.dtype), None if bias is None else bias.to(x.dtype))


@int8_weight_linear.register_fake
def _(x, codes, scale, bias=None):
    check_op_devices("int8_weight_linear", x, codes=codes, scale=scale, bias=bias)
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


@torch.library.register_kernel("torchq::int8_weight_linear", "cpu")
def int8_weight_linear_cpu(x, codes, scale, bias=None):
    _check_weight(x, codes, scale, bias)
    return weight_linear_cpu(x, codes, scale, bias)


def weight_linear_cpu(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU kernel of ``torchq::int8_weight_linear`` on checked arguments (dispatch entries
    call it directly in eager mode)."""
    lib = native.library()
    if lib is None or x.numel() == 0:
        if lib is None:
            native.warn_reference("int8_weight_linear")
        return F.linear(x, _weight(codes, scale, x.dtype), None if bias is None else bias.to(x.dtype))
    n, k = codes.shape
    m = x.numel() // k
    codes = codes.contiguous()
    scale = scale.reshape(-1).to(torch.float32).contiguous()
    weight = weight_args(codes, scale, n, k, "int8_weight_linear")
    if use_tiles(m, x.dtype):
        b = native.checked_bias(bias, n, "int8_weight_linear")

        def dequant_rows(n0: int, n1: int, w: torch.Tensor) -> None:
            out, bf16 = native.checked_tile(w, n1 - n0, k, "int8 dequantize")
            status = lib.tq_int8_dequantize(weight[0], n, k, weight[2], n0, n1, out, bf16, native.threads())
            native.check(status, "int8 dequantize")

        out = tiled_linear(x.reshape(m, k), n, k, dequant_rows, tile_dtype(x.dtype), b)
        return out.to(x.dtype).reshape(*x.shape[:-1], n)
    return native.run_linear(lib.tq_int8_linear, "int8_weight_linear", x, k, n, weight, bias)


def check_int8_dynamic_linear_args(x, codes, scale, quant_min, quant_max, eps, bias) -> None:
    _check_weight(x, codes, scale, bias)
    if not (-128 <= quant_min < 0 < quant_max <= 127 and quant_min + quant_max in (0, -1)):
        raise ValueError(f"quant_min, quant_max: expected a symmetric int8 range ([-q, q] or [-q-1, q]), got [{quant_min}, {quant_max}]")
    if not eps > 0:
        raise ValueError(f"eps: expected > 0, got {eps}")


def _dynamic_reference(x, codes, scale, quant_min, quant_max, eps, bias) -> torch.Tensor:
    n, k = codes.shape
    xq, xs = PerTokenInt8(quant_min, quant_max, eps).quantize(x.reshape(-1, k))
    acc = torch.ops.torchq.int8_linear_matmul(xq, codes)
    y = ((acc.to(torch.float32) * xs) * scale.reshape(1, n).to(torch.float32)).to(x.dtype)
    y = y if bias is None else y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


@torch.library.custom_op("torchq::int8_dynamic_linear", mutates_args=())
def int8_dynamic_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, quant_min: int, quant_max: int, eps: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: per-token int8 quantization of x, ``torchq::int8_linear_matmul``, fp32 rescale."""
    check_int8_dynamic_linear_args(x, codes, scale, quant_min, quant_max, eps, bias)
    return _dynamic_reference(x, codes, scale, quant_min, quant_max, eps, bias)


@int8_dynamic_linear.register_fake
def _(x, codes, scale, quant_min, quant_max, eps, bias=None):
    check_op_devices("int8_dynamic_linear", x, codes=codes, scale=scale, bias=bias)
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


# The AVX2 kernel's sign trick needs activation codes in [-127, 127].
NATIVE_MIN_CODE = -127


@torch.library.register_kernel("torchq::int8_dynamic_linear", "cpu")
def int8_dynamic_linear_cpu(x, codes, scale, quant_min, quant_max, eps, bias=None):
    check_int8_dynamic_linear_args(x, codes, scale, quant_min, quant_max, eps, bias)
    return dynamic_linear_cpu(x, codes, scale, quant_min, quant_max, eps, bias)


def dynamic_linear_cpu(x, codes, scale, quant_min: int, quant_max: int, eps: float, bias=None) -> torch.Tensor:
    """The CPU kernel of ``torchq::int8_dynamic_linear`` on checked arguments."""
    lib = native.library()
    if lib is None or x.numel() == 0 or quant_min < NATIVE_MIN_CODE:
        if lib is None:
            native.warn_reference("int8_dynamic_linear")
        elif quant_min < NATIVE_MIN_CODE:
            native.warn_reference("int8_dynamic_linear", f"activation codes [{quant_min}, {quant_max}] (the kernel takes [-127, 127])")
        return _dynamic_reference(x, codes, scale, quant_min, quant_max, eps, bias)
    n, k = codes.shape
    codes = codes.contiguous()
    scale = scale.reshape(-1).to(torch.float32).contiguous()
    weight = (*weight_args(codes, scale, n, k, "int8_dynamic_linear"), (quant_max - quant_min) / 2, eps, quant_min, quant_max)
    return dynamic_native(lib, x, k, n, weight, bias)


def dynamic_native(lib, x: torch.Tensor, k: int, n: int, weight: tuple, bias: torch.Tensor | None) -> torch.Tensor:
    """``tq_int8_dynamic_linear`` with the weight's C arguments ``(codes, N, scale, denom, eps, qmin, qmax)``
    (the first three from :func:`weight_args`)."""
    native.check_bias(bias, n, "int8_dynamic_linear")
    y = native.run_linear(lib.tq_int8_dynamic_linear, "int8_dynamic_linear", x, k, n, weight, None, takes_bias=False)
    return y if bias is None else y + bias.to(x.dtype)  # the reference adds the bias after rounding to x's dtype
