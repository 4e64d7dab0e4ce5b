"""The native CPU implementations of the int8-weight linear ops (:mod:`torchq.ops.int8`): the
fused kernels of torchq's native library (``tq_linear`` on an int8
:class:`~torchq.backends.native_cpu.library.NativeWeight`), dequantized
tiles + ``torch.mm`` for prefill-sized weight-only inputs (:mod:`torchq.prefill`; the int8-activation
ops run the fused kernels at every size), and the ops' references when
the library is missing or disabled (with a one-time :class:`~torchq.native.NativeMissingWarning`)."""

from __future__ import annotations

import torch

from ... import native
from ...ops.int8 import (
    check_int8_dynamic_linear_args,
    check_int8_static_linear_args,
    check_int8_weight_args,
    int8_dynamic_linear,
    int8_dynamic_reference,
    int8_static_linear,
    int8_static_reference,
    int8_weight_linear,
    int8_weight_reference,
)
from ...prefill import tile_dtype, tiled_linear
from . import library as native_library
from .registration import register_cpu_kernel

__all__ = ["NATIVE_MIN_CODE", "int8_weight_linear_cpu", "int8_dynamic_linear_cpu", "int8_static_linear_cpu", "weight_linear_cpu",
           "dynamic_linear_cpu", "static_linear_cpu"]


def _int8_weight(op: str, codes: torch.Tensor, scale: torch.Tensor, n: int, k: int) -> native_library.NativeWeight:
    """The native weight of an int8 call, cached per codes tensor
    (:func:`~torchq.backends.native_cpu.library.op_weight`) when it needs no copies (contiguous
    codes, contiguous fp32 scales); otherwise built on copies."""

    def build() -> tuple[native_library.NativeWeight, bool]:
        used_codes, used_scale = codes.contiguous(), scale.reshape(-1).to(torch.float32).contiguous()
        in_place = used_codes.data_ptr() == codes.data_ptr() and used_scale.data_ptr() == scale.data_ptr()
        return native_library.int8_weight(op, used_codes, used_scale, n, k), in_place

    return native_library.op_weight(codes, (scale,), (op, n, k), build)


@register_cpu_kernel(int8_weight_linear)
def int8_weight_linear_cpu(x, codes, scale, bias=None):
    weight = native_library.cached_op_weight(codes, (scale,), ("int8_weight_linear", *codes.shape))
    if weight is not None and native_library.takes_fused(weight, x):  # a compiled graph's call: checked when built
        return native_library.run_linear(weight, x, bias)
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
    weight = _int8_weight("int8_weight_linear", codes, scale, n, k)
    if not native_library.takes_fused(weight, x):
        b = native_library.checked_bias(bias, n, "int8_weight_linear")
        out = tiled_linear(x.reshape(m, k), n, k, lambda n0, n1, w: native_library.dequantize_rows(weight, n0, n1, w), tile_dtype(x.dtype), b, x.dtype)
        return out.reshape(*x.shape[:-1], n)
    return native_library.run_linear(weight, x, bias)


# The AVX2 kernel's sign trick needs activation codes in [-127, 127].
NATIVE_MIN_CODE = -127


@register_cpu_kernel(int8_dynamic_linear)
def int8_dynamic_linear_cpu(x, codes, scale, quant_min, quant_max, eps, bias=None):
    weight = native_library.cached_op_weight(codes, (scale,), ("int8_dynamic_linear", *codes.shape))
    # a compiled graph's call, checked when built (also the activation range: derived after the checks)
    dynamic = None if weight is None else weight.derived((quant_min, quant_max, eps))
    if dynamic is not None and x.numel():
        return native_library.run_linear(dynamic, x, bias)
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
    weight = _int8_weight("int8_dynamic_linear", codes, scale, n, k).dynamic(quant_min, quant_max, eps)
    return native_library.run_linear(weight, x, bias)


@register_cpu_kernel(int8_static_linear)
def int8_static_linear_cpu(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias=None):
    weight = native_library.cached_op_weight(codes, (scale,), ("int8_static_linear", *codes.shape))
    # a compiled graph's call, checked when built (the activation scheme too: derived after the checks)
    key = native_library.NativeWeight.static_key(act_scale, act_zero_point, quant_min, quant_max)
    static = None if weight is None else weight.derived(key)
    if static is not None and x.numel():
        return native_library.run_linear(static, x, bias)
    check_int8_static_linear_args(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias)
    return static_linear_cpu(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias)


def static_linear_cpu(x, codes, scale, act_scale: float, act_zero_point: int, quant_min: int, quant_max: int,
                      bias=None) -> torch.Tensor:
    """The CPU kernel of ``torchq::int8_static_linear`` on checked arguments: the native kernel
    (bit-equal to :func:`~torchq.ops.int8.int8_static_reference`) at every number of rows, as the
    dynamic format (no dequantized tiles: the int8 dot products beat them), else the reference."""
    lib = native_library.library()
    if lib is None or x.numel() == 0 or quant_min < NATIVE_MIN_CODE:
        if lib is None:
            native.warn_reference("int8_static_linear")
        elif quant_min < NATIVE_MIN_CODE:
            native.warn_reference("int8_static_linear", f"activation codes [{quant_min}, {quant_max}] (the kernel takes [-127, 127])")
        return int8_static_reference(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias)
    n, k = codes.shape
    weight = _int8_weight("int8_static_linear", codes, scale, n, k).static(act_scale, act_zero_point, quant_min, quant_max)
    return native_library.run_linear(weight, x, bias)
