"""Serve torchq checkpoints with vLLM: the ``torchq`` quantization method, as a vLLM plugin.

    import torchq, transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=torchq.hf.TorchqConfig("int4-g32"))
    model.save_pretrained("folder")                   # config.json says quant_method "torchq"

    from vllm import LLM                              # or: vllm serve folder
    llm = LLM(model="folder")                         # torchq's plugin serves it, quantized as saved

vLLM loads the plugin itself through the ``vllm.general_plugins`` entry point that installing torchq
declares (:func:`register`); ``import torchq`` never imports vLLM. Modules: :mod:`.folder` (the
checkpoint, checked before vLLM builds the model), :mod:`.weights` (a rank's shard of a layer's
parts and the quantized weight they become), both without vLLM; :mod:`.method` (vLLM's config and
linear method).
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """Register the ``torchq`` quantization method with vLLM (the plugin entry point; vLLM calls it
    in each of its processes). Idempotent."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    from .method import QUANT_METHOD, TorchqVllmConfig

    if QUANT_METHOD in QUANTIZATION_METHODS:
        from vllm.model_executor.layers.quantization import get_quantization_config

        try:
            if get_quantization_config(QUANT_METHOD) is TorchqVllmConfig:
                return
        except ValueError:
            pass
    register_quantization_config(QUANT_METHOD)(TorchqVllmConfig)
