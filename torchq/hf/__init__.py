"""torchq inside Hugging Face transformers: ``from_pretrained(..., quantization_config=TorchqConfig(...))``.

    import torchq, transformers
    cfg = torchq.hf.TorchqConfig("int4-g128")          # a config, its name, a plan, an autoquant plan
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)
    model.save_pretrained("out")                         # torchq safetensors + quant_method in config.json
    again = transformers.AutoModelForCausalLM.from_pretrained("out")   # quantized, nothing re-quantized
    peft_model = peft.get_peft_model(again, peft.LoraConfig(...))       # QLoRA: train, save, load adapters
    merged = torchq.hf.merge_and_unload(peft_model)                     # dequantize, merge, requantize

Importing this module imports transformers and registers ``quant_method = "torchq"`` through
transformers' ``register_quantization_config`` / ``register_quantizer``. ``import torchq`` does it
by itself as soon as transformers' model loading is imported (an import hook; torchq never imports
transformers itself), so loading a saved folder needs only ``import torchq``.
"""

from __future__ import annotations

import transformers

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"torchq.hf follows transformers v5's loading contract (conversion ops); transformers "
                      f"{transformers.__version__} is installed: pip install 'torchq[hf]' (transformers>=5)")

from transformers.quantizers.auto import (  # noqa: E402
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)

from .config import QUANT_METHOD, TorchqConfig, resolve_spec  # noqa: E402
from .peft import merge_and_unload, requantize_like  # noqa: E402
from .quantizer import TorchqDeserialize, TorchqHfQuantizer, TorchqQuantize  # noqa: E402

__all__ = ["QUANT_METHOD", "TorchqConfig", "TorchqHfQuantizer", "TorchqQuantize", "TorchqDeserialize", "merge_and_unload",
           "register", "requantize_like", "resolve_spec"]


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
