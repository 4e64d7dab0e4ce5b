"""Device implementations of :mod:`torchq.ops.int4` by PyTorch's own int4 kernels:
``int4_tensor_core_mm`` on CUDA (``aten._weight_int4pack_mm``, tinygemm) and ``int4_xpu_mm`` on
XPU (``aten._weight_int4pack_mm`` / ``_weight_int4pack_mm_with_scales_and_zeros``).
``int4_cpu_mm`` and ``int8_weight_only_mm`` are defined by their aten ops on every device (see
:mod:`torchq.ops`), so they need no registration here. ``float8_dynamic_linear`` on CUDA:
``torch._scaled_mm`` (:func:`float8_dynamic_linear_scaled_mm`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..float8 import check_granularity, quantize_float8_activations
from ..ops.float8 import check_float8_weight_args, float8_dynamic_linear
from ..ops.int4 import int4_tensor_core_mm, int4_xpu_mm
from . import triton as triton_backend

_TINYGEMM_MAX_M = 32  # torchq.backends.triton.tiled_dequant.TINYGEMM_MAX_M (not imported: it imports triton)

__all__ = ["int4_tensor_core_mm_cuda", "int4_xpu_mm_xpu", "float8_dynamic_linear_scaled_mm"]


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


@float8_dynamic_linear.register_kernel("cuda")
def float8_dynamic_linear_scaled_mm(x, codes, scale, granularity, bias=None):
    """``torchq::float8_dynamic_linear`` through ``torch._scaled_mm``: the activations quantized as
    the reference does (torch ops, bit for bit), the product on FP8 tensor cores (CUDA compute
    capability 8.9+) with fp32 accumulation, row-wise scales (both operands' scales expanded to
    rows / columns) unless both are per tensor. Within the op's contract (fp32 summation order and
    scale order only). Also runs on the CPU (``torch._scaled_mm`` has a CPU kernel), where tests
    check it against the reference."""
    check_float8_weight_args("float8_dynamic_linear", x, codes, scale, bias)
    check_granularity(granularity)
    n, k = codes.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    xq, xs = quantize_float8_activations(x2, granularity)
    if granularity == "tensor" and scale.shape[0] == 1:
        sa, sb = xs.reshape(()), scale.reshape(())
    else:
        sa, sb = xs.expand(m, 1).contiguous(), scale.reshape(1, -1).expand(1, n).contiguous()
    y = torch._scaled_mm(xq, codes.t(), scale_a=sa, scale_b=sb, out_dtype=x.dtype)
    y = y if bias is None else y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], n)
