"""Triton: the int8-activation 4-bit ops on CUDA, ``torchq::int4_groupwise_linear_a8`` and
``torchq::blockwise_4bit_linear_a8``.

The activations are fake-quantized per 32-element block in fp32 (:class:`~torchq.activation.PerBlockInt8`,
the ops' own first step), then the 4-bit Triton kernels of :mod:`.dequant_linear` multiply them in
fp32 (fp32 weights: the int4 scales are fp32 for this mode, the codebook formats dequantize in
fp32), one rounding to x's dtype: the reference's meaning, each path within its own numeric
contract (the streaming GEMV factors the scales out; the other paths use the exact weights).
The products are fp32, not int8 tensor-core dot products: an integer kernel is still to be written.
"""

from __future__ import annotations

import torch

from ...ops.blockwise import check_blockwise_4bit_linear_args
from ...ops.int8act import ACTIVATIONS, check_int4_a8_args
from . import dequant_linear

__all__ = ["int4_groupwise_linear_a8", "blockwise_4bit_linear_a8"]


def _fp32(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.to(torch.float32)


def int4_groupwise_linear_a8(x, packed, scale, shift, zero, shape, group_size, code_base, bias=None):
    """``torchq::int4_groupwise_linear_a8`` on Triton."""
    check_int4_a8_args(x, packed, scale, shift, zero, shape, group_size, code_base, bias)
    xq = ACTIVATIONS.fake_quantize(x.to(torch.float32))
    y = dequant_linear.int4_groupwise_linear(xq, packed, scale, shift, zero, shape, group_size, code_base, 0, 0, _fp32(bias))
    return y.to(x.dtype)


def blockwise_4bit_linear_a8(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type,
                             bias=None):
    """``torchq::blockwise_4bit_linear_a8`` on Triton."""
    check_blockwise_4bit_linear_args(x, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize, quant_type, bias)
    xq = ACTIVATIONS.fake_quantize(x.to(torch.float32))
    y = dequant_linear.blockwise_4bit_linear(xq, packed, absmax, nested_codes, nested_absmax, nested_offset, shape, blocksize,
                                             quant_type, _fp32(bias))
    return y.to(x.dtype)
