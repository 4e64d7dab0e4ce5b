"""Blockwise (bitsandbytes-compatible) formats: NF4 / FP4 4-bit and 8-bit dynamic-map quantization.

* :mod:`.codebooks`: the NF4, FP4 and dynamic-map values;
* :mod:`.ops`: the ``torch.ops.torchq.*`` op library (reference implementations + fakes).
"""

from . import codebooks, ops
from .codebooks import FP4, NF4, codebook, dynamic_map
from .ops import dequantize_4bit, dequantize_blockwise, quantize_4bit, quantize_blockwise

__all__ = ["FP4", "NF4", "codebook", "codebooks", "dequantize_4bit", "dequantize_blockwise", "dynamic_map", "ops",
           "quantize_4bit", "quantize_blockwise"]
