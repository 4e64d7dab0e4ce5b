"""How torchq objects pickle (the foundation under every module that defines a picklable class).

Every torchq object reduces to one of two functions at pinned top-level paths, whatever module
its class lives in, so moving code inside the package never breaks a checkpoint:

* ``torchq._rebuild_quantized_tensor(format_version, record_json, record_crc32, parts, is_param)``
  for an :class:`~torchq.AffineQuantizedTensor`: a JSON record and the plain part tensors of
  :mod:`torchq.checkpoint.codec` (device-independent; never a layout's packed bytes);
* ``torchq._rebuild_object(kind, json)`` for layouts, configs, quant specs, activation schemes
  and the two enums.

This module knows no torchq class. Each defining module registers its kind's ``from_json``
(:func:`register_kind`) and reduces its objects through :func:`reduce_object` /
:func:`reduce_enum`; :mod:`torchq.checkpoint.pickling` registers the quantized tensor's codec
(:func:`register_tensor_codec`) and allow-lists the two functions for
``torch.load(weights_only=True)``. ``import torchq`` fills every registration before a pickle
can name a function. The rebuild functions validate everything (CRCs, JSON records, part dtypes
and sizes, through the registered codec) and build objects through their ordinary constructors.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

__all__ = [
    "PINNED_MODULE", "CheckpointError", "dumps", "loads", "check_version", "is_int", "register_kind", "registered_kinds",
    "register_tensor_codec", "reduce_object", "reduce_enum", "reduce_quantized_tensor", "rebuild_functions",
]

PINNED_MODULE = "torchq"


class CheckpointError(ValueError):
    """A checkpoint is unreadable, inconsistent, corrupted or does not fit the model; the
    message names the tensor (and file) and the problem. Loading left the model unchanged."""


CheckpointError.__module__ = "torchq.checkpoint.codec"  # where users have always imported it from


def dumps(obj: Any) -> str:
    """Canonical JSON (sorted keys, no NaN) used for every record and header torchq writes."""
    return json.dumps(obj, sort_keys=True, allow_nan=False, separators=(",", ":"))


def loads(text: Any, what: str) -> Any:
    """JSON text to a value; NaN / Infinity and anything but text are a :class:`CheckpointError` naming ``what``."""
    if not isinstance(text, str):
        raise CheckpointError(f"{what}: expected JSON text, got {type(text).__name__}")
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{what}: not valid JSON ({e})") from None


def _reject_constant(c: str) -> Any:
    raise ValueError(f"{c} is not allowed")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_version(version: Any, supported: int, what: str) -> None:
    """A format version must be an int from 1 to ``supported``; a newer one asks for an upgrade."""
    if not is_int(version) or version < 1:
        raise CheckpointError(f"{what}: invalid version {version!r}")
    if version > supported:
        raise CheckpointError(f"{what} version {version} is newer than this torchq reads (up to {supported}); upgrade torchq")


# -- registrations ------------------------------------------------------------------------------------
_KINDS: dict[str, Callable[[Any], Any]] = {}


def register_kind(kind: str, from_json: Callable[[Any], Any]) -> None:
    """Let ``torchq._rebuild_object(kind, json)`` build objects with ``from_json`` (called once,
    by the module that defines the kind; a second registration of a kind is a bug)."""
    if kind in _KINDS and _KINDS[kind] is not from_json:
        raise ValueError(f"kind: {kind!r} is already registered (by {_KINDS[kind]!r})")
    _KINDS[kind] = from_json


def registered_kinds() -> tuple[str, ...]:
    return tuple(sorted(_KINDS))


class _TensorCodec:
    version: int = 0
    encode: Callable[[Any], tuple[Any, dict]] | None = None
    decode: Callable[[Any, dict, str], Any] | None = None


def register_tensor_codec(version: int, encode: Callable[[Any], tuple[Any, dict]], decode: Callable[[Any, dict, str], Any]) -> None:
    """The quantized tensor's record format: ``encode(tensor) -> (record, parts)``,
    ``decode(record, parts, name) -> tensor`` (validating), at format ``version``."""
    _TensorCodec.version, _TensorCodec.encode, _TensorCodec.decode = version, encode, decode


# -- the two pinned functions ---------------------------------------------------------------------------
def _rebuild_quantized_tensor(format_version: int, record_json: str, record_crc32: int, parts: dict, is_param: bool = False):
    if _TensorCodec.decode is None:
        raise CheckpointError("quantized tensor: torchq.checkpoint is not imported (import torchq)")
    check_version(format_version, _TensorCodec.version, "quantized tensor: pickle format")
    if not isinstance(is_param, bool):
        raise CheckpointError(f"quantized tensor: is_param must be true/false, got {type(is_param).__name__}")
    if not isinstance(record_json, str) or zlib.crc32(record_json.encode()) != record_crc32:
        raise CheckpointError("quantized tensor: its metadata record is corrupted (crc32 mismatch)")
    record = loads(record_json, "quantized tensor record")
    name = record.get("label") if isinstance(record, dict) and isinstance(record.get("label"), str) else "<unnamed>"
    w = _TensorCodec.decode(record, parts, name)
    if is_param:
        import torch

        return torch.nn.Parameter(w, requires_grad=False)
    return w


def _rebuild_object(kind: str, text: str) -> Any:
    if kind not in _KINDS:
        raise CheckpointError(f"torchq object: unknown kind {kind!r}; known: {sorted(_KINDS)}")
    value = loads(text, f"torchq {kind}")
    try:
        return _KINDS[kind](value)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"torchq {kind}: {e}") from None


for _fn in (_rebuild_quantized_tensor, _rebuild_object):
    _fn.__module__ = PINNED_MODULE  # the path pickles name, whatever module defines the function


def rebuild_functions() -> tuple[Callable, Callable]:
    """``(torchq._rebuild_quantized_tensor, torchq._rebuild_object)``: what pickles reference and
    ``torch.load(weights_only=True)`` may call."""
    return _rebuild_quantized_tensor, _rebuild_object


# -- reductions -------------------------------------------------------------------------------------------
def reduce_quantized_tensor(t: Any) -> tuple:
    """``AffineQuantizedTensor.__reduce_ex__``: its codec record and plain parts."""
    if _TensorCodec.encode is None:
        raise RuntimeError("torchq: pickling a quantized tensor needs torchq.checkpoint (import torchq)")
    record, parts = _TensorCodec.encode(t)
    text = dumps(record)
    is_param = bool(getattr(t, "_is_param", False))
    return (_rebuild_quantized_tensor, (_TensorCodec.version, text, zlib.crc32(text.encode()), parts, is_param))


def reduce_object(kind: str, obj: Any) -> tuple:
    """``__reduce__`` of a layout, config, spec or activation scheme: ``obj.to_json()`` as
    ``kind``; a user-defined subclass whose fields JSON cannot hold pickles as a plain object."""
    try:
        text = dumps(obj.to_json())
    except (TypeError, ValueError):
        return object.__reduce__(obj)
    return (_rebuild_object, (kind, text))


def reduce_enum(kind: str, value: str) -> tuple:
    """``__reduce_ex__`` of the enums (by value)."""
    return (_rebuild_object, (kind, json.dumps(value)))
