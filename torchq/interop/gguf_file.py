"""A bounded GGUF reader: every count, length, type, offset and size a file states is checked
against the bytes present before anything is allocated in proportion to it.

GGUF (version 2 and 3; little-endian) is::

    magic "GGUF" · u32 version · u64 tensor_count · u64 kv_count
    kv_count key/values:  string key · u32 value type · value
    tensor_count infos:   string name · u32 n_dims (1..4) · n_dims u64 ne (ne0 first, contiguous)
                          · u32 ggml type · u64 offset (from the start of the data section)
    padding to ``general.alignment`` (u32, a power of two; default 32) · the data section

A string is a u64 byte length and that many UTF-8 bytes. Value types: 0 u8, 1 i8, 2 u16, 3 i16,
4 u32, 5 i32, 6 f32, 7 bool (one byte, 0 or 1), 8 string, 9 array (u32 element type, u64 count,
the elements; arrays of arrays are refused, as llama.cpp does), 10 u64, 11 i64, 12 f64. A tensor
of ggml type ``t`` (block of ``B`` elements in ``S`` bytes) holds ``ne0 % B == 0`` and takes
``prod(ne) / B · S`` bytes at its offset, which is a multiple of the alignment.

gguf-py's ``GGUFReader`` builds one numpy object per array element and reads past the end of
a file whose header claims more than it holds, so a few hundred hostile bytes cost gigabytes.
:class:`GGUFFile` instead refuses, with a :class:`~torchq.CheckpointError` naming the file and
the field or tensor, any file where: a count, string or array does not fit in the bytes left;
a key or tensor name repeats, is empty, or is not UTF-8 (names: under 64 bytes, llama.cpp's
limit; string values that are not UTF-8 keep their bytes as surrogate escapes); a value type or ggml type is unknown; a tensor has 0 or more than 4 dimensions or an empty one, a row
that is not whole blocks, an offset that is not aligned, data outside the data section, or data
overlapping another tensor's (llama.cpp refuses the same); ``general.alignment`` is not a power
of two; ``<arch>.block_count`` differs from the ``blk.N`` tensors present (see ``_check_block_count``). Numeric arrays are
kept as one numpy array each and strings as Python strings, so memory stays proportional to
the file. Tensor bytes are read only on request (:meth:`GGUFFile.tensor_bytes`), from a
read-only memory map.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.codec import CheckpointError

__all__ = ["GGUFFile", "GGUFField", "GGUFTensorInfo", "MAX_NAME_BYTES", "GGML_TYPES"]

MAGIC = b"GGUF"
MAX_NAME_BYTES = 64  # llama.cpp's GGML_MAX_NAME: a name must be shorter
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
# value type -> (struct code, size) for the fixed-size types
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<B", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY, BOOL = 8, 9, 7
_BLOCK_INDEX = re.compile(r"((?:enc\.|dec\.)?blk)\.(\d+)\.")


def _ggml_types() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, elements per block, bytes per block), from gguf-py's table."""
    try:
        from gguf.constants import GGML_QUANT_SIZES
    except ImportError as e:
        raise ImportError("reading GGUF files needs the gguf package: pip install gguf") from e
    return {int(t): (t.name, int(b), int(s)) for t, (b, s) in GGML_QUANT_SIZES.items()}


GGML_TYPES: dict[int, tuple[str, int, int]] = {}


@dataclass(frozen=True)
class GGUFField:
    """One key/value: ``type`` the GGUF value type; ``value`` a Python scalar or str, or for an
    array (``type`` 9, ``element_type`` its elements' type) a numpy array of numbers (bools as
    uint8) or a list of str."""

    name: str
    type: int
    value: Any
    element_type: int | None = None

    def contents(self) -> Any:
        """The value as plain Python (arrays as lists, bools as bool)."""
        if self.type == ARRAY:
            if self.element_type == STRING:
                return list(self.value)
            values = self.value.tolist()
            return [bool(v) for v in values] if self.element_type == BOOL else values
        return self.value


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's header entry: ``shape`` in PyTorch order (``ne`` reversed), ``kind`` the ggml
    type name, ``offset`` from the start of the file, ``nbytes`` its data size."""

    name: str
    type_id: int
    kind: str
    ne: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def numel(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


class _Cursor:
    """Reads little-endian values from ``buf``, refusing any read past its end."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, but the file has {self.size - self.pos} left "
                            f"(truncated or corrupted)")

    def scalar(self, code: str, size: int, what: str) -> Any:
        self.need(size, what)
        (v,) = struct.unpack_from(code, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str, limit: int | None = None, strict: bool = True) -> str:
        n = self.u64(f"{what}'s length")
        if limit is not None and n >= limit:
            raise self.fail(f"{what} is {n} bytes long; GGUF names are under {limit} bytes")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8", "strict" if strict else "surrogateescape")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not UTF-8 ({e})") from None


