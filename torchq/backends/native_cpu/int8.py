"""The native CPU implementations of the int8-weight linear ops (:mod:`torchq.ops.int8`): the
fused kernels of torchq's native library (``tq_linear`` on an int8
:class:`~torchq.backends.native_cpu.library.NativeWeight`), dequantized
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
from . import library as native_library

__all__ = ["NATIVE_MIN_CODE", "int8_weight_linear_cpu", "int8_dynamic_linear_cpu", "weight_linear_cpu", "dynamic_linear_cpu"]


@int8_weight_linear.register_kernel("cpu")
def int8_weight_linear_cpu(x, codes, scale, bias=None):
    check_int8_weight_args(x, codes, scale, bias)
    return weight_linear_cpu(x, codes, scale, bias)


def weight_linear_cpu(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU kernel of ``torchq::int8_weight_linear`` on checked arguments (dispatch entries
    call it directly in eager mode)."""
    lib = native_library.library()
    if lib is None or x.numel() == 0:
        if lib is None:
            native.warn_reference("int8_weight_linear")
        return int8_weight_reference(x, codes, scale, bias)
    n, k = codes.shape
    m = x.numel() // k
    codes = codes.contiguous()
    scale = scale.reshape(-1).to(torch.float32).contiguous()
    weight = native_library.int8_weight("int8_weight_linear", codes, scale, n, k)
    if use_tiles(m, x.dtype):
        b = native_library.checked_bias(bias, n, "int8_weight_linear")
        out = tiled_linear(x.reshape(m, k), n, k, lambda n0, n1, w: native_library.dequantize_rows(weight, n0, n1, w), tile_dtype(x.dtype), b)
        return out.to(x.dtype).reshape(*x.shape[:-1], n)
    return native_library.run_linear(weight, x, bias)


# The AVX2 kernel's sign trick needs activation codes in [-127, 127].
NATIVE_MIN_CODE = -127


@int8_dynamic_linear.register_kernel("cpu")
def int8_dynamic_linear_cpu(x, codes, scale, quant_min, quant_max, eps, bias=None):
    check_int8_dynamic_linear_args(x, codes, scale, quant_min, quant_max, eps, bias)
    return dynamic_linear_cpu(x, codes, scale, quant_min, quant_max, eps, bias)


def dynamic_linear_cpu(x, codes, scale, quant_min: int, quant_max: int, eps: float, bias=None) -> torch.Tensor:
    """The CPU kernel of ``torchq::int8_dynamic_linear`` on checked arguments."""
    lib = native_library.library()
    if lib is None or x.numel() == 0 or quant_min < NATIVE_MIN_CODE:
        if lib is None:
            native.warn_reference("int8_dynamic_linear")
        elif quant_min < NATIVE_MIN_CODE:
            native.warn_reference("int8_dynamic_linear", f"activation codes [{quant_min}, {quant_max}] (the kernel takes [-127, 127])")
        return int8_dynamic_reference(x, codes, scale, quant_min, quant_max, eps, bias)
    n, k = codes.shape
    codes = codes.contiguous()
    scale = scale.reshape(-1).to(torch.float32).contiguous()
    weight = native_library.int8_weight("int8_dynamic_linear", codes, scale, n, k).dynamic(quant_min, quant_max, eps)
    return native_library.run_linear(weight, x, bias)
