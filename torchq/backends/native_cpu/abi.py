"""The Python view of the native library's weight struct (``csrc/weight_abi.h``).

The C header declares ``tq_weight`` once (an X-macro list of name, C type, kind) and the
library describes it at run time: ``tq_weight_abi(i, &name, &kind, &offset)`` for field ``i``
and ``tq_weight_size()``. :func:`weight_structure` builds the ``ctypes.Structure`` from that
description and checks it against :data:`FIELDS` (what torchq fills), so a library whose
struct differs is refused when it loads (:mod:`torchq.native` says why), never called.

Formats (the ``format`` field; which fields each reads is in ``csrc/weight_abi.h``):
``FORMAT_LUT4`` 4-bit codes through a 16-entry table (NF4 / FP4 / affine int4),
``FORMAT_LUT4_INT8ACT`` the same weight with per-32-block int8 activations (integer dot products),
``FORMAT_INT8`` int8 weight-only, ``FORMAT_INT8_DYNAMIC`` int8 weight with per-row int8
activations, ``FORMAT_INT8_STATIC`` int8 weight with static int8 activations (one fixed scale and
zero point; the weight's row sums for the zero point's correction).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

__all__ = ["FIELDS", "FORMAT_INT8", "FORMAT_INT8_DYNAMIC", "FORMAT_INT8_STATIC", "FORMAT_LUT4", "FORMAT_LUT4_INT8ACT", "Field",
           "describe", "weight_structure"]

FORMAT_LUT4, FORMAT_INT8, FORMAT_INT8_DYNAMIC, FORMAT_LUT4_INT8ACT, FORMAT_INT8_STATIC = 1, 2, 3, 4, 5

# tq_field_kind -> (name, ctypes type)
KINDS: dict[int, tuple[str, type]] = {
    0: ("int32", ctypes.c_int32),
    1: ("int64", ctypes.c_int64),
    2: ("float32", ctypes.c_float),
    3: ("pointer", ctypes.c_void_p),
}
_I32, _I64, _F32, _PTR = 0, 1, 2, 3

# Every field torchq fills, with its kind: the library must have each, of this kind.
FIELDS: dict[str, int] = {
    "format": _I32, "n": _I64, "k": _I64, "row_length": _I64, "scales": _PTR,
    "block": _I64, "packed": _PTR, "codebook": _PTR, "shifts": _PTR, "zeros": _PTR, "round_mul": _I32, "round_add": _I32,
    "nested_codes": _PTR, "nested_absmax": _PTR, "nested_offset": _PTR, "nested_map": _PTR,
    "codes": _PTR, "act_denom": _F32, "act_eps": _F32, "act_qmin": _I32, "act_qmax": _I32,
    "act_scale": _F32, "act_zero_point": _I32, "row_sums": _PTR, "codes_order": _I32, "code_sums": _PTR,
}


@dataclass(frozen=True)
class Field:
    name: str
    kind: int
    offset: int


def describe(lib: ctypes.CDLL) -> tuple[list[Field], int]:
    """The library's own description of ``tq_weight``: its fields in declaration order and its size in bytes."""
    name, kind, offset = ctypes.c_char_p(), ctypes.c_int(), ctypes.c_int64()
    fields = []
    while lib.tq_weight_abi(len(fields), ctypes.byref(name), ctypes.byref(kind), ctypes.byref(offset)):
        fields.append(Field(name.value.decode(), kind.value, offset.value))
    return fields, lib.tq_weight_size()


def weight_structure(fields: list[Field], size: int) -> tuple[type[ctypes.Structure] | None, str | None]:
    """``(the ctypes.Structure, None)`` for a library whose ``tq_weight`` is described by
    ``fields`` and ``size``, or ``(None, why not)``: a field of :data:`FIELDS` missing or of
    another kind, an unknown kind, or offsets / size that ctypes lays out differently."""
    by_name = {f.name: f for f in fields}
    for name, kind in FIELDS.items():
        if name not in by_name:
            return None, f"its weight struct lacks the field {name!r}"
        if by_name[name].kind != kind:
            return None, f"its weight struct's field {name!r} is {_kind(by_name[name].kind)}, torchq fills {_kind(kind)}"
    unknown = [f.name for f in fields if f.kind not in KINDS]
    if unknown:
        return None, f"its weight struct's field {unknown[0]!r} has unknown kind {by_name[unknown[0]].kind}"
    ordered = sorted(fields, key=lambda f: f.offset)
    struct = type("tq_weight", (ctypes.Structure,), {"_fields_": [(f.name, KINDS[f.kind][1]) for f in ordered]})
    for f in ordered:
        at = getattr(struct, f.name).offset
        if at != f.offset:
            return None, f"its weight struct's field {f.name!r} is at byte {f.offset}, ctypes lays it out at {at}"
    if ctypes.sizeof(struct) != size:
        return None, f"its weight struct has {size} bytes, ctypes lays out {ctypes.sizeof(struct)}"
    return struct, None


def _kind(kind: int) -> str:
    return KINDS[kind][0] if kind in KINDS else f"kind {kind}"
