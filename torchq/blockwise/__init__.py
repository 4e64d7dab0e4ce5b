"""Numerics of the blockwise (bitsandbytes-compatible) formats that are not ops: the NF4, FP4 and
8-bit dynamic-map values (:mod:`.codebooks`) and double quantization of 4-bit absmax statistics
(:mod:`.nested`). The ops themselves (``torch.ops.torchq.quantize_4bit`` ...,
``blockwise_4bit_linear``) are in :mod:`torchq.ops.blockwise`.
"""

from . import codebooks, nested
from .codebooks import FP4, NF4, codebook, dynamic_map
from .nested import double_dequantize, double_quantize

__all__ = ["FP4", "NF4", "codebook", "codebooks", "double_dequantize", "double_quantize", "dynamic_map", "nested"]
