"""The native CPU implementations of the int8-weight linear ops (:mod:`torchq.ops.int8`): the
fused kernels of torchq's native library (``tq_int8_linear``, ``tq_int8_dynamic_linear``), dequantized
tiles + ``torch.mm`` for prefill-sized inputs (:mod:`torchq.prefill`), and the ops' references when
the library is missing or disabled (with a one-time :class:`~torchq.native.NativeMissingWarning`)."""

from __future__ import annotations

import torch

from ... import native
from ...ops.int8 import (
    check_int8_dynamic_linear_args,
    check_int8_weight_args,
    int8_dynamic_linear,
    int8_dynamic_reference,
    int8_weight_linear,
    int8_weight_reference,
)
from ...prefill import tile_dtype, tiled_linear, use_tiles

__all__ = [
    "NATIVE_MIN_CODE", "weight_args", "int8_weight_linear_cpu", "int8_dynamic_linear_cpu", "weight_linear_cpu", "dynamic_linear_cpu",
    "dynamic_native",
]


def weight_args(codes: torch.Tensor, scale: torch.Tensor, n: int, k: int, op: str) -> tuple[int, int, int]:
    """``(codes, N, scale)``: the weight's C arguments of ``tq_int8_linear`` /
    ``tq_int8_dynamic_linear`` for an ``[n, k]`` weight, each buffer checked to hold what the
    kernel reads (contiguous int8 codes ``[n, k]``, fp32 scales ``[n]``, on the CPU)."""
    return native.checked_ptr("codes", codes, torch.int8, n * k, op), n, native.checked_ptr("scale", scale, torch.float32, n, op)


@int8_weight_linear.register_kernel("cpu")
def int8_weight_linear_cpu(x, codes, scale, bias=None):
    check_int8_weight_args(x, codes, scale, bias)
    return weight_linear_cpu(x, codes, scale, bias)


def weight_linear_cpu(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU kernel of ``torchq::int8_weight_linear`` on checked arguments (dispatch entries
    call it directly in eager mode)."""
    lib = native.library()
    if lib is None or x.numel() == 0:
        if lib is None:
            native.warn_reference("int8_weight_linear")
        return int8_weight_reference(x, codes, scale, bias)
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


# The AVX2 kernel's sign trick needs activation codes in [-127, 127].
NATIVE_MIN_CODE = -127


@int8_dynamic_linear.register_kernel("cpu")
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
        return int8_dynamic_reference(x, codes, scale, quant_min, quant_max, eps, bias)
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
