"""``save_quantized`` / ``load_quantized``: quantized models as safetensors files.

A file holds plain tensors only. Float entries keep their state-dict name. A quantized weight
``name`` is stored as the parts of its device-independent record (:mod:`torchq.checkpoint.codec`)
under ``name:codes``, ``name:scale`` and ``name:zero_point``.

The safetensors header's ``__metadata__`` holds ``format = "pt"``, the user's metadata, and
``torchq``: canonical JSON ::

    {"format": "torchq.checkpoint", "version": 1, "torchq_version": "...",
     "quantized": {name: record}, "float": {name: {"dtype", "shape", "crc32"}},
     "aliases": {tied_name: stored_name}, "shard": [index, count], "user": {...}}

with ``torchq_crc32``, the CRC-32 of that text. ``"shard": "all"`` marks a header that describes the
whole checkpoint and is repeated in every file, each file holding some of its tensors (the files
transformers' ``save_pretrained`` writes: it shards by itself, with one metadata for all files,
and may put the parts of one weight in different files; see :func:`flatten_model`). Such a
header may also hold ``"renamed": {key: stored_key}``, keys the writer may store under another
name (transformers renames legacy keys back on save); either name is read. Loading checks the header CRC, every tensor's
dtype, shape and CRC, and the codes against their range before changing the model.

A folder checkpoint is either ``model.safetensors`` or, past ``max_shard_size``, shards
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``
(``{"metadata": {...}, "weight_map": {key: file}}``, the layout Hugging Face tools read). All
parts of one weight stay in one shard. Files are written to a temporary name and renamed, and
memory-mapped when read; loading reads one tensor at a time, so a model built on the ``meta``
device never exists in float.
"""

from __future__ import annotations

import contextlib
import os
import re
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from ..hooks import prepare_weights_installed
from ..tensor import AffineQuantizedTensor
from . import codec
from .codec import CheckpointError
from .model_state import BufferInit, Incoming, dedupe, install_checkpoint, model_slots

__all__ = ["save_quantized", "load_quantized", "flatten_model", "FILE_FORMAT", "FILE_VERSION", "INDEX_NAME", "SINGLE_NAME",
           "part_key", "checkpoint_files", "checked_entries", "CheckpointFile", "WholeCheckpoint"]

FILE_FORMAT = "torchq.checkpoint"
FILE_VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_SHARD_SIZE = 5 * 10**9
_PART_SEP = ":"
_RESERVED_META = ("format", "torchq", "torchq_crc32")


def part_key(name: str, part: str) -> str:
    """The file key of part ``part`` of the quantized weight ``name``."""
    return f"{name}{_PART_SEP}{part}"


def parse_size(size: int | str | None) -> int | None:
    """Bytes from an int or a string like ``"500MB"``, ``"2GiB"`` (None stays None)."""
    if size is None or (isinstance(size, int) and not isinstance(size, bool)):
        if size is not None and size <= 0:
            raise ValueError(f"max_shard_size: expected a positive size, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size: expected bytes (int) or a string like '2GB' / '500MiB', got {size!r}")
    unit = m.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = " KMGT".index(unit[0]) if unit[0] in "KMGT" else 0
    value = int(float(m.group(1)) * base**power)
    if value <= 0:
        raise ValueError(f"max_shard_size: expected a positive size, got {size!r}")
    return value


# -- saving --------------------------------------------------------------------------------------
def _named_tensors(obj: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(obj, nn.Module):
        for name, mod in obj.named_modules():
            if type(mod).get_extra_state is not nn.Module.get_extra_state:
                raise TypeError(
                    f"save_quantized: module {name!r} ({type(mod).__name__}) defines get_extra_state; "
                    f"safetensors files hold tensors only (save its extra state separately)"
                )
        return {name: slot.tensor for name, slot in model_slots(obj).items()}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor):
                raise TypeError(f"save_quantized: a state dict must map str to tensors; entry {k!r} is {type(v).__name__}")
        return dict(obj)
    raise TypeError(f"save_quantized: expected an nn.Module or a state dict, got {type(obj).__name__}")


