"""PEFT adapters (LoRA, QLoRA) on torchq models.

``peft.get_peft_model(model, LoraConfig(...))`` needs nothing from torchq: its default LoRA layer
wraps each ``nn.Linear`` whose weight is a torchq weight, the frozen quantized linear runs on
torchq's kernels and passes gradients to its input, and only the adapters train (QLoRA on NF4 or
int4 bases). ``save_pretrained`` / ``PeftModel.from_pretrained`` write and read the (float)
adapters only, and ``unload()`` gives the base model back unchanged.

Merging is where a quantized base differs: a merged weight ``W + scale · B A`` is no longer the
quantized one, so it must be quantized again (losing some of the adapter's precision) or kept in
float. PEFT's own ``merge_and_unload()`` would add the delta in place and gets a clear error from
torchq (quantized weights are immutable) naming :func:`merge_and_unload`, which does it:

    merged = torchq.hf.merge_and_unload(peft_model)                    # requantized, same configs
    merged = torchq.hf.merge_and_unload(peft_model, requantize=False)  # merged into float
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..algorithms.statistics import CALIBRATED
from ..tensor import AffineQuantizedTensor

__all__ = ["merge_and_unload", "requantize_like"]


def requantize_like(weight: AffineQuantizedTensor, value: torch.Tensor) -> AffineQuantizedTensor:
    """``value`` (the module's view of the weight, like ``weight.dequantize()``) quantized with the
    config that produced ``weight`` (format, group size, layout); a calibrated algorithm (GPTQ,
    AWQ) becomes round to nearest, which needs no data."""
    cfg = weight.config
    if cfg is None:
        raise ValueError(f"weight {weight.label or tuple(weight.shape)!r}: records no torchq config to quantize the merged "
                         f"weight with (imported from another format); merge with requantize=False")
    if getattr(cfg, "algorithm", None) in CALIBRATED:
        cfg = dataclasses.replace(cfg, algorithm="rtn")
    w = value.t().contiguous() if weight.transposed else value
    q = cfg.quantize_weight(w.to(weight.dtype), label=weight.label)
    return q._replace(transposed=True) if weight.transposed else q


def _adapters(layer: Any, adapter_names: Iterable[str] | None) -> list[str]:
    names = list(layer.active_adapters if adapter_names is None else adapter_names)
    return [a for a in names if a in getattr(layer, "lora_A", {})]


def merge_and_unload(model: nn.Module, *, requantize: bool = True, adapter_names: list[str] | None = None) -> nn.Module:
    """Merge the LoRA adapters of the PEFT model ``model`` into their base layers and return the
    base model without adapter layers (as PEFT's ``merge_and_unload``).

    A torchq base weight is dequantized, the adapters' delta (``get_delta_weight``) added in fp32,
    and the sum quantized again with the weight's own config (``requantize=True``, default: see
    :func:`requantize_like`) or kept in float (``requantize=False``: the layer becomes a float
    linear). Float base layers merge as PEFT merges them. Every new weight is computed before the
    first is installed, so an error leaves ``model`` unchanged. ``adapter_names``: the adapters to
    merge (default: the active ones)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuner = getattr(model, "base_model", model)
    if not hasattr(tuner, "unload"):
        raise TypeError(f"model: expected a PEFT model (peft.get_peft_model's result), got {type(model).__name__}")
    staged: list[tuple[nn.Module, nn.Parameter]] = []
    float_layers: list[tuple[Any, list[str]]] = []
    seen: dict[int, str] = {}
    for name, layer in tuner.model.named_modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        names = _adapters(layer, adapter_names)
        if not names:
            continue
        base = layer.get_base_layer()
        weight = getattr(base, "weight", None)
        if not isinstance(weight, AffineQuantizedTensor):
            float_layers.append((layer, names))
            continue
        for a in names:
            if layer.use_dora.get(a) or getattr(layer, "lora_bias", {}).get(a):
                raise NotImplementedError(f"merge_and_unload: layer {name!r}: adapter {a!r} uses DoRA or lora_bias, which "
                                          f"merging into a quantized base does not support; nothing was merged")
        if id(weight) in seen:
            raise ValueError(f"merge_and_unload: {seen[id(weight)]!r} and {name!r} share one quantized weight (tied) and each "
                             f"has adapters; merging would untie them; nothing was merged")
        seen[id(weight)] = name
        dense = weight.dequantize(torch.float32)
        for a in names:
            dense = dense + layer.get_delta_weight(a).to(torch.float32)
        new = requantize_like(weight, dense) if requantize else dense.to(weight.dtype)
        staged.append((base, nn.Parameter(new, requires_grad=False)))
    for layer, names in float_layers:
        layer.merge(adapter_names=names)
    for base, param in staged:
        base._parameters["weight"] = param
    return tuner.unload()
