"""``Float8Layout``: float8_e4m3fn weights with fp32 scales per row or per tensor.

Bytes per ``[N, K]`` weight: ``codes`` ``float8_e4m3fn [N, K]`` (one byte each, row-major; the
plain form's ``e4m3fn`` codebook codes are these bytes, viewed as uint8) and ``scale`` fp32
``[N, 1]`` (per row) or ``[1, 1]`` (per tensor). The same bytes on every device. Its kernels:

* ``float8_scaled_mm`` (CUDA, compute capability 8.9+; K and N multiples of 16; bf16 inputs
  unless both scales are per tensor): dynamic float8 activations, ``torch._scaled_mm``;
* ``float8_weight_cuda`` (CUDA): float8 weight-only on Triton (:mod:`torchq.backends.triton.int8_weight`,
  shared with int8 weight-only): a weight-streaming GEMV up to 4 rows, tensor cores up to 64, the
  weight dequantized once (bit for bit the reference's) and cuBLAS above;
* ``float8_reference`` (any other device or case): the ops' pure-PyTorch references, exact but
  not fast, with a one-time :class:`~torchq.dispatch.FallbackWarning` naming the layer (an error
  in strict mode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..activation import Float8Activations
from ..backends import aten as aten_backend
from ..backends import triton as triton_backend
from ..canonical import FLOAT8_CODEBOOK, PlainForm, QuantSpec
from ..dispatch import LinearKernel, warn_fallback_once
from ..float8 import FLOAT8_DTYPE
from ..ops.float8 import float8_dynamic_linear, float8_weight_linear
from ..primitives import ZeroPointDomain, scale_shape
from ..tracing import traced
from .base import Buffer, Fit, Layout, LayoutExample, TensorImpl

__all__ = ["Float8Layout", "Float8Impl", "SCALED_MM_CAPABILITY"]

SCALED_MM_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada and Hopper


class Float8Impl(TensorImpl):
    tensor_fields = ("codes", "scale")

    def expected_tensors(self) -> dict[str, Buffer | None]:
        return {"codes": Buffer(self.shape, FLOAT8_DTYPE), "scale": Buffer(scale_shape(self.shape, self.spec.block_size), torch.float32)}

    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> Float8Impl:
        return cls(layout, plain.spec, plain.shape, codes=plain.codes.view(FLOAT8_DTYPE), scale=plain.scale)

    def to_plain(self) -> PlainForm:
        return PlainForm(self.codes.view(torch.uint8), self.scale, None, self.spec)

    def narrow_view(self, dim: int, start: int, length: int) -> Float8Impl:
        return self.from_plain(self.to_plain().narrow(dim, start, length), self.layout)


@dataclass(frozen=True)
class Float8Layout(Layout):
    """float8_e4m3fn codes and fp32 scales (see module doc for the bytes)."""

    name = "float8"
    impl_class = Float8Impl
    holds_codebooks = True

    @classmethod
    def linear_kernels(cls):
        return KERNELS

    def fit(self, spec, shape=None, scale_dtype=None, device=None):
        base = super().fit(spec, shape, scale_dtype, device)
        if not base.holds:
            return base
        if spec.codebook != FLOAT8_CODEBOOK:
            return Fit(f"holds float8_e4m3fn weights only, weight is {spec.describe()}")
        if shape is not None:
            if len(shape) != 2:
                return Fit(f"needs a 2-D weight, got shape {shape}")
            n, k = shape
            if tuple(spec.block_size) not in ((1, k), (n, k)):
                return Fit(f"needs one scale per row (block 1x{k}) or per tensor (block {n}x{k}), got {spec.block_size}")
        return base

    @classmethod
    def examples(cls) -> tuple[LayoutExample, ...]:
        none = ZeroPointDomain.NONE
        return (
            LayoutExample(cls(), QuantSpec((1, 96), 0, 255, none, FLOAT8_CODEBOOK), (48, 96)),  # per row
            LayoutExample(cls(), QuantSpec((33, 80), 0, 255, none, FLOAT8_CODEBOOK), (33, 80)),  # per tensor
        )


def _weight_granularity(impl: Float8Impl) -> str:
    return "row" if impl.spec.block_size[0] == 1 else "tensor"


def _check_scaled_mm(x: torch.Tensor, w, bias) -> str | None:
    act = w.act_quant
    if not isinstance(act, Float8Activations):
        return "weight-only (no dynamic float8 activations)" if act is None else f"activation scheme {act.describe()} unsupported"
    if x.device.type != "cuda":
        return f"CUDA kernel, input is on {x.device}"
    capability = torch.cuda.get_device_capability(x.device)
    if torch.version.hip is None and capability < SCALED_MM_CAPABILITY:
        return f"FP8 tensor cores need compute capability 8.9+, {x.device} has {'.'.join(map(str, capability))}"
    n, k = w.tensor_impl.shape
    if k % 16 or n % 16:
        return f"torch._scaled_mm needs K and N multiples of 16, weight is {n}x{k}"
    if (act.granularity, _weight_granularity(w.tensor_impl)) != ("tensor", "tensor") and x.dtype != torch.bfloat16:
        return f"row-wise torch._scaled_mm writes bf16 only, input is {x.dtype}"
    return None


def _scaled_mm(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl = w.tensor_impl
    if traced(x):
        return float8_dynamic_linear(x, impl.codes, impl.scale, w.act_quant.granularity, bias)
    return aten_backend.float8_dynamic_linear_scaled_mm(x, impl.codes, impl.scale, w.act_quant.granularity, bias)


def _check_weight_cuda(x: torch.Tensor, w, bias) -> str | None:
    if w.act_quant is not None:
        return f"weight has dynamic activation quantization ({w.act_quant.describe()})"
    return triton_backend.cuda_rejects(x)


def _weight_only(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl = w.tensor_impl
    op = triton_backend.float8_weight_linear_cuda if triton_backend.eager_cuda(x) else float8_weight_linear
    return op(x, impl.codes, impl.scale, bias)


def _check_reference(x: torch.Tensor, w, bias) -> str | None:
    act = w.act_quant
    if act is not None and not isinstance(act, Float8Activations):
        return f"activation scheme {act.describe()} unsupported"
    return None


def _reference(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl = w.tensor_impl
    if not traced(x):
        name = w.label or f"<unnamed {tuple(w.shape)} weight>"
        warn_fallback_once((name, "float8_reference"), f"layer {name!r}: float8 on {x.device} has no fast kernel (torch._scaled_mm "
                           f"needs CUDA compute capability 8.9+)", instead="running the exact reference (slow)",
                           forbids="the float8 reference path")
    if w.act_quant is None:
        return float8_weight_linear(x, impl.codes, impl.scale, bias)
    return float8_dynamic_linear(x, impl.codes, impl.scale, w.act_quant.granularity, bias)


KERNELS = (
    LinearKernel(
        "float8_scaled_mm",
        _check_scaled_mm,
        _scaled_mm,
        description="torchq::float8_dynamic_linear on CUDA 8.9+: float8 activations per row / tensor, torch._scaled_mm "
        "(FP8 tensor cores, fp32 accumulation)",
    ),
    LinearKernel(
        "float8_weight_cuda",
        _check_weight_cuda,
        _weight_only,
        description="torchq::float8_weight_linear on CUDA: Triton streaming GEMV (M <= 4), tensor cores (M <= 64), "
        "dequantize + cuBLAS above",
    ),
    LinearKernel(
        "float8_reference",
        _check_reference,
        _reference,
        description="the float8 ops' pure-PyTorch references: exact, not fast (warns once; an error in strict mode)",
    ),
)