def _entries(named: dict[str, torch.Tensor]):
    """``(name, record or None, {key: cpu tensor}, float part or None, nbytes)`` per unique tensor."""
    unique, aliases = dedupe(named)
    out = []
    for name, t in unique.items():
        if _PART_SEP in name:
            raise ValueError(f"save_quantized: tensor name {name!r} contains {_PART_SEP!r}, which torchq reserves for parts")
        if t.device.type == "meta":
            raise ValueError(f"save_quantized: {name!r} is on the meta device and has no values to save")
        if isinstance(t, AffineQuantizedTensor):
            record, parts = codec.encode(t)
            tensors = {part_key(name, p): v.cpu() for p, v in parts.items()}
            out.append((name, record, tensors, None))
        elif type(t) in (torch.Tensor, nn.Parameter):
            v = codec.own_storage(t.detach().cpu())
            out.append((name, None, {name: v}, codec.part_record(v, True)))
        else:
            raise TypeError(f"save_quantized: {name!r} is a {type(t).__name__}; torchq saves float tensors and torchq quantized tensors")
    return out, aliases


def _header(entries: list, aliases: dict[str, str], shard: list[int] | str, user: dict[str, str]) -> dict:
    from .._version import __version__

    return {
        "format": FILE_FORMAT, "version": FILE_VERSION, "torchq_version": __version__,
        "quantized": {name: rec for name, rec, _, _ in entries if rec is not None},
        "float": {name: part for name, rec, _, part in entries if rec is None},
        "aliases": aliases, "shard": shard, "user": user,
    }


def _file_metadata(header: dict, user: dict[str, str]) -> dict[str, str]:
    text = codec.dumps(header)
    meta = dict(user)
    meta.update({"format": "pt", "torchq": text, "torchq_crc32": str(zlib.crc32(text.encode()))})
    return meta


def _check_unique_keys(entries: list) -> None:
    keys = [k for _, _, tensors, _ in entries for k in tensors]
    if len(set(keys)) != len(keys):
        raise ValueError("save_quantized: two entries produce the same stored key; rename the tensors")


