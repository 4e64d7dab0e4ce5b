"""torchq's config and quantizer in transformers' registry (imports transformers).

Importing this module registers ``quant_method = "torchq"`` through transformers'
``register_quantization_config`` / ``register_quantizer``. Any public name of :mod:`torchq.hf`
but the transformers-free ones imports it first; ``import torchq`` imports it as soon as
transformers' model loading is imported (:mod:`torchq.hf.hook`), so loading a saved folder needs
only ``import torchq``.
"""

from __future__ import annotations

from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)

from .config import QUANT_METHOD, TorchqConfig
from .quantizer import TorchqHfQuantizer

__all__ = ["register"]


def register() -> None:
    """Register torchq's config and quantizer with transformers (idempotent). Raises ValueError if
    another library registered ``quant_method = "torchq"`` first."""
    for mapping, cls, reg in ((AUTO_QUANTIZATION_CONFIG_MAPPING, TorchqConfig, register_quantization_config),
                              (AUTO_QUANTIZER_MAPPING, TorchqHfQuantizer, register_quantizer)):
        current = mapping.get(QUANT_METHOD)
        if current is cls:
            continue
        if current is not None:
            raise ValueError(f"transformers already maps quant_method {QUANT_METHOD!r} to {current.__module__}.{current.__qualname__}")
        reg(QUANT_METHOD)(cls)


register()
