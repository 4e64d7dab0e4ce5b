"""Device implementations of :mod:`torchq.ops.int4` by PyTorch's own int4 kernels:
``int4_tensor_core_mm`` on CUDA (``aten._weight_int4pack_mm``, tinygemm) and ``int4_xpu_mm`` on
XPU (``aten._weight_int4pack_mm`` / ``_weight_int4pack_mm_with_scales_and_zeros``).
``int4_cpu_mm`` and ``int8_weight_only_mm`` are defined by their aten ops on every device (see
:mod:`torchq.ops`), so they need no registration here."""

from __future__ import annotations

import torch

from ..ops.int4 import int4_tensor_core_mm, int4_xpu_mm

__all__ = ["int4_tensor_core_mm_cuda", "int4_xpu_mm_xpu"]


@int4_tensor_core_mm.register_kernel("cuda")
def int4_tensor_core_mm_cuda(x, packed, group_size, scales_and_zeros):
    return torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, group_size, scales_and_zeros)


@int4_xpu_mm.register_kernel("xpu")
def int4_xpu_mm_xpu(x, packed, group_size, scales, int_zeros=None):
    if int_zeros is None:
        return torch.ops.aten._weight_int4pack_mm(x.contiguous(), packed, group_size, scales)
    return torch.ops.aten._weight_int4pack_mm_with_scales_and_zeros(x.contiguous(), packed, group_size, scales, int_zeros)
