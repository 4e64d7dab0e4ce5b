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

Only these two functions are registered with ``torch.serialization.add_safe_globals`` when
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

from ..activation import OutlierInt8, PerTokenInt8, activation_from_json
from ..canonical import QuantSpec
from ..configs import QuantConfig, config_from_json
from ..layouts.base import Layout, layout_from_json
from ..primitives import MappingType, ZeroPointDomain
from ..tensor import AffineQuantizedTensor
from . import codec
from .model_state import release_free_memory

__all__ = ["PINNED_MODULE", "install", "_rebuild_quantized_tensor", "_rebuild_object"]

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


def _reduce_quantized_tensor(self: AffineQuantizedTensor, proto: int = 2):
    record, parts = codec.encode(self)
    text = codec.dumps(record)
    is_param = bool(getattr(self, "_is_param", False))
    return (_rebuild_quantized_tensor, (codec.FORMAT_VERSION, text, zlib.crc32(text.encode()), parts, is_param))


def _reducer(kind: str, to_json):
    def __reduce__(self):
        try:
            text = codec.dumps(to_json(self))
        except (TypeError, ValueError):  # a user-defined subclass with fields JSON cannot hold
            return object.__reduce__(self)
        return (_rebuild_object, (kind, text))

    return __reduce__


def _enum_reducer(kind: str):
    def __reduce_ex__(self, proto):
        return (_rebuild_object, (kind, json.dumps(self.value)))

    return __reduce_ex__


def safe_globals() -> list:
    """What ``torch.load(weights_only=True)`` may reference: the two rebuild functions, nothing else."""
    return [_rebuild_quantized_tensor, _rebuild_object]


def install() -> None:
    """Pin the rebuild functions, set the reductions, and allow-list the two functions (idempotent)."""
    for fn in (_rebuild_quantized_tensor, _rebuild_object):
        fn.__module__ = PINNED_MODULE
    AffineQuantizedTensor.__reduce_ex__ = _reduce_quantized_tensor  # type: ignore[method-assign]
    Layout.__reduce__ = _reducer("layout", lambda o: o.to_json())  # type: ignore[method-assign]
    QuantConfig.__reduce__ = _reducer("config", lambda o: o.to_json())  # type: ignore[method-assign]
    QuantSpec.__reduce__ = _reducer("spec", lambda o: o.to_json())  # type: ignore[method-assign]
    PerTokenInt8.__reduce__ = _reducer("act_quant", lambda o: o.to_json())  # type: ignore[method-assign]
    OutlierInt8.__reduce__ = _reducer("act_quant", lambda o: o.to_json())  # type: ignore[method-assign]
    MappingType.__reduce_ex__ = _enum_reducer("mapping_type")  # type: ignore[method-assign]
    ZeroPointDomain.__reduce_ex__ = _enum_reducer("zero_point_domain")  # type: ignore[method-assign]
    torch.serialization.add_safe_globals(safe_globals())
