"""Blockwise (bitsandbytes-compatible) formats: NF4 / FP4 4-bit and 8-bit dynamic-map quantization.

* :mod:`.codebooks`: the NF4, FP4 and dynamic-map values;
* :mod:`.ops`: the ``torch.ops.torchq.*`` op library (reference implementations + fakes);
* :mod:`.nested`: double quantization of the 4-bit absmax statistics.
"""

from . import codebooks, nested, ops
from .codebooks import FP4, NF4, codebook, dynamic_map
from .nested import double_dequantize, double_quantize
from .ops import dequantize_4bit, dequantize_blockwise, gemv_4bit, quantize_4bit, quantize_blockwise

__all__ = ["FP4", "NF4", "codebook", "codebooks", "dequantize_4bit", "dequantize_blockwise", "double_dequantize",
           "double_quantize", "dynamic_map", "gemv_4bit", "nested", "ops", "quantize_4bit", "quantize_blockwise"]
