"""torchq inside Hugging Face transformers: all of torchq's transformers code.

    import torchq, transformers
    cfg = torchq.hf.TorchqConfig("int4-g128")          # a config, its name, a plan, an autoquant plan
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg)
    model.save_pretrained("out")                         # torchq safetensors + quant_method in config.json
    again = transformers.AutoModelForCausalLM.from_pretrained("out")   # quantized, nothing re-quantized
    peft_model = peft.get_peft_model(again, peft.LoraConfig(...))       # QLoRA: train, save, load adapters
    merged = torchq.hf.merge_and_unload(peft_model)                     # dequantize, merge, requantize
    smol = torchq.hf.from_gguf("model.gguf")            # a GGUF file, its quantized weights kept

Modules: :mod:`.config` (``TorchqConfig``), :mod:`.quantizer` (``TorchqHfQuantizer``),
:mod:`.registry` (registers both with transformers), :mod:`.peft` (merging adapters),
:mod:`.gguf` (``from_gguf``); and, importing no transformers: :mod:`.hook` (registers on
transformers' model loading), :mod:`.saving` (``save_pretrained`` for models quantized by
``quantize_`` / ``load_quantized``), :mod:`.state` (what ``save_pretrained`` writes).

Importing this package imports no transformers; its names do on first use, and the first one
registers ``quant_method = "torchq"`` with transformers (so does ``import torchq`` as soon as
transformers' model loading is imported, so loading a saved folder needs only ``import torchq``).
transformers >= 5 is required (``pip install 'torchq[hf]'``).
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the submodule defining it; those of the last three import no transformers
_HOMES: dict[str, str] = {
    "QUANT_METHOD": "config", "TorchqConfig": "config", "resolve_spec": "config",
    "TorchqHfQuantizer": "quantizer", "TorchqQuantize": "quantizer", "TorchqDeserialize": "quantizer",
    "register": "registry", "merge_and_unload": "peft", "requantize_like": "peft", "from_gguf": "gguf",
    "attach": "saving", "prepare_attach": "saving", "install_registration_hook": "hook",
}
_WITHOUT_TRANSFORMERS = frozenset({"attach", "prepare_attach", "install_registration_hook"})

__all__ = [  # noqa: F822  (module __getattr__)
    "QUANT_METHOD", "TorchqConfig", "TorchqDeserialize", "TorchqHfQuantizer", "TorchqQuantize", "attach", "from_gguf",
    "install_registration_hook", "merge_and_unload", "prepare_attach", "register", "requantize_like", "resolve_spec",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _WITHOUT_TRANSFORMERS:
        importlib.import_module(".registry", __name__)  # transformers >= 5, quant_method "torchq" registered
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:  # the public names and the submodules imported so far
    return sorted({*__all__, *(k for k, v in globals().items() if getattr(v, "__name__", "").startswith(f"{__name__}."))})
