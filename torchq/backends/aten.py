"""Device implementations of :mod:`torchq.ops.int4` by PyTorch's own int4 kernels:
``int4_tensor_core_mm`` on CUDA (``aten._weight_int4pack_mm``, tinygemm) and ``int4_xpu_mm`` on
XPU (``aten._weight_int4pack_mm`` / ``_weight_int4pack_mm_with_scales_and_zeros``).
``int4_cpu_mm`` and ``int8_weight_only_mm`` are defined by their aten ops on every device (see
:mod:`torchq.ops`), so they need no registration here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.int4 import int4_tensor_core_mm, int4_xpu_mm
from . import triton as triton_backend

_TINYGEMM_MAX_M = 32  # torchq.backends.triton.tiled_dequant.TINYGEMM_MAX_M (not imported: it imports triton)

__all__ = ["int4_tensor_core_mm_cuda", "int4_xpu_mm_xpu"]


@int4_tensor_core_mm.register_kernel("cuda")
def int4_tensor_core_mm_cuda(x, packed, group_size, scales_and_zeros):
    """tinygemm below ``TINYGEMM_MAX_M`` rows; from there (where tinygemm measured 4-25x slower
    than bf16 cuBLAS on an H200) the weight written once in bf16 by a Triton kernel, bit for bit
    tinygemm's, then cuBLAS."""
    if x.shape[0] >= _TINYGEMM_MAX_M and triton_backend.available():
        from .triton.tiled_dequant import tiled_dequantize

        return F.linear(x, tiled_dequantize(packed, scales_and_zeros, group_size))
    return torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, group_size, scales_and_zeros)


@int4_xpu_mm.register_kernel("xpu")
def int4_xpu_mm_xpu(x, packed, group_size, scales, int_zeros=None):
    if int_zeros is None:
        return torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, group_size, scales)
    return torch.ops.aten._weight_int4pack_mm_with_scales_and_zeros(x.contiguous(), packed, group_size, scales, int_zeros)
