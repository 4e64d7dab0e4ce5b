"""Moved to :mod:`torchq.hf` (``torchq.hf.attach``, ``torchq.hf.prepare_attach``,
``torchq.hf.install_registration_hook``); this alias of the old path warns and will be removed."""

from __future__ import annotations

import warnings
from typing import Any

from ..hf.hook import install_registration_hook
from ..hf.saving import attach, prepare_attach
from ..hf.state import is_pretrained_model, state_dict_and_metadata

__all__ = [  # noqa: F822  (TorchqConfig and TorchqHfQuantizer: module __getattr__, they import transformers)
    "TorchqConfig", "TorchqHfQuantizer", "attach", "install_registration_hook", "is_pretrained_model", "prepare_attach",
    "state_dict_and_metadata",
]

warnings.warn("torchq.interop.transformers moved to torchq.hf (torchq.hf.attach, torchq.hf.TorchqConfig, ...)",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    if name in ("TorchqConfig", "TorchqHfQuantizer"):
        from .. import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
