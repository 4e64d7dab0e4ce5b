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

``from_pretrained`` cannot load such a folder yet: once this module has set up its classes
(any torchq call on a transformers model does), it raises a ``NotImplementedError`` saying how
to load it; in a process that never did, transformers warns "Unknown quantization type, got
torchq", loads the float entries and leaves the quantized weights randomly initialized (its load
report lists them as MISSING and their parts as UNEXPECTED).

Nothing here imports transformers until a transformers model is seen, so torchq imports
without it.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [  # noqa: F822  (TorchqConfig and TorchqHfQuantizer are built on first use: module __getattr__)
    "QUANT_METHOD", "TorchqConfig", "TorchqHfQuantizer", "attach", "is_pretrained_model", "state_dict_and_metadata",
]

QUANT_METHOD = "torchq"
LOAD_HINT = (
    "config = transformers.AutoConfig.from_pretrained(folder); with torch.device('meta'): "
    "model = transformers.AutoModelForCausalLM.from_config(config) (or the model's own class); "
    "torchq.load_quantized(model, folder, init_buffers='auto')"
)


def is_pretrained_model(model: Any) -> bool:
    """True for a ``transformers.PreTrainedModel`` (never imports transformers)."""
    mu = sys.modules.get("transformers.modeling_utils")
    base = getattr(mu, "PreTrainedModel", None)
    return isinstance(base, type) and isinstance(model, base)


def _has_torchq_weights(model: nn.Module) -> bool:
    from ..tensor import AffineQuantizedTensor

    return any(isinstance(t, AffineQuantizedTensor) for t in [*model.parameters(), *model.buffers()])


def state_dict_and_metadata(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What ``save_pretrained`` writes for ``model``: plain tensors (quantized weights as the parts
    of their torchq records, float ones under their names, each tie once) and the safetensors
    metadata holding the torchq header (see :func:`torchq.checkpoint.safetensors_io.flatten_model`).
    Entries of ``model._keys_to_ignore_on_save`` are left out."""
    from ..checkpoint.safetensors_io import flatten_model

    exclude = frozenset(getattr(model, "_keys_to_ignore_on_save", None) or ())
    renames = functools.partial(_renames_on_save, model) if is_pretrained_model(model) else None
    return flatten_model(model, exclude=exclude, renames=renames)


def _renames_on_save(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
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


@functools.cache
def _classes() -> tuple[type, type]:
    """Build (once) the transformers subclasses and register them as quant_method "torchq"."""
    from transformers.quantizers import auto
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin

    from .. import __version__
    from ..checkpoint.safetensors_io import FILE_FORMAT, FILE_VERSION

    class TorchqConfig(QuantizationConfigMixin):
        """``quantization_config`` of a transformers model with torchq weights."""

        def __init__(self, format: str = FILE_FORMAT, version: int = FILE_VERSION,
                     torchq_version: str | None = None, load_with: str = LOAD_HINT, **kwargs: Any) -> None:
            self.quant_method = QUANT_METHOD
            self.format = format
            self.version = version
            self.torchq_version = torchq_version or __version__
            self.load_with = load_with

    class TorchqHfQuantizer(HfQuantizer):
        """transformers' view of a model with torchq weights: ``save_pretrained`` writes them in
        torchq's format; ``from_pretrained`` refuses them (load with ``torchq.load_quantized``)."""

        requires_calibration = False

        def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
            return True

        @property
        def is_trainable(self) -> bool:  # frozen weights; adapters (LoRA/QLoRA) on top train
            return True

        @property
        def is_compileable(self) -> bool:
            return True

        def validate_environment(self, *args: Any, **kwargs: Any) -> None:
            if self.pre_quantized:
                raise NotImplementedError(
                    "from_pretrained: this checkpoint holds torchq weights (quantization_config.quant_method "
                    "'torchq'), which transformers cannot load yet; load them with torchq: " + LOAD_HINT
                )
            raise NotImplementedError(
                "from_pretrained: torchq does not quantize while transformers loads; load the float model, then "
                "call torchq.quantize_(model, config)"
            )

        def get_state_dict_and_metadata(self, model: nn.Module) -> tuple[dict | None, dict[str, str]]:
            if getattr(model, "_hf_peft_config_loaded", False):
                return None, {}  # save_pretrained writes only the (float) adapter weights
            return state_dict_and_metadata(model)

    # module-level names, so that pickle and copy find the classes
    for cls in (TorchqConfig, TorchqHfQuantizer):
        cls.__module__ = __name__
        cls.__qualname__ = cls.__name__
        globals()[cls.__name__] = cls
    auto.AUTO_QUANTIZATION_CONFIG_MAPPING.setdefault(QUANT_METHOD, TorchqConfig)
    auto.AUTO_QUANTIZER_MAPPING.setdefault(QUANT_METHOD, TorchqHfQuantizer)
    return TorchqConfig, TorchqHfQuantizer


def __getattr__(name: str) -> Any:
    if name in ("TorchqConfig", "TorchqHfQuantizer"):
        config_cls, quantizer_cls = _classes()
        return config_cls if name == "TorchqConfig" else quantizer_cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _committer(model: nn.Module) -> Callable[[], None]:
    config_cls, quantizer_cls = _classes()
    current = getattr(model, "hf_quantizer", None)
    if current is not None and not isinstance(current, quantizer_cls):
        method = getattr(getattr(current, "quantization_config", None), "quant_method", "?")
        raise ValueError(
            f"model: already has transformers quantizer {type(current).__name__} (quant_method "
            f"{getattr(method, 'value', method)!r}); torchq cannot replace it"
        )
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
