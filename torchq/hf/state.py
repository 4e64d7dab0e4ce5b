"""What transformers' ``save_pretrained`` writes for a model with torchq weights (shared by
:mod:`torchq.hf.saving`, which attaches torchq's quantizer, and :mod:`torchq.hf.quantizer`,
which flattens the weights when transformers saves). Never imports transformers at import time."""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import nn

__all__ = ["is_pretrained_model", "state_dict_and_metadata", "renames_on_save"]


def is_pretrained_model(model: Any) -> bool:
    """True for a ``transformers.PreTrainedModel`` (never imports transformers)."""
    mu = sys.modules.get("transformers.modeling_utils")
    base = getattr(mu, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(model, base)


def state_dict_and_metadata(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What ``save_pretrained`` writes for ``model``: plain tensors (quantized weights as the parts
    of their torchq records, float ones under their names, each tie once) and the safetensors
    metadata holding the torchq header (see :func:`torchq.checkpoint.safetensors_io.flatten_model`).
    Entries of ``model._keys_to_ignore_on_save`` are left out."""
    from ..checkpoint.safetensors_io import flatten_model

    exclude = frozenset(getattr(model, "_keys_to_ignore_on_save", None) or ())
    renames = functools.partial(renames_on_save, model) if is_pretrained_model(model) else None
    return flatten_model(model, exclude=exclude, renames=renames)


def renames_on_save(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The keys ``save_pretrained`` will store under another name: it reverts the weight
    conversions of the model (legacy names such as BERT's ``LayerNorm.gamma``, renamed prefixes)
    on the flattened tensors. Conversions that change tensors (MoE expert merges) are refused."""
    from transformers.core_model_loading import revert_weight_conversion

    try:
        reverted = revert_weight_conversion(model, dict(tensors))
    except Exception:  # a converter that cannot run on torchq's parts
        reverted = {}
    name_of = {id(v): k for k, v in reverted.items()}
    if len(reverted) != len(tensors) or set(name_of) != {id(v) for v in tensors.values()}:
        raise ValueError(
            f"save_pretrained: transformers converts {type(model).__name__}'s weights on save (its weight "
            f"conversions merge or split tensors), which torchq's parts cannot follow; save with "
            f"torchq.save_quantized(model, folder) and model.config.save_pretrained(folder) instead"
        )
    return {k: name_of[id(v)] for k, v in tensors.items() if name_of[id(v)] != k}
