"""float8 e4m3fn weight linear ops: schemas, fakes, argument checks and pure-PyTorch references.

The weight (:mod:`torchq.float8`): codes ``float8_e4m3fn [N, K]`` and fp32 scales ``[N, 1]`` (per
row) or ``[1, 1]`` (per tensor), ``W = codes · scale``.

* ``float8_dynamic_linear(x, codes, scale, granularity, bias)``: x is quantized per call to
  float8_e4m3fn, per row (token) or per tensor (``granularity``), by
  :func:`torchq.float8.quantize_float8_activations` (bit for bit on every device); the fp8 products
  (exact in fp32) are summed in fp32, ``y = (acc · s_x) · s_w`` in fp32, rounded once to x's dtype,
  then ``+ bias`` in x's dtype (as ``int8_dynamic_linear``). Contract of a device implementation
  (``torch._scaled_mm`` on CUDA): the same codes and scales; only the fp32 summation order and the
  order of the two scale products may differ, ``|y - y_ref| <= (K + 2)·2^-24·Σ|x_q·w_q|·s_x·s_w``
  before the rounding to x's dtype.
* ``float8_weight_linear(x, codes, scale, bias)``: the activations as given. Reference:
  ``F.linear(x, (codes · scale in fp32).to(x.dtype), bias)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..float8 import FLOAT8_DTYPE, check_granularity, dequantize_float8, quantize_float8_activations
from .devices import check_op_devices

__all__ = ["float8_dynamic_linear", "float8_weight_linear", "check_float8_weight_args", "float8_dynamic_reference",
           "float8_weight_reference"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_float8_weight_args(op: str, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The argument checks of both ops (metadata only)."""
    check_op_devices(op, x, codes=codes, scale=scale, bias=bias)
    if x.dtype not in _FLOATS:
        raise TypeError(f"x: expected fp32, bf16 or fp16, got {x.dtype}")
    if codes.dtype != FLOAT8_DTYPE or codes.dim() != 2:
        raise ValueError(f"codes: expected float8_e4m3fn [N, K], got {codes.dtype} {list(codes.shape)}")
    n, k = codes.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dimension K={k}, got shape {list(x.shape)}")
    if scale.dtype != torch.float32 or tuple(scale.shape) not in ((n, 1), (1, 1)):
        raise ValueError(f"scale: expected fp32 [{n}, 1] (per row) or [1, 1] (per tensor), got {scale.dtype} {list(scale.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias: expected [{n}], got shape {list(bias.shape)}")


def float8_dynamic_reference(x, codes, scale, granularity, bias) -> torch.Tensor:
    """``float8_dynamic_linear``'s meaning on checked arguments."""
    n, k = codes.shape
    xq, xs = quantize_float8_activations(x.reshape(-1, k), granularity)
    acc = F.linear(xq.to(torch.float32), codes.to(torch.float32))  # exact products, fp32 sums
    y = ((acc * xs) * scale.reshape(1, -1)).to(x.dtype)
    y = y if bias is None else y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


@torch.library.custom_op("torchq::float8_dynamic_linear", mutates_args=())
def float8_dynamic_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, granularity: str,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: x quantized to float8_e4m3fn per row or tensor, fp32 sums of the exact products,
    both scales in fp32, one rounding to x's dtype, then the bias."""
    check_float8_weight_args("float8_dynamic_linear", x, codes, scale, bias)
    check_granularity(granularity)
    return float8_dynamic_reference(x, codes, scale, granularity, bias)


@float8_dynamic_linear.register_fake
def _(x, codes, scale, granularity, bias=None):
    check_op_devices("float8_dynamic_linear", x, codes=codes, scale=scale, bias=bias)
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def float8_weight_reference(x, codes, scale, bias) -> torch.Tensor:
    """``F.linear(x, (codes · scale).to(x.dtype), bias)`` on checked arguments."""
    return F.linear(x, dequantize_float8(codes, scale, x.dtype), None if bias is None else bias.to(x.dtype))


@torch.library.custom_op("torchq::float8_weight_linear", mutates_args=())
def float8_weight_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: ``F.linear(x, (codes · scale).to(x.dtype), bias)``."""
    check_float8_weight_args("float8_weight_linear", x, codes, scale, bias)
    return float8_weight_reference(x, codes, scale, bias)


@float8_weight_linear.register_fake
def _(x, codes, scale, bias=None):
    check_op_devices("float8_weight_linear", x, codes=codes, scale=scale, bias=bias)
    return x.new_empty((*x.shape[:-1], codes.shape[0]))
