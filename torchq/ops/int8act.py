"""4-bit weights x per-block int8 activations (the int8-activation 4-bit mode, llama.cpp's
Q4 x Q8_0): ``torchq::int4_groupwise_linear_a8`` (int4, :class:`~torchq.layouts.Int4NativeLayout`
bytes) and ``torchq::blockwise_4bit_linear_a8`` (NF4 / FP4, bitsandbytes bytes).

Meaning (the references here): the activation is fake-quantized per 32-element block by
:class:`~torchq.activation.PerBlockInt8` in fp32 (``a · q``, not rounded to x's dtype), the
weight is dequantized exactly to fp32, ``F.linear`` in fp32 (bias added in fp32), one rounding to
x's dtype. The int4 weights must have fp32 scales and zeros (round kinds 0).

The native CPU kernel (``csrc/lut4_q8_avx2.cpp``; from 5 rows on AVX-512 VNNI CPUs
``csrc/lut4_q8_avx512.cpp``, above 8 bit-equal to the AVX2 GEMM form) forms the integer block sums exactly and
differs from the reference only by fp32 summation order (int4); for NF4 / FP4 it multiplies by
the codebook rounded to int8 (``rint(127 · c / max|c|)``): each weight is off by at most
``absmax · max|c| / 254``, and the result stays within that bound of the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..activation import PerBlockInt8
from .blockwise import blockwise_4bit_weight, check_blockwise_4bit_linear_args
from .devices import check_op_devices
from .int4 import check_int4_groupwise_linear_args, dequantize_int4_groupwise

__all__ = ["int4_groupwise_linear_a8", "blockwise_4bit_linear_a8", "int4_a8_reference", "blockwise_4bit_a8_reference",
           "check_int4_a8_args", "ACTIVATIONS"]

ACTIVATIONS = PerBlockInt8()


def _linear_a8(x: torch.Tensor, w32: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    xq = ACTIVATIONS.fake_quantize(x.to(torch.float32))
    return F.linear(xq, w32, None if bias is None else bias.to(torch.float32)).to(x.dtype)


def check_int4_a8_args(x, packed, scale, shift, zero, shape, group_size, code_base, bias) -> None:
    check_int4_groupwise_linear_args(x, packed, scale, shift, zero, shape, group_size, code_base, 0, 0, bias)


def int4_a8_reference(x, packed, scale, shift, zero, n, k, group_size, code_base, bias) -> torch.Tensor:
    """:func:`int4_groupwise_linear_a8`'s meaning on checked arguments."""
    return _linear_a8(x, dequantize_int4_groupwise(packed, scale, shift, zero, k, group_size, code_base, 0, 0, torch.float32), bias)


@torch.library.custom_op("torchq::int4_groupwise_linear_a8", mutates_args=())
def int4_groupwise_linear_a8(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor | None,
    zero: torch.Tensor | None,
    shape: Sequence[int],
    group_size: int,
    code_base: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` in x's dtype for an ``Int4NativeLayout`` weight with fp32 scales, the
    activations quantized per 32-block to int8 (module doc)."""
    check_int4_a8_args(x, packed, scale, shift, zero, shape, group_size, code_base, bias)
    return int4_a8_reference(x, packed, scale, shift, zero, shape[0], shape[1], group_size, code_base, bias)


@int4_groupwise_linear_a8.register_fake
def _(x, packed, scale, shift, zero, shape, group_size, code_base, bias=None):
    check_op_devices("int4_groupwise_linear_a8", x, packed=packed, scale=scale, shift=shift, zero=zero, bias=bias)
    return x.new_empty((*x.shape[:-1], shape[0]))


def blockwise_4bit_a8_reference(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type,
                                bias=None) -> torch.Tensor:
    """:func:`blockwise_4bit_linear_a8`'s meaning on checked arguments (exact codebook)."""
    w = blockwise_4bit_weight(packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, torch.float32)
    return _linear_a8(x, w, bias)


@torch.library.custom_op("torchq::blockwise_4bit_linear_a8", mutates_args=())
def blockwise_4bit_linear_a8(
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
    """``x @ W.T + bias`` in x's dtype for an NF4 / FP4 weight, the activations quantized per
    32-block to int8 (module doc)."""
    check_blockwise_4bit_linear_args(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)
    return blockwise_4bit_a8_reference(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)


@blockwise_4bit_linear_a8.register_fake
def _(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias=None):
    check_op_devices("blockwise_4bit_linear_a8", x, packed=packed, absmax=absmax, nested_codes=nested_codes,
                     nested_absmax=nested_absmax, nested_offset=nested_offset, bias=bias)
    return x.new_empty((*x.shape[:-1], shape[0]))
