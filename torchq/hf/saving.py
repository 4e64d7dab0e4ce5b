"""transformers' ``save_pretrained`` for models with torchq weights.

``save_pretrained`` writes the weights of a model whose ``hf_quantizer`` is a serializable
``transformers.quantizers.HfQuantizer`` as that quantizer flattens them. :func:`attach` gives a
``PreTrainedModel`` torchq's: ``model.hf_quantizer`` (a :class:`TorchqHfQuantizer`) and
``model.config.quantization_config`` (a :class:`TorchqConfig`, ``quant_method = "torchq"``,
written into ``config.json``). ``quantize_`` and ``load_quantized`` attach it to a transformers
model they leave with torchq weights. ``model.save_pretrained(folder)`` then writes the files of
:func:`torchq.save_quantized` (the same device-independent records and parts, one torchq header
for the whole checkpoint repeated in every shard), and :func:`torchq.load_quantized` reads the
folder into a model built from its config (on ``meta`` or float), sharded or not.

``from_pretrained`` loads such a folder quantized (:mod:`torchq.hf.registry`, registered by
``import torchq`` once transformers' model loading is imported: :mod:`torchq.hf.hook`).

Nothing here imports transformers until a transformers model is seen, so torchq imports
without it. Importing this module registers :func:`prepare_attach` with
:func:`torchq.hooks.on_weights_installed`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn

from ..hooks import on_weights_installed
from .state import is_pretrained_model

__all__ = ["attach", "prepare_attach"]


def _has_torchq_weights(model: nn.Module) -> bool:
    from ..tensor import AffineQuantizedTensor

    return any(isinstance(t, AffineQuantizedTensor) for t in [*model.parameters(), *model.buffers()])


def _classes() -> tuple[type, type]:
    """torchq's transformers config and quantizer classes, registered with transformers."""
    from .registry import TorchqConfig, TorchqHfQuantizer

    return TorchqConfig, TorchqHfQuantizer


def _committer(model: nn.Module) -> Callable[[], None]:
    config_cls, quantizer_cls = _classes()
    current = getattr(model, "hf_quantizer", None)
    if current is not None and not isinstance(current, quantizer_cls):
        method = getattr(getattr(current, "quantization_config", None), "quant_method", "?")
        raise ValueError(
            f"model: already has transformers quantizer {type(current).__name__} (quant_method "
            f"{getattr(method, 'value', method)!r}); torchq cannot replace it"
        )
    if current is not None:  # torchq's already (from_pretrained's): keep it and its config
        def keep() -> None:
            model.config.quantization_config = current.quantization_config

        return keep
    config = config_cls()
    quantizer = quantizer_cls(config, pre_quantized=True)

    def commit() -> None:  # two attribute assignments
        model.hf_quantizer = quantizer
        model.config.quantization_config = config

    return commit


def attach(model: nn.Module) -> nn.Module:
    """Give the transformers model ``model`` torchq's quantizer and ``quantization_config``, so
    that ``model.save_pretrained(folder)`` writes its torchq weights; returns ``model``.
    ``quantize_`` and ``load_quantized`` do this themselves."""
    if not is_pretrained_model(model):
        raise TypeError(f"model: expected a transformers PreTrainedModel, got {type(model).__name__}")
    _committer(model)()
    return model


def prepare_attach(model: nn.Module, *, needs_weights: bool = False) -> Callable[[], None] | None:
    """For a transformers model, a function that attaches torchq's quantizer and cannot fail
    (None for any other model, or one with another library's quantizer). Never raises: a
    failure to prepare is a warning (only ``save_pretrained`` is affected). ``needs_weights``:
    None unless the model already holds torchq weights."""
    if not is_pretrained_model(model) or (needs_weights and not _has_torchq_weights(model)):
        return None
    try:
        return _committer(model)
    except ValueError:
        return None  # another library's quantizer: its save path reports torchq weights itself
    except Exception as e:  # an unexpected transformers version
        warnings.warn(f"torchq: cannot attach its transformers quantizer ({e}); save_pretrained will not write "
                      f"this model's torchq weights (use torchq.save_quantized)", stacklevel=3)
        return None


on_weights_installed(lambda model, needs_weights: prepare_attach(model, needs_weights=needs_weights))
