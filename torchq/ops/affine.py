"""``torchq::choose_qparams_affine``, ``torchq::quantize_affine``, ``torchq::dequantize_affine``:
the op forms of :mod:`torchq.primitives` (whose functions are their references and their only
implementation, on every device), each with a fake implementation for ``torch.compile``."""

from __future__ import annotations

import torch

from ..canonical import PlainForm
from ..primitives import choose_qparams_affine, dequantize_affine, quantize_affine, scale_shape
from ..tracing import traced
from .devices import one_device_fake

__all__: list[str] = []  # the ops are used as torch.ops.torchq.*


@torch.library.custom_op("torchq::choose_qparams_affine", mutates_args=())
def _choose_qparams_affine_op(
    x: torch.Tensor,
    mapping_type: str,
    block_size: list[int],
    target_dtype: torch.dtype,
    quant_min: int,
    quant_max: int,
    eps: float,
    scale_dtype: torch.dtype,
    zero_point_dtype: torch.dtype,
    zero_point_domain: str,
    preserve_zero: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Op form of :func:`choose_qparams_affine`; for the NONE domain the zero point is all zeros."""
    scale, zero = choose_qparams_affine(
        x, mapping_type, block_size, target_dtype, quant_min, quant_max, eps,
        scale_dtype, zero_point_dtype, zero_point_domain, preserve_zero,
    )
    if zero is None:
        zero = torch.zeros(scale.shape, dtype=zero_point_dtype, device=scale.device)
    return scale, zero


@_choose_qparams_affine_op.register_fake
@one_device_fake('choose_qparams_affine')
def _(x, mapping_type, block_size, target_dtype, quant_min, quant_max, eps, scale_dtype,
      zero_point_dtype, zero_point_domain, preserve_zero):
    grid = scale_shape(x.shape, block_size)
    return x.new_empty(grid, dtype=scale_dtype), x.new_empty(grid, dtype=zero_point_dtype)


@torch.library.custom_op("torchq::quantize_affine", mutates_args=())
def _quantize_affine_op(
    x: torch.Tensor,
    block_size: list[int],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    output_dtype: torch.dtype,
    quant_min: int,
    quant_max: int,
    zero_point_domain: str,
) -> torch.Tensor:
    """Op form of :func:`quantize_affine`."""
    return quantize_affine(x, block_size, scale, zero_point, output_dtype, quant_min, quant_max, zero_point_domain)


@_quantize_affine_op.register_fake
@one_device_fake('quantize_affine')
def _(x, block_size, scale, zero_point, output_dtype, quant_min, quant_max, zero_point_domain):
    return x.new_empty(x.shape, dtype=output_dtype)


@torch.library.custom_op("torchq::dequantize_affine", mutates_args=())
def _dequantize_affine_op(
    codes: torch.Tensor,
    block_size: list[int],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    quant_min: int,
    quant_max: int,
    zero_point_domain: str,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """Op form of :func:`dequantize_affine`."""
    return dequantize_affine(codes, block_size, scale, zero_point, quant_min, quant_max, zero_point_domain, output_dtype)


@_dequantize_affine_op.register_fake
@one_device_fake('dequantize_affine')
def _(codes, block_size, scale, zero_point, quant_min, quant_max, zero_point_domain, output_dtype):
    return codes.new_empty(codes.shape, dtype=output_dtype)


def dequantize_plain(plain: PlainForm, dtype: torch.dtype) -> torch.Tensor:
    """``plain.dequantize(dtype)``, bit for bit under ``torch.compile`` too: traced, an affine format's
    values come from the ``torchq::dequantize_affine`` op, which a compiled graph calls as it is.
    Inductor fuses the same arithmetic written inline and skips its intermediate roundings
    (``(q - mid) * s`` rounded to a bf16 scale's dtype before ``+ z``), so a compiled embedding lookup
    gave other last bits than the eager one. Eager calls and codebook formats (one product, one
    cast) stay inline."""
    spec = plain.spec
    if spec.codebook is not None or not traced(plain.codes):
        return plain.dequantize(dtype)
    return _dequantize_affine_op(plain.codes, list(spec.block_size), plain.scale, plain.zero_point, spec.quant_min,
                                 spec.quant_max, spec.zero_point_domain.value, dtype)
