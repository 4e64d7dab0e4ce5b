"""Read a :func:`torchq.save_quantized` safetensors checkpoint into a sharded model, each rank
reading only its own piece of each tensor (see
:func:`torchq.distributed.checkpoint.load_quantized_sharded`)."""

from __future__ import annotations

import contextlib
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..blockwise.nested import NESTED_BLOCKSIZE, double_dequantize
from ..canonical import PlainForm, decode_codes
from ..checkpoint import codec
from ..checkpoint.codec import CheckpointError
from ..checkpoint.safetensors_io import SAFETENSORS_DTYPES, CheckpointFile, WholeCheckpoint, checkpoint_files, part_key
from ..layouts.base import choose_layout
from ..primitives import scale_shape
from .placement import dtensor_types, local_and_placement, set_weight, shard_width
from .rows import pack_in

CRC_CHUNK_BYTES = 4 << 20

__all__ = ["SliceReader", "load_sharded", "CRC_CHUNK_BYTES"]


class SliceReader:
    """Slices of the stored tensors of one checkpoint (one file, or the files of a whole one)."""

    def __init__(self, opened: CheckpointFile | WholeCheckpoint) -> None:
        self.opened = opened

    def _slice(self, key: str):
        f = self.opened
        if isinstance(f, WholeCheckpoint):
            f = f.where[key]
        return f.handle.get_slice(f.stored[key])

    def read(self, key: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        sl = self._slice(key)
        shape = sl.get_shape()
        index: list[slice] = []
        if len(shape) >= 1:
            index.append(slice(*rows) if rows is not None else slice(None))
        if len(shape) >= 2:
            index.append(slice(*cols) if cols is not None else slice(None))
        t = sl[tuple(index)] if index else self.opened.get(key)
        return t.clone().contiguous()

    def stored(self, key: str) -> tuple[torch.dtype | None, tuple[int, ...]]:
        """The stored tensor's dtype (None for one torch has no dtype for) and shape, from the file's
        header (no bytes read)."""
        sl = self._slice(key)
        return SAFETENSORS_DTYPES.get(sl.get_dtype()), tuple(sl.get_shape())

    def crc32(self, key: str) -> int:
        """CRC-32 of the stored tensor's bytes, read ``CRC_CHUNK_BYTES`` at a time."""
        sl = self._slice(key)
        shape = sl.get_shape()
        if not shape:
            return codec.tensor_crc32(self.read(key))
        total = shape[0]
        row_bytes = max(1, _itemsize(sl.get_dtype()) * int(torch.Size(shape[1:]).numel()))
        step = max(1, CRC_CHUNK_BYTES // row_bytes)
        crc = 0
        for start in range(0, total, step):
            piece = sl[start:min(total, start + step)]
            crc = zlib.crc32(piece.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
        return crc


def _itemsize(name: str) -> int:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}.get(name, 1)


def load_sharded(model: nn.Module, path: str, *, verify: bool = True, strict: bool = True,
                 device: torch.device | str | None = None) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    path = Path(path)
    device = torch.device("cpu" if device is None else device)
    with contextlib.ExitStack() as stack:
        files, weight_map = checkpoint_files(path)
        opened: list[CheckpointFile | WholeCheckpoint] = [CheckpointFile(f, stack) for f in files]
        if any(f.whole for f in opened):
            opened = [WholeCheckpoint(path, opened)]
        sources: dict[str, tuple[SliceReader, Any, bool]] = {}
        for f in opened:
            if f.plain:
                raise CheckpointError(f"{f.path}: not a torchq checkpoint (no torchq header)")
            for name, rec in f.header["quantized"].items():
                sources[name] = (SliceReader(f), rec, True)
            for name, part in f.header["float"].items():
                sources[name] = (SliceReader(f), part, False)
            for alias in f.header["aliases"]:
                sources[alias] = None  # type: ignore[assignment]  # tied: loaded under its target's name
        current = model.state_dict()
        staged: list[tuple[str, Any, torch.Tensor]] = []
        missing = [n for n in current if n not in sources]
        if missing and strict:
            raise CheckpointError(f"{path}: the checkpoint has no entry for {missing[:8]} (strict=False leaves them)")
        unexpected = [n for n in sources if n not in current and sources[n] is not None]
        if unexpected and strict:
            raise CheckpointError(f"{path}: the model has no {unexpected[:8]} (strict=False skips them)")
        for name, value in current.items():
            src = sources.get(name)
            if src is None:  # an alias of a tensor loaded under its own name (tied weights)
                continue
            reader, rec, quantized = src
            if quantized:
                staged.append((name, value, _load_quantized(reader, name, rec, value, verify, path, device)))
            else:
                staged.append((name, value, _load_float(reader, name, rec, value, verify, path, device)))
    DTensor, _, _ = dtensor_types()
    assign: dict[str, Any] = {}
    for name, value, new in staged:
        if isinstance(value, DTensor):
            if value._local_tensor.is_meta or type(value._local_tensor) is not type(new):
                assign[name] = DTensor.from_local(new, value.device_mesh, value.placements, run_check=False,
                                                  shape=value.shape, stride=value.stride())
            else:
                value._local_tensor.copy_(new)
        elif isinstance(new, torch.Tensor) and type(new) is not torch.Tensor:
            set_weight(model, name, new)
        elif value.is_meta:
            assign[name] = new
        else:
            value.copy_(new)
    if assign:
        model.load_state_dict(assign, strict=False, assign=True)


def _piece(value: Any, shape: tuple[int, ...], name: str) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """This rank's row and column ranges of a tensor of global ``shape`` held as ``value``."""
    DTensor, Replicate, Shard = dtensor_types()
    if not isinstance(value, DTensor):
        return None, None
    if len(value.placements) != 1:
        raise NotImplementedError(f"torchq: {name!r} on a {len(value.placements)}-D mesh: 1-D meshes only")
    p = value.placements[0]
    if isinstance(p, Replicate):
        return None, None
    if not isinstance(p, Shard):
        raise NotImplementedError(f"torchq: {name!r} with placement {p}")
    dim = p.dim % len(shape)
    start, length = shard_width(shape[dim], value.device_mesh)
    rng = (start, start + length)
    return (rng, None) if dim == 0 else (None, rng)


def _load_float(reader: SliceReader, name: str, part: Any, value: Any, verify: bool, path: Path, device: torch.device) -> torch.Tensor:
    where = f"{path}: tensor {name!r}"
    if not isinstance(part, dict) or set(part) != {"dtype", "shape", "crc32"}:
        raise CheckpointError(f"{where}: header entry must have dtype, shape and crc32, got {part!r}")
    shape = tuple(part["shape"])
    if tuple(value.shape) != shape:
        raise CheckpointError(f"{where}: the checkpoint holds shape {list(shape)}, the model {list(value.shape)}")
    if verify and reader.crc32(name) != part["crc32"]:
        raise CheckpointError(f"{where}: data is corrupted (crc32 mismatch)")
    rows, cols = _piece(value, shape, name)
    t = reader.read(name, rows, cols)
    return t.to(device=value.device if not value.is_meta else device, dtype=value.dtype)


def _load_quantized(reader: SliceReader, name: str, record: Any, value: Any, verify: bool, path: Path, device: torch.device):
    where = f"{path}: quantized tensor {name!r}"
    try:
        rec = codec.parse_record(record, name)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    local, mesh, placement = local_and_placement(value)
    if local is None:
        raise CheckpointError(
            f"{where}: the model's {name!r} is a float {type(value).__name__}; quantize the model (the meta device "
            f"will do) with the checkpoint's config before sharding it, so each rank has a shard to fill"
        )
    if rec.transposed or local.transposed:
        raise NotImplementedError(f"{where}: transposed weights")
    if tuple(value.shape) != tuple(rec.shape):
        raise CheckpointError(f"{where}: the checkpoint holds shape {list(rec.shape)}, the model {list(value.shape)}")
    spec = rec.spec
    n, k = rec.shape
    rows, cols = _piece(value, (n, k), name)
    r0, r1 = rows if rows is not None else (0, n)
    c0, c1 = cols if cols is not None else (0, k)
    g = spec.block_size[1]
    spans = cols is not None and g >= k and (c0, c1) != (0, k)  # one block per row: any columns keep the row's scale
    if cols is not None and ((not spans and (c0 % g or (c1 % g and c1 != k))) or (rec.encoding == "bitstream" and c0 % 8)):
        raise CheckpointError(f"{where}: this rank's input features [{c0}, {c1}) cut a group of {g} or a byte of packed "
                              f"codes; shard it with a world size that splits the input features at multiples of "
                              f"{g if not spans else 8}")
    if verify:
        for p, (_, _, crc) in rec.parts.items():
            if reader.crc32(part_key(name, p)) != crc:
                raise CheckpointError(f"{where}: part {p!r} is corrupted (crc32 mismatch)")
    bits = spec.bits
    if rec.encoding == "bitstream":
        byte_cols = (c0 * bits // 8, -(-c1 // 8) * bits) if cols is not None else None
    else:
        byte_cols = cols
    stored_codes = reader.read(part_key(name, "codes"), (r0, r1), byte_cols)
    codes = decode_codes(stored_codes, spec, c1 - c0, rec.encoding, where)
    grid = scale_shape((n, k), spec.block_size)
    gcols = (0, 1 if c1 > c0 else 0) if spans else (c0 // g, -(-c1 // g))
    if spec.double_quant:  # the rows' scale codes and the nested blocks they fall in
        sc = reader.read(part_key(name, "scale_codes"), (r0, r1))
        first, last = r0 * grid[1], r1 * grid[1]
        b0, b1 = first // NESTED_BLOCKSIZE, -(-last // NESTED_BLOCKSIZE)
        absmax = reader.read(part_key(name, "scale_absmax"), (b0, b1))
        offset = reader.read(part_key(name, "scale_offset"))
        lead = first - b0 * NESTED_BLOCKSIZE
        flat = torch.cat([torch.zeros(lead, dtype=torch.uint8), sc.reshape(-1)])
        scale = double_dequantize(flat, absmax, offset)[lead:].reshape(r1 - r0, grid[1])[:, gcols[0]:gcols[1]].contiguous()
        spec = type(spec)(spec.block_size, spec.quant_min, spec.quant_max, spec.zero_point_domain, spec.codebook, False)
    else:
        scale = reader.read(part_key(name, "scale"), (r0, r1), gcols)
    zero = reader.read(part_key(name, "zero_point"), (r0, r1), gcols) if "zero_point" in rec.parts else None
    if not bool(torch.isfinite(scale).all()) or (zero is not None and zero.is_floating_point() and not bool(torch.isfinite(zero).all())):
        raise CheckpointError(f"{where}: scales or zero points contain NaN/inf")
    if spans:  # as PlainForm.narrow cuts it: the block is the piece's width
        spec = type(spec)((spec.block_size[0], max(c1 - c0, 1)), spec.quant_min, spec.quant_max, spec.zero_point_domain,
                          spec.codebook, spec.double_quant)
    extras = {e: reader.read(part_key(name, e)) for e in ("input_scale", "input_perm") if e in rec.parts}
    if cols is not None and extras:
        raise NotImplementedError(f"{where}: input_scale/input_perm with the input features sharded")
    try:
        plain = PlainForm(codes.contiguous(), scale, zero, spec)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from e
    if local.tensor_impl.spec.double_quant and placement is None:  # a whole weight keeps its nested scales
        plain = PlainForm(plain.codes, plain.scale, plain.zero_point, local.tensor_impl.spec,
                          _nested_of(reader, name)) if rec.spec.double_quant else plain
    if local.is_meta:  # meta's layout was chosen for no device: the device's best one
        plain = plain.map(lambda t: t.to(device))
        impl = choose_layout(plain.spec, plain.shape, plain.scale.dtype, device).pack(plain)
    else:
        impl = pack_in(local.tensor_impl.layout, plain.map(lambda t: t.to(local.device)))
    return local._replace(impl, dtype=rec.dtype, input_scale=extras.get("input_scale"), input_perm=extras.get("input_perm"))


def _nested_of(reader: SliceReader, name: str):
    from ..canonical import NestedScale

    return NestedScale(*(reader.read(part_key(name, f"scale_{p}")) for p in ("codes", "absmax", "offset")))