def flatten_model(
    model: nn.Module | Mapping[str, torch.Tensor],
    *,
    exclude: frozenset[str] = frozenset(),
    renames: Callable[[dict[str, torch.Tensor]], Mapping[str, str]] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of ``model`` in the file format of :func:`save_quantized`, for a
    writer that shards by itself and gives every file the same metadata (transformers'
    ``save_pretrained``): plain CPU tensors by stored key, and str -> str safetensors metadata
    whose torchq header describes the whole checkpoint (``"shard": "all"``). ``exclude``: names
    left out. ``renames(tensors)``: the keys the writer will store under another name.
    :func:`load_quantized` reads the files back (one, or shards with an index)."""
    named = {k: v for k, v in _named_tensors(model).items() if k not in exclude}
    entries, aliases = _entries(named)
    _check_unique_keys(entries)
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for _, _, parts, _ in entries:
        for k, v in parts.items():
            ptr = v.untyped_storage().data_ptr()
            # one storage per key: such writers drop keys that share one as ties of each other
            tensors[k] = v.clone() if ptr in storages else v
            storages.add(tensors[k].untyped_storage().data_ptr())
    header = _header(entries, aliases, "all", {})
    renamed = dict(renames(tensors)) if renames is not None else {}
    if renamed:
        header["renamed"] = renamed
    return tensors, _file_metadata(header, {})


def _write_file(path: Path, tensors: dict[str, torch.Tensor], header: dict, user: dict[str, str]) -> None:
    meta = _file_metadata(header, user)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_quantized(
    model: nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    *,
    max_shard_size: int | str | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write ``model`` (or a state dict) as safetensors; returns the files written.

    ``path`` ending in ``.safetensors``: one file. Otherwise a folder: ``model.safetensors``, or
    shards plus ``model.safetensors.index.json`` when the tensors exceed ``max_shard_size``
    (default 5 GB; an int in bytes or a string like ``"2GB"``). ``metadata``: extra str -> str
    header entries. Quantized weights are stored device-independently (see module doc).
    """
    path = Path(path)
    user = dict(metadata or {})
    for k, v in user.items():
        if not isinstance(k, str) or not isinstance(v, str) or k in _RESERVED_META:
            raise ValueError(f"metadata: expected str -> str entries other than {_RESERVED_META}, got {k!r}: {v!r}")
    limit = parse_size(max_shard_size)
    entries, aliases = _entries(_named_tensors(model))
    _check_unique_keys(entries)

    single = path.suffix == ".safetensors"
    if single and limit is not None:
        raise ValueError(f"max_shard_size: a single file ({path.name}) cannot be sharded; pass a folder path")
    limit = limit or DEFAULT_SHARD_SIZE
    shards: list[list[Any]] = [[]]
    size = 0
    for e in entries:
        n = sum(v.numel() * v.element_size() for v in e[2].values())
        if shards[-1] and size + n > limit and not single:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += n

    def header(shard: list, index: int, count: int) -> dict:
        return _header(shard, aliases, [index, count], user)

    if single:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_file(path, {k: v for e in shards[0] for k, v in e[2].items()}, header(shards[0], 1, 1), user)
        return [path]
    path.mkdir(parents=True, exist_ok=True)
    # Files of an earlier checkpoint in this folder are removed only after the new one is complete
    # (the index, written last, is the commit point of a sharded checkpoint).
    stale = {p for p in [path / INDEX_NAME, path / SINGLE_NAME, *path.glob("model-*-of-*.safetensors")] if p.exists()}
    if len(shards) == 1:
        _write_file(path / SINGLE_NAME, {k: v for e in shards[0] for k, v in e[2].items()}, header(shards[0], 1, 1), user)
        _remove(stale - {path / SINGLE_NAME})
        return [path / SINGLE_NAME]
    written = []
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: v for e in shard for k, v in e[2].items()}
        _write_file(path / fname, tensors, header(shard, i, len(shards)), user)
        written.append(path / fname)
        for k, v in tensors.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    meta = {"format": FILE_FORMAT, "version": FILE_VERSION, "total_size": total, "shards": len(shards)}
    meta["crc32"] = zlib.crc32(codec.dumps({"metadata": meta, "weight_map": weight_map}).encode())
    index = path / INDEX_NAME
    tmp = index.with_name(index.name + ".tmp")
    tmp.write_text(codec.dumps({"metadata": meta, "weight_map": weight_map}))
    os.replace(tmp, index)
    _remove(stale - {*written, index})
    return [*written, index]


