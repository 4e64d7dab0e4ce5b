"""The native CPU implementations of the panel-order int8 linear ops (:mod:`torchq.ops.int8_panels`):
torchq's int8 kernels on the panels as stored (``csrc/int8_linear.h``, "Panel order"), dequantized
tiles + ``torch.mm`` for prefill-sized weight-only inputs (:mod:`torchq.prefill`), and the ops'
references where the library is missing (with a one-time
:class:`~torchq.native.NativeMissingWarning`) or the activation range is one it does not take."""

from __future__ import annotations

import torch

from ... import native
from ...ops.int8_panels import (
    check_panel_args,
    check_panel_dynamic_args,
    check_panel_static_args,
    int8_panel_dynamic_linear,
    int8_panel_static_linear,
    int8_panel_weight_linear,
    panel_dynamic_reference,
    panel_static_reference,
    panel_weight_reference,
)
from ...prefill import tile_dtype, tiled_linear
from . import library as native_library
from .int8 import NATIVE_MIN_CODE
from .registration import register_cpu_kernel

__all__ = ["panel_weight", "panel_weight_linear_cpu", "panel_dynamic_linear_cpu", "panel_static_linear_cpu"]


def panel_weight(op: str, panels: torch.Tensor, code_sums: torch.Tensor, scale: torch.Tensor, n: int,
                 k: int) -> native_library.NativeWeight:
    """The native weight of a panel-order call, cached per panels tensor
    (:func:`~torchq.backends.native_cpu.library.op_weight`); the arguments are checked tensors of
    the op (contiguous, the dtypes and sizes the struct claims: :func:`checked_ptr` refuses others)."""

    def build() -> tuple[native_library.NativeWeight, bool]:
        return native_library.int8_panel_weight(op, panels, code_sums, scale, n, k), True

    return native_library.op_weight(panels, (code_sums, scale), (op, n, k), build)


def _contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.contiguous() for t in tensors)


@register_cpu_kernel(int8_panel_weight_linear)
def int8_panel_weight_linear_cpu(x, panels, code_sums, scale, bias=None):
    n, k = check_panel_args("int8_panel_weight_linear", x, panels, code_sums, scale, bias)
    return panel_weight_linear_cpu(x, *_contiguous(panels, code_sums, scale), n, k, bias)


def panel_weight_linear_cpu(x: torch.Tensor, panels: torch.Tensor, code_sums: torch.Tensor, scale: torch.Tensor, n: int, k: int,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU kernel of ``torchq::int8_panel_weight_linear`` on checked, contiguous arguments."""
    if native_library.library() is None or x.numel() == 0:
        if native_library.library() is None:
            native.warn_reference("int8_panel_weight_linear")
        return panel_weight_reference(x, panels, code_sums, scale, bias)
    weight = panel_weight("int8_panel_weight_linear", panels, code_sums, scale, n, k)
    if not native_library.takes_fused(weight, x):
        m = x.numel() // k
        b = native_library.checked_bias(bias, n, "int8_panel_weight_linear")
        out = tiled_linear(x.reshape(m, k), n, k, lambda n0, n1, w: native_library.dequantize_rows(weight, n0, n1, w),
                           tile_dtype(x.dtype), b, x.dtype)
        return out.reshape(*x.shape[:-1], n)
    return native_library.run_linear(weight, x, bias)


def _native_takes(op: str, x: torch.Tensor, quant_min: int, quant_max: int) -> bool:
    """Whether the native kernel takes an int8-activation call; where it does not for a reason
    (no library; activation codes below -127: the AVX2 sign trick), warns once per op and reason."""
    if native_library.library() is None:
        native.warn_reference(op)
        return False
    if quant_min < NATIVE_MIN_CODE:
        native.warn_reference(op, f"activation codes [{quant_min}, {quant_max}] (the kernel takes [-127, 127])")
        return False
    return x.numel() != 0


@register_cpu_kernel(int8_panel_dynamic_linear)
def int8_panel_dynamic_linear_cpu(x, panels, code_sums, scale, quant_min, quant_max, eps, bias=None):
    check_panel_dynamic_args(x, panels, code_sums, scale, quant_min, quant_max, eps, bias)
    return panel_dynamic_linear_cpu(x, *_contiguous(panels, code_sums, scale), quant_min, quant_max, eps, bias)


def panel_dynamic_linear_cpu(x, panels, code_sums, scale, quant_min: int, quant_max: int, eps: float, bias=None) -> torch.Tensor:
    """The CPU kernel of ``torchq::int8_panel_dynamic_linear`` on checked, contiguous arguments."""
    if not _native_takes("int8_panel_dynamic_linear", x, quant_min, quant_max):
        return panel_dynamic_reference(x, panels, code_sums, scale, quant_min, quant_max, eps, bias)
    weight = panel_weight("int8_panel_dynamic_linear", panels, code_sums, scale, scale.numel(), x.shape[-1])
    return native_library.run_linear(weight.dynamic(quant_min, quant_max, eps), x, bias)


@register_cpu_kernel(int8_panel_static_linear)
def int8_panel_static_linear_cpu(x, panels, code_sums, scale, act_scale, act_zero_point, quant_min, quant_max, bias=None):
    check_panel_static_args(x, panels, code_sums, scale, act_scale, act_zero_point, quant_min, quant_max, bias)
    return panel_static_linear_cpu(x, *_contiguous(panels, code_sums, scale), act_scale, act_zero_point, quant_min, quant_max, bias)


def panel_static_linear_cpu(x, panels, code_sums, scale, act_scale: float, act_zero_point: int, quant_min: int, quant_max: int,
                            bias=None) -> torch.Tensor:
    """The CPU kernel of ``torchq::int8_panel_static_linear`` on checked, contiguous arguments."""
    if not _native_takes("int8_panel_static_linear", x, quant_min, quant_max):
        return panel_static_reference(x, panels, code_sums, scale, act_scale, act_zero_point, quant_min, quant_max, bias)
    weight = panel_weight("int8_panel_static_linear", panels, code_sums, scale, scale.numel(), x.shape[-1])
    return native_library.run_linear(weight.static(act_scale, act_zero_point, quant_min, quant_max), x, bias)
