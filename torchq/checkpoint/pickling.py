"""How torchq objects pickle, so ``torch.load(..., weights_only=True)`` needs nothing but ``import torchq``.

Every torchq object reduces to one of two functions at pinned top-level paths, whatever module
its class lives in, so moving code inside the package never breaks a checkpoint:

* ``torchq._rebuild_quantized_tensor(format_version, record_json, record_crc32, parts, is_param)``
  for an :class:`~torchq.AffineQuantizedTensor`: the JSON record and the plain part tensors of
  :mod:`torchq.checkpoint.codec` (device-independent; never a layout's packed bytes). Loading
  checks both CRCs and repacks into the saved layout when it can live on the device the parts
  were mapped to (``map_location``), else into that device's best layout.
* ``torchq._rebuild_object(kind, json)`` for layouts, configs, quant specs, activation
  schemes and the two enums.

Each class defines its own reduction (``__reduce__`` / ``__reduce_ex__``) through
:func:`reduce_object`, :func:`reduce_enum` and :func:`reduce_quantized_tensor`. Only these two
functions are registered with ``torch.serialization.add_safe_globals`` when
torchq is imported. No torchq class is: an allow-listed class can be instantiated by a pickle
without running its checks (``NEWOBJ`` + ``BUILD`` with an arbitrary ``__dict__``), so a crafted
file could build a quantized tensor whose buffers are smaller than its metadata claims. The
rebuild functions validate everything (CRCs, JSON records, part dtypes and sizes) and construct
objects through their ordinary constructors.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch

from ..activation import activation_from_json
from ..canonical import QuantSpec
from ..configs import config_from_json
from ..layouts.base import layout_from_json
from ..primitives import MappingType, ZeroPointDomain
from . import codec
from .model_state import release_free_memory

__all__ = [
    "PINNED_MODULE", "register_safe_globals", "reduce_object", "reduce_enum", "reduce_quantized_tensor",
    "_rebuild_quantized_tensor", "_rebuild_object",
]

PINNED_MODULE = "torchq"


def _rebuild_quantized_tensor(format_version: int, record_json: str, record_crc32: int, parts: dict, is_param: bool = False):
    codec.check_version(format_version, codec.FORMAT_VERSION, "quantized tensor: pickle format")
    if not isinstance(is_param, bool):
        raise codec.CheckpointError(f"quantized tensor: is_param must be true/false, got {type(is_param).__name__}")
    if not isinstance(record_json, str) or zlib.crc32(record_json.encode()) != record_crc32:
        raise codec.CheckpointError("quantized tensor: its metadata record is corrupted (crc32 mismatch)")
    record = codec.loads(record_json, "quantized tensor record")
    name = record.get("label") if isinstance(record, dict) and isinstance(record.get("label"), str) else "<unnamed>"
    w = codec.decode(record, parts, name=name)
    release_free_memory()
    if is_param:
        return torch.nn.Parameter(w, requires_grad=False)
    return w


_OBJECT_KINDS = {
    "layout": layout_from_json,
    "config": config_from_json,
    "spec": QuantSpec.from_json,
    "act_quant": activation_from_json,
    "mapping_type": MappingType,
    "zero_point_domain": ZeroPointDomain,
}


def _rebuild_object(kind: str, text: str) -> Any:
    if kind not in _OBJECT_KINDS:
        raise codec.CheckpointError(f"torchq object: unknown kind {kind!r}; known: {sorted(_OBJECT_KINDS)}")
    value = codec.loads(text, f"torchq {kind}")
    try:
        return _OBJECT_KINDS[kind](value)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise codec.CheckpointError(f"torchq {kind}: {e}") from None


def reduce_quantized_tensor(t: Any) -> tuple:
    """``AffineQuantizedTensor.__reduce_ex__``: its codec record and plain parts."""
    record, parts = codec.encode(t)
    text = codec.dumps(record)
    is_param = bool(getattr(t, "_is_param", False))
    return (_rebuild_quantized_tensor, (codec.FORMAT_VERSION, text, zlib.crc32(text.encode()), parts, is_param))


def reduce_object(kind: str, obj: Any) -> tuple:
    """``__reduce__`` of a layout, config, spec or activation scheme: ``obj.to_json()`` as
    ``kind``; a user-defined subclass whose fields JSON cannot hold pickles as a plain object."""
    try:
        text = codec.dumps(obj.to_json())
    except (TypeError, ValueError):
        return object.__reduce__(obj)
    return (_rebuild_object, (kind, text))


def reduce_enum(kind: str, value: str) -> tuple:
    """``__reduce_ex__`` of the enums (by value)."""
    return (_rebuild_object, (kind, json.dumps(value)))


def safe_globals() -> list:
    """What ``torch.load(weights_only=True)`` may reference: the two rebuild functions, nothing else."""
    return [_rebuild_quantized_tensor, _rebuild_object]


for _fn in (_rebuild_quantized_tensor, _rebuild_object):
    _fn.__module__ = PINNED_MODULE  # the path pickles name, whatever module defines the function


def register_safe_globals() -> None:
    """Allow-list the two rebuild functions for ``torch.load(weights_only=True)`` (idempotent)."""
    torch.serialization.add_safe_globals(safe_globals())