def _remove(paths: set[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


# -- loading -------------------------------------------------------------------------------------
def checkpoint_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint and, for a sharded one, its weight map."""
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            path = path / INDEX_NAME
        elif (path / SINGLE_NAME).is_file():
            return [path / SINGLE_NAME], None
        else:
            raise CheckpointError(f"{path}: folder has neither {INDEX_NAME} nor {SINGLE_NAME}")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file or folder")
    if path.suffix != ".json":
        return [path], None
    index = codec.loads(_read_text(path), f"{path}")
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"{path}: an index must be a JSON object with a 'weight_map' object")
    meta, weight_map = index.get("metadata"), index["weight_map"]
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{path}: weight_map must map tensor names to file names")
    if isinstance(meta, dict) and meta.get("format") == FILE_FORMAT:
        codec.check_version(meta.get("version"), FILE_VERSION, f"{path}: index format")
        body = {"metadata": {k: v for k, v in meta.items() if k != "crc32"}, "weight_map": weight_map}
        if meta.get("crc32") != zlib.crc32(codec.dumps(body).encode()):
            raise CheckpointError(f"{path}: index is corrupted (crc32 mismatch)")
    files = []
    for fname in sorted(set(weight_map.values())):
        f = path.parent / fname
        if Path(fname).name != fname or not f.is_file():
            raise CheckpointError(f"{path}: shard {fname!r} is missing (or not a file name in the checkpoint folder)")
        files.append(f)
    return files, weight_map


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None


class CheckpointFile:
    """One open safetensors file and its checked torchq header."""

    def __init__(self, path: Path, stack: contextlib.ExitStack) -> None:
        self.path = path
        try:
            self.handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            self.keys = set(self.handle.keys())
            meta = self.handle.metadata() or {}
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        self.whole = False  # the header describes the whole checkpoint, this file holds part of it
        if "torchq" not in meta:  # a plain (float) safetensors file
            self.header: dict = {"quantized": {}, "float": {k: None for k in self.keys}, "aliases": {}, "shard": None}
            self.plain = True
            return
        self.plain = False
        self.text = text = meta["torchq"]
        if str(zlib.crc32(text.encode())) != meta.get("torchq_crc32"):
            raise CheckpointError(f"{path}: torchq header is corrupted (crc32 mismatch)")
        h = codec.loads(text, f"{path}: torchq header")
        if not isinstance(h, dict) or h.get("format") != FILE_FORMAT:
            raise CheckpointError(f"{path}: torchq header has format {h.get('format') if isinstance(h, dict) else h!r}")
        codec.check_version(h.get("version"), FILE_VERSION, f"{path}: checkpoint format")
        for field in ("quantized", "float", "aliases"):
            if not isinstance(h.get(field), dict):
                raise CheckpointError(f"{path}: torchq header field {field!r} must be an object")
        self.header = h
        self.whole = h.get("shard") == "all"
        self.stored = {k: k for k in self.keys}  # key -> the name the file stores it under
        renamed = h.get("renamed", {}) if self.whole else {}
        if not (isinstance(renamed, dict) and all(isinstance(v, str) for v in renamed.values())):
            raise CheckpointError(f"{path}: torchq header field 'renamed' must map keys to stored keys")
        if renamed:
            back = {v: k for k, v in renamed.items()}
            self.stored = {back.get(k, k): k for k in self.keys}
            if len(self.stored) != len(self.keys):
                raise CheckpointError(f"{path}: two stored tensors are the same key under the header's 'renamed'")
        self.expected = expected = {k for k in h["float"]}
        for name, rec in h["quantized"].items():
            parts = rec.get("parts") if isinstance(rec, dict) else None
            if not isinstance(parts, dict):
                raise CheckpointError(f"{path}: quantized tensor {name!r}: record has no parts")
            expected |= {part_key(name, p) for p in parts}
        if expected != self.keys and not (self.whole and set(self.stored) <= expected):
            missing, extra = sorted(expected - self.keys), sorted(self.keys - expected)
            raise CheckpointError(
                f"{path}: tensors do not match the torchq header (missing: {missing[:8]}, unexpected: {extra[:8]})"
            )

    def get(self, key: str) -> torch.Tensor:
        """The tensor, copied out of the memory map: loaded weights never depend on the file (which
        may be rewritten or truncated later) and start 64-byte aligned (tensors inside a
        safetensors file are only element-aligned, and some PyTorch kernels crash on that)."""
        try:
            return self.handle.get_tensor(key).clone()
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{self.path}: cannot read tensor {key!r} ({e})") from None


class WholeCheckpoint:
    """The files of a checkpoint whose header (``"shard": "all"``, the same in every file)
    describes all of them, read as one: each key from the file that holds it."""

    def __init__(self, path: Path, files: list[CheckpointFile]) -> None:
        first = next(f for f in files if f.whole)
        for bad in (f for f in files if not f.whole):
            what = "has no torchq header" if bad.plain else "has a torchq header that describes only itself"
            raise CheckpointError(f"{bad.path}: {what}, but {first.path}'s describes the whole checkpoint")
        self.path, self.plain, self.header = path, False, first.header
        self.keys = {k for f in files for k in f.keys}  # as stored
        self.where: dict[str, CheckpointFile] = {}
        for f in files:
            if f.text != first.text:
                raise CheckpointError(f"{f.path}: its torchq header differs from {first.path}'s (files of different checkpoints)")
            for k in f.stored:
                if k in self.where:
                    raise CheckpointError(f"{f.path}: tensor {k!r} is also stored in {self.where[k].path}")
                self.where[k] = f
        missing = sorted(first.expected - set(self.where))
        if missing:
            raise CheckpointError(f"{path}: tensors the torchq header lists are in no file: {missing[:8]}")

    def get(self, key: str) -> torch.Tensor:
        f = self.where[key]
        return f.get(f.stored[key])


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _float_incoming(f: CheckpointFile | WholeCheckpoint, name: str, part: Any, verify: bool) -> Incoming:
    where = f"{f.path}: tensor {name!r}"
    if f.plain:
        try:
            sl = f.handle.get_slice(name)
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{where}: cannot read its header entry ({e})") from None
        stored = SAFETENSORS_DTYPES.get(dtype)
        return Incoming(name, shape, False, f"float {dtype}", lambda device: f.get(name).to(device), dtype=stored)
    if not isinstance(part, dict) or set(part) != {"dtype", "shape", "crc32"} or not isinstance(part["shape"], list):
        raise CheckpointError(f"{where}: header entry must have dtype, shape and crc32, got {part!r}")
    dtype = codec.dtype_from_name(part["dtype"], where)
    shape = tuple(part["shape"])
    crc = part["crc32"]
    if not (codec.is_int(crc) and 0 <= crc < 2**32):
        raise CheckpointError(f"{where}: header entry needs a crc32 (an int below 2**32), got {crc!r}")

    def load(device: torch.device) -> torch.Tensor:
        t = f.get(name)
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise CheckpointError(f"{where}: stored as {t.dtype} {list(t.shape)}, header says {dtype} {list(shape)}")
        if verify and crc is not None and codec.tensor_crc32(t) != crc:
            raise CheckpointError(f"{where}: data is corrupted (crc32 mismatch)")
        return t.to(device)

    return Incoming(name, shape, False, f"float {dtype}", load, dtype=dtype)


def _quantized_incoming(f: CheckpointFile | WholeCheckpoint, name: str, record: Any, layout: codec.LayoutPolicy, verify: bool) -> Incoming:
    where = f"{f.path}"
    try:
        rec = codec.parse_record(record, name)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None

    def load(device: torch.device) -> torch.Tensor:
        parts = {p: f.get(part_key(name, p)) for p in rec.parts}
        try:
            return codec.decode(rec, parts, name=name, device=device, layout=layout, verify=verify)
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None

    return Incoming(name, codec.logical_shape(rec), True, rec.spec.describe(), load, rec)


def checked_entries(path: Path, stack: contextlib.ExitStack, require_header: str | None = None
                    ) -> tuple[list[tuple[CheckpointFile | WholeCheckpoint, str, str, Any]], dict[str, str]]:
    """The header entries of the checkpoint at ``path`` (a file, a folder or a sharded index), its
    files opened in ``stack``, after every check that needs no tensor bytes: each file against the
    index's ``weight_map`` and its ``shard`` number, no name stored twice, no alias mapped two ways.
    Returns ``(entries, aliases)``: ``(file, kind, name, header entry)`` in file order, ``kind``
    ``"quantized"`` (the entry is the raw record) or ``"float"``. ``require_header``: a file without
    a torchq header is an error, the reason given (a damaged ``"torchq"`` metadata key would
    otherwise make a torchq file read as a plain float one)."""
    files, weight_map = checkpoint_files(path)
    opened: list[CheckpointFile | WholeCheckpoint] = [CheckpointFile(f, stack) for f in files]
    for f in opened:
        if require_header and f.plain:
            raise CheckpointError(f"{f.path}: has no torchq header (no 'torchq' entry in its safetensors metadata), but "
                                  f"{require_header}")
    if weight_map is not None:
        for f in opened:
            if {k for k, v in weight_map.items() if v == f.path.name} != f.keys:
                raise CheckpointError(f"{f.path}: its tensors do not match the index's weight_map for this shard")
    if any(f.whole for f in opened):
        opened = [WholeCheckpoint(path, opened)]
    entries: list[tuple[CheckpointFile | WholeCheckpoint, str, str, Any]] = []
    aliases: dict[str, str] = {}
    owner: dict[str, Path] = {}
    for f in opened:
        h = f.header
        if weight_map is not None and isinstance(f, CheckpointFile):
            if not f.plain and h.get("shard") != [files.index(f.path) + 1, len(files)]:
                raise CheckpointError(f"{f.path}: header says shard {h.get('shard')!r}, index lists {len(files)} shards")
        for kind in ("quantized", "float"):
            for name, entry in h[kind].items():
                _claim(owner, name, f.path)
                entries.append((f, kind, name, entry))
        for alias, target in h["aliases"].items():
            if not isinstance(target, str) or aliases.get(alias, target) != target:
                raise CheckpointError(f"{f.path}: inconsistent alias {alias!r} -> {target!r}")
            aliases[alias] = target
    if weight_map is not None and set(weight_map) != {k for f in opened for k in f.keys}:
        raise CheckpointError(f"{path}: index weight_map does not match the shards' tensors")
    return entries, aliases


def open_checkpoint(path: Path, stack: contextlib.ExitStack, layout: codec.LayoutPolicy = "saved",
                    verify: bool = True, require_header: str | None = None) -> tuple[dict[str, Incoming], dict[str, str]]:
    """The checkpoint at ``path`` (a file, a folder or a sharded index; torchq's or a plain float
    safetensors checkpoint), its files opened in ``stack`` and checked (:func:`checked_entries`):
    ``(incoming, aliases)``, each :class:`Incoming` reading, checking and decoding its tensor only
    when loaded."""
    entries, aliases = checked_entries(path, stack, require_header)
    incoming = {name: _quantized_incoming(f, name, entry, layout, verify) if kind == "quantized"
                else _float_incoming(f, name, entry, verify) for f, kind, name, entry in entries}
    return incoming, aliases


def load_quantized(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    strict: bool = True,
    layout: codec.LayoutPolicy = "saved",
    verify: bool = True,
    init_buffers: BufferInit = None,
) -> nn.Module:
    """Load a checkpoint written by :func:`save_quantized` into ``model``; returns ``model``.

    ``model`` may be built on the ``meta`` device (nothing float is ever materialized), be a
    float model (quantized entries replace its float weights: the model becomes quantized), or
    be already quantized (entries are replaced by the checkpoint's). ``device``: where loaded
    tensors go (default: each entry's current device, CPU for meta entries). ``layout``:
    ``"saved"`` keeps each weight's saved layout when it can live on the device, else the
    device's best; ``"auto"`` always takes the device's best; a Layout forces one.
    ``strict``: missing or unexpected entries are an error (else a ``LoadWarning``).
    ``verify``: check CRCs (the JSON header is always checked). On any error the model is
    left unchanged and a :class:`CheckpointError` names the tensor, file and problem.
    ``init_buffers``: how to compute non-persistent buffers a ``meta`` model still has on meta
    (no checkpoint holds them: rotary ``inv_freq``, ``position_ids``): ``"auto"`` calls the
    enclosing transformers model's ``_init_weights`` on each owning module, a function(module)
    is called instead; they are created on ``device`` (default CPU) first. None (default): they
    stay on meta with a :class:`LoadWarning`. See :func:`init_meta_buffers`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not (isinstance(layout, codec.Layout) or layout in ("saved", "auto")):
        raise ValueError(f"layout: expected 'saved', 'auto' or a torchq Layout, got {layout!r}")
    if device is not None:
        device = torch.device(device)
    if not (init_buffers is None or init_buffers == "auto" or callable(init_buffers)):
        raise TypeError(f"init_buffers: expected None, 'auto' or a function(module), got {init_buffers!r}")
    path = Path(path)
    with contextlib.ExitStack() as stack:
        incoming, aliases = open_checkpoint(path, stack, layout, verify)
        install_checkpoint(model, incoming, aliases, device=device, strict=strict, source=str(path),
                           init_buffers=init_buffers)
    attach = prepare_weights_installed(model, needs_weights=True)  # so that save_pretrained writes the torchq weights
    if attach is not None:
        attach()
    return model


def _claim(owner: dict[str, Path], name: str, path: Path) -> None:
    if name in owner:
        raise CheckpointError(f"{path}: tensor {name!r} is also stored in {owner[name]}")
    owner[name] = path