class GGUFFile:
    """A GGUF file's header, checked whole on opening (see the module docstring). ``fields``:
    key -> :class:`GGUFField` in file order; ``tensors``: :class:`GGUFTensorInfo` in file order.
    Use as a context manager (or call :meth:`close`) to release the memory map."""

    def __init__(self, path: str | os.PathLike) -> None:
        if not GGML_TYPES:
            GGML_TYPES.update(_ggml_types())
        self.path = str(path)
        try:
            with open(path, "rb") as f:
                self.size = os.fstat(f.fileno()).st_size
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e})") from None
        try:
            self._parse()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if isinstance(self._map, mmap.mmap):
            try:
                self._map.close()
            except BufferError:  # an array still views it; it closes when that is freed
                pass

    # -- the header --------------------------------------------------------------------------------
    def _parse(self) -> None:
        c = _Cursor(self._map, self.path)
        c.need(4, "the magic")
        if bytes(self._map[:4]) != MAGIC:
            raise c.fail(f"not a GGUF file (magic {bytes(self._map[:4])!r}, expected {MAGIC!r})")
        c.pos = 4
        self.version = c.u32("the version")
        if self.version not in (2, 3):
            raise c.fail(f"GGUF version {self.version} is not supported (expected 2 or 3)")
        n_tensors, n_kv = c.u64("the tensor count"), c.u64("the key/value count")
        # each key/value takes at least 8 (key length) + 1 (key) + 4 (type) + 1 (value) bytes, each
        # tensor info 8 + 1 + 4 + 8 + 4 + 8: a count the bytes left cannot hold is refused before any loop
        left = self.size - c.pos
        if n_kv * 14 > left:
            raise c.fail(f"key/value count {n_kv} cannot fit in the {left} bytes after the header")
        if n_tensors * 33 > left:
            raise c.fail(f"tensor count {n_tensors} cannot fit in the {left} bytes after the header")
        self.fields: dict[str, GGUFField] = {}
        for i in range(n_kv):
            key = c.string(f"key/value {i}'s key")
            if not key:
                raise c.fail(f"key/value {i} has an empty key")
            if key in self.fields:
                raise c.fail(f"key {key!r} appears twice")
            self.fields[key] = self._value(c, key)
        if (n_tensors * 33) > self.size - c.pos:
            raise c.fail(f"tensor count {n_tensors} cannot fit in the {self.size - c.pos} bytes after the metadata")
        self.alignment = self._alignment(c)
        infos = [self._tensor_info(c, i) for i in range(n_tensors)]
        self.data_start = -(-c.pos // self.alignment) * self.alignment
        if infos and self.data_start > self.size:
            raise c.fail(f"the data section would start at byte {self.data_start}, past the end of the {self.size}-byte file")
        names: set[str] = set()
        self.tensors: list[GGUFTensorInfo] = []
        for name, type_id, ne, rel in infos:
            if name in names:
                raise c.fail(f"tensor {name!r} appears twice")
            names.add(name)
            kind, block, size = GGML_TYPES[type_id]
            nbytes = (self._numel(ne) // block) * size
            start = self.data_start + rel
            if start + nbytes > self.size:
                raise c.fail(f"tensor {name!r} ({kind} {list(reversed(ne))}, {nbytes} bytes at data offset {rel}) lies past "
                             f"the end of the file ({self.size - self.data_start} bytes of data)")
            self.tensors.append(GGUFTensorInfo(name, type_id, kind, ne, start, nbytes))
        self._check_overlaps(c)
        self._check_block_count(c)

    def _value(self, c: _Cursor, key: str) -> GGUFField:
        vtype = c.u32(f"key {key!r}'s value type")
        if vtype == STRING:
            return GGUFField(key, vtype, c.string(f"key {key!r}'s value", strict=False))
        if vtype in _SCALARS:
            v = c.scalar(*_SCALARS[vtype], f"key {key!r}'s value")
            return GGUFField(key, vtype, self._bool(c, key, v) if vtype == BOOL else v)
        if vtype != ARRAY:
            raise c.fail(f"key {key!r} has value type {vtype}, not a GGUF type (0-12)")
        etype = c.u32(f"key {key!r}'s array element type")
        count = c.u64(f"key {key!r}'s array length")
        if etype == STRING:
            if count * 8 > c.size - c.pos:  # each string has at least its 8-byte length
                raise c.fail(f"key {key!r}: an array of {count} strings cannot fit in the {c.size - c.pos} bytes left")
            return GGUFField(key, vtype, [c.string(f"key {key!r}'s element {j}", strict=False) for j in range(count)], etype)
        if etype not in _SCALARS:
            what = "arrays of arrays are not supported" if etype == ARRAY else f"element type {etype} is not a GGUF type"
            raise c.fail(f"key {key!r}: {what}")
        size = _SCALARS[etype][1]
        c.need(count * size, f"key {key!r}'s array of {count} elements")
        arr = np.frombuffer(self._map, dtype=_NUMPY[etype], count=count, offset=c.pos).copy()
        c.pos += count * size
        if etype == BOOL and bool((arr > 1).any()):
            raise c.fail(f"key {key!r}: a bool array holds a byte other than 0 or 1")
        return GGUFField(key, vtype, arr, etype)

    @staticmethod
    def _bool(c: _Cursor, key: str, v: int) -> bool:
        if v > 1:
            raise c.fail(f"key {key!r}: a bool holds the byte {v}, not 0 or 1")
        return bool(v)

    def _alignment(self, c: _Cursor) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return DEFAULT_ALIGNMENT
        a = field.value
        if field.type != 4 or a <= 0 or a & (a - 1):
            raise c.fail(f"key 'general.alignment' must be a u32 power of two, got {a!r} (type {field.type})")
        return a

    def _tensor_info(self, c: _Cursor, i: int) -> tuple[str, int, tuple[int, ...], int]:
        name = c.string(f"tensor {i}'s name", limit=MAX_NAME_BYTES)
        if not name:
            raise c.fail(f"tensor {i} has an empty name")
        n_dims = c.u32(f"tensor {name!r}'s dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name!r} has {n_dims} dimensions (expected 1 to {MAX_DIMS})")
        ne = tuple(c.u64(f"tensor {name!r}'s dimension {d}") for d in range(n_dims))
        if 0 in ne:
            raise c.fail(f"tensor {name!r} has an empty dimension ({list(reversed(ne))}): no elements")
        type_id = c.u32(f"tensor {name!r}'s type")
        if type_id not in GGML_TYPES:
            raise c.fail(f"tensor {name!r} has ggml type {type_id}, which is not a known type")
        rel = c.u64(f"tensor {name!r}'s data offset")
        kind, block, size = GGML_TYPES[type_id]
        numel = self._numel(ne)
        if numel > (self.size // size + 1) * block:  # also keeps every product below int64
            raise c.fail(f"tensor {name!r} ({kind} {list(reversed(ne))}) would need more bytes than the file has")
        if ne[0] % block:
            raise c.fail(f"tensor {name!r}: {kind} rows hold whole blocks of {block} elements, but its row has {ne[0]}")
        if rel % self.alignment:
            raise c.fail(f"tensor {name!r}: data offset {rel} is not a multiple of the alignment {self.alignment}")
        return name, type_id, ne, rel

    @staticmethod
    def _numel(ne: tuple[int, ...]) -> int:
        n = 1
        for d in ne:
            n *= d
        return n

    def _check_overlaps(self, c: _Cursor) -> None:
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors if t.nbytes)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise c.fail(f"tensors {first!r} and {second!r} overlap in the data section (bytes "
                             f"{start - self.data_start}..{end - self.data_start})")

    def _check_block_count(self, c: _Cursor) -> None:
        """``<arch>.block_count`` against the block indices of the ``blk.N`` (and T5's ``enc.blk.N`` /
        ``dec.blk.N``) tensors: none may be beyond the count, and each family present must hold every
        block 0..count-1 (but in a file of a split model, which holds some blocks only)."""
        arch = self.fields.get("general.architecture")
        if arch is None or arch.type != STRING or not self.tensors:
            return
        field = self.fields.get(f"{arch.value}.block_count")
        if field is None:
            return
        count = field.value
        if field.type not in (0, 1, 2, 3, 4, 5, 10, 11) or count < 0:
            raise c.fail(f"key {field.name!r} must be a non-negative integer, got {count!r}")
        families: dict[str, set[int]] = {}
        for t in self.tensors:
            if m := _BLOCK_INDEX.match(t.name):
                families.setdefault(m.group(1), set()).add(int(m.group(2)))
        split = self.fields.get("split.count")
        whole = split is None or split.value in (0, 1)
        for family, present in families.items():
            beyond = sorted(i for i in present if i >= count)[:4]
            missing: list[int] = []
            if whole and len(present) != count:  # distinct, in 0..count-1 unless beyond: some block lacks tensors
                missing = [i for i in range(min(count, len(present) + 4)) if i not in present][:4]
            if beyond or missing:
                raise c.fail(f"key {field.name!r} says {count} blocks, but the file's {family}.N tensors are for {len(present)} "
                             f"(missing blocks {missing}, blocks beyond the count {beyond})")

    # -- values ------------------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        """Every key/value as plain Python, in file order."""
        return {k: f.contents() for k, f in self.fields.items()}

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def tensor_bytes(self, t: GGUFTensorInfo) -> np.ndarray:
        """A copy of tensor ``t``'s data bytes (uint8, 1-D)."""
        return np.frombuffer(self._map, dtype=np.uint8, count=t.nbytes, offset=t.offset).copy()

    def tensor_array(self, t: GGUFTensorInfo) -> np.ndarray:
        """Tensor ``t``'s data as gguf-py presents it: the element dtype for F32/F16/F64/I8-I64 in its
        shape, otherwise uint8 with the last dimension in bytes (``quant_shape_to_byte_shape``)."""
        raw = self.tensor_bytes(t)
        dt = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}.get(t.kind)
        if dt is not None:
            return raw.view(dt).reshape(t.shape)
        _, block, size = GGML_TYPES[t.type_id]
        return raw.reshape(*t.shape[:-1], t.shape[-1] // block * size)


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """:class:`GGUFFile` of ``path`` (FileNotFoundError naming it when there is none)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"path: no GGUF file at {str(path)!r}")
    return GGUFFile(path)
