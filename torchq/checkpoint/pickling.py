"""Pickling of quantized tensors: the codec behind ``torchq._rebuild_quantized_tensor`` and the
allow-list for ``torch.load(weights_only=True)``.

The two pinned rebuild functions, the kind registry and the reductions live in
:mod:`torchq.serialization` (the foundation every picklable class's module imports); this module
registers the quantized tensor's record format there (:mod:`.codec`: the JSON record and the plain
part tensors, device-independent, never a layout's packed bytes; loading checks both CRCs and
repacks into the saved layout when it can live on the device the parts were mapped to
(``map_location``), else into that device's best layout) and allow-lists the two functions.

Only these two functions are registered with ``torch.serialization.add_safe_globals`` when
torchq is imported. No torchq class is: an allow-listed class can be instantiated by a pickle
without running its checks (``NEWOBJ`` + ``BUILD`` with an arbitrary ``__dict__``), so a crafted
file could build a quantized tensor whose buffers are smaller than its metadata claims. The
rebuild functions validate everything (CRCs, JSON records, part dtypes and sizes) and construct
objects through their ordinary constructors.
"""

from __future__ import annotations

import torch

from ..serialization import PINNED_MODULE, rebuild_functions, register_tensor_codec
from . import codec
from .model_state import release_free_memory

__all__ = ["PINNED_MODULE", "register_safe_globals", "safe_globals"]


def _decode(record, parts: dict, name: str):
    w = codec.decode(record, parts, name=name)
    release_free_memory()
    return w


register_tensor_codec(codec.FORMAT_VERSION, codec.encode, _decode)


def safe_globals() -> list:
    """What ``torch.load(weights_only=True)`` may reference: the two rebuild functions, nothing else."""
    return list(rebuild_functions())


def register_safe_globals() -> None:
    """Allow-list the two rebuild functions for ``torch.load(weights_only=True)`` (idempotent)."""
    torch.serialization.add_safe_globals(safe_globals())
