"""Blockwise (bitsandbytes-compatible) formats: NF4 / FP4 4-bit and 8-bit dynamic-map quantization.

* :mod:`.codebooks`: the NF4, FP4 and dynamic-map values;
* :mod:`.ops`: the ``torch.ops.torchq.*`` op library (reference implementations + fakes);
* :mod:`.nested`: double quantization of the 4-bit absmax statistics;
* :mod:`.out_overloads`: the ``.out`` overloads (``torch.ops.torchq.dequantize_4bit.out`` ...);
* :mod:`.linear`: ``torchq::blockwise_4bit_linear`` (fused native CPU kernel, reference, autograd)
  and the native CPU kernels of ``gemv_4bit`` / ``gemm_4bit``.
"""

from . import codebooks, linear, nested, ops
from .codebooks import FP4, NF4, codebook, dynamic_map
from .linear import blockwise_4bit_linear
from .nested import double_dequantize, double_quantize
from .ops import dequantize_4bit, dequantize_blockwise, gemm_4bit, gemv_4bit, quantize_4bit, quantize_blockwise

__all__ = ["FP4", "NF4", "blockwise_4bit_linear", "codebook", "codebooks", "dequantize_4bit", "dequantize_blockwise", "double_dequantize",
           "double_quantize", "dynamic_map", "gemm_4bit", "gemv_4bit", "linear", "nested", "ops", "quantize_4bit", "quantize_blockwise"]
