"""Scatter and broadcast of quantized weights: DTensor's ``distribute_tensor`` (so
``parallelize_module``) with the default ``src_data_rank=0``, or any source rank.

With a ``Shard`` placement, DTensor cuts the source rank's weight with ``torch.chunk``, pads the
pieces to one size (``F.pad``: :mod:`.shard_ops`), scatters them into each rank's
``torch.empty_like`` of its own first piece and cuts the padding off again; with ``Replicate`` it
broadcasts the weight into every rank's copy. On a quantized weight the c10d ops ``scatter_`` and
``broadcast_`` run here, as three collectives on the same process group with tensors on the
weight's device (gloo, NCCL):

1. **header**: the source sends each rank a description of the piece it sends (a fixed-size uint8
   tensor holding JSON: the ``[N, K]`` shape, the format, the scale and zero-point dtypes, the
   float dtype, transposition, activation scheme, compute dtype, input scale and permutation) and
   each rank compares it with the weight it receives into;
2. **verdict**: an all-gather of one flag per rank, so that a mismatch makes every rank raise a
   ValueError (naming the ranks and the differences) rather than one rank raising while the
   others wait for it;
3. **payload**: one uint8 tensor per rank holding the piece's canonical plain form, as
   checkpoints store it: codes bit-packed along rows (:func:`~torchq.canonical.encode_codes`:
   ``b/8`` bytes per code below 8 bits), scales, zero points, the double-quantized scales' parts
   where the piece has them, the ``input_scale`` and ``input_perm``. Each rank unpacks it into its
   buffer's own layout, in place; nothing is dequantized and no float weight is formed.

So each rank ends with bit for bit the piece it would have cut from the source's weight itself,
in that piece's layout, and ranks other than the source need a weight of the right format and
shape only (its values are overwritten: quantizing an uninitialised model is enough).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from ..bitpack import packed_width
from ..canonical import NestedScale, PlainForm, QuantSpec, decode_codes, encode_codes
from ..primitives import scale_shape
from ..tensor import AQT, implements

__all__ = ["describe", "encode", "decode_into", "HEADER_BYTES"]

#: bytes of the header tensor: a sha256 of the description, its length, then the JSON (cut to fit)
HEADER_BYTES = 2048


def _name(w: AQT) -> str:
    return repr(w.label) if w.label else str(tuple(w.shape))


def _dtype_name(d: torch.dtype | None) -> str | None:
    return None if d is None else str(d).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"dtype: expected a torch dtype name, got {name!r}")
    return d


def describe(w: AQT, plain: PlainForm | None = None) -> dict[str, Any]:
    """What a rank must agree on to receive ``w``'s values: a JSON-able dict (no values).
    ``plain``: ``w.to_plain()`` where the caller has it."""
    plain = w.to_plain() if plain is None else plain
    act = w.act_quant
    act_json = None if act is None else (act.to_json() if hasattr(act, "to_json") else repr(act))
    return {
        "shape": list(plain.shape),
        "transposed": bool(w.transposed),
        "dtype": _dtype_name(w.dtype),
        "spec": plain.spec.to_json(),
        "scale_dtype": _dtype_name(plain.scale.dtype),
        "zero_dtype": None if plain.zero_point is None else _dtype_name(plain.zero_point.dtype),
        "act_quant": act_json,
        "compute_dtype": _dtype_name(w.compute_dtype),
        "input_scale": w.input_scale is not None,
        "input_perm": None if w.input_perm is None else _dtype_name(w.input_perm.dtype),
    }


def _parts(desc: dict[str, Any]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of each tensor of the payload, from the description alone."""
    spec = QuantSpec.from_json(desc["spec"])
    n, k = desc["shape"]
    grid = scale_shape((n, k), spec.block_size)
    if spec.bits <= 7:
        out = [("codes", torch.uint8, (n, packed_width(k, spec.bits)))]
    else:
        out = [("codes", spec.code_dtype, (n, k))]
    out.append(("scale", _dtype(desc["scale_dtype"]), grid))
    if desc["zero_dtype"] is not None:
        out.append(("zero_point", _dtype(desc["zero_dtype"]), grid))
    if spec.double_quant:
        count = grid[0] * grid[1]
        out += [("nested.codes", torch.uint8, grid), ("nested.absmax", torch.float32, (-(-count // 256),)),
                ("nested.offset", torch.float32, ())]
    if desc["input_scale"]:
        out.append(("input_scale", torch.float32, (k,)))
    if desc["input_perm"] is not None:
        out.append(("input_perm", _dtype(desc["input_perm"]), (k,)))
    return out


def _nbytes(parts: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> int:
    total = 0
    for _, dtype, shape in parts:
        count = 1
        for s in shape:
            count *= s
        total += count * dtype.itemsize
    return total


def encode(w: AQT) -> torch.Tensor:
    """The payload of ``w``: one contiguous uint8 tensor on ``w``'s device (see the module doc)."""
    plain = w.to_plain()
    codes, _ = encode_codes(plain.codes, plain.spec)
    tensors = [codes, plain.scale]
    if plain.zero_point is not None:
        tensors.append(plain.zero_point)
    if plain.nested is not None:
        tensors += [plain.nested.codes, plain.nested.absmax, plain.nested.offset]
    tensors += [t for t in (w.input_scale, w.input_perm) if t is not None]
    expected = _parts(describe(w, plain))
    for t, (name, dtype, shape) in zip(tensors, expected, strict=True):
        if t.dtype != dtype or tuple(t.shape) != shape:  # a layout whose plain form disagrees with its metadata
            raise RuntimeError(f"torchq: quantized weight {_name(w)}: {name} is {t.dtype} {list(t.shape)}, expected "
                               f"{dtype} {list(shape)}")
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def decode_into(out: AQT, payload: torch.Tensor, where: str, desc: dict[str, Any] | None = None) -> None:
    """Unpack ``payload`` (from :func:`encode` of a weight that :func:`describe` s as ``out``; ``desc``:
    that description, where the caller has it) into ``out``'s own tensors, in place, in ``out``'s
    layout. Codes are checked against the format's range (a ValueError naming ``where``)."""
    desc = describe(out) if desc is None else desc
    parts = _parts(desc)
    if payload.dtype != torch.uint8 or payload.numel() != _nbytes(parts):
        raise ValueError(f"{where}: expected {_nbytes(parts)} bytes, got {payload.dtype} {list(payload.shape)}")
    got: dict[str, torch.Tensor] = {}
    pos = 0
    for name, dtype, shape in parts:
        count = 1
        for s in shape:
            count *= s
        nbytes = count * dtype.itemsize
        got[name] = payload[pos:pos + nbytes].clone().view(dtype).reshape(shape)  # own storage: aligned for its dtype
        pos += nbytes
    spec = QuantSpec.from_json(desc["spec"])
    n, k = desc["shape"]
    codes = decode_codes(got["codes"], spec, k, "bitstream" if spec.bits <= 7 else "bytes", where)
    nested = None
    if spec.double_quant:
        nested = NestedScale(got["nested.codes"], got["nested.absmax"], got["nested.offset"])
    plain = PlainForm(codes, got["scale"], got.get("zero_point"), spec, nested)
    dst = out.tensor_impl
    impl = dst.layout.pack(plain)
    if impl.metadata() != dst.metadata():
        raise RuntimeError(f"{where}: the received weight packs as {impl.metadata()}, the buffer is {dst.metadata()}")
    for name in dst.tensor_names():
        getattr(dst, name).copy_(getattr(impl, name))
    if out.input_scale is not None:
        out.input_scale.copy_(got["input_scale"])
    if out.input_perm is not None:
        out.input_perm.copy_(got["input_perm"])


# -- the header and the verdict -----------------------------------------------------------------------
def _header(desc: dict[str, Any], device: torch.device) -> torch.Tensor:
    text = json.dumps(desc, sort_keys=True).encode()
    body = text[:HEADER_BYTES - 36]
    raw = hashlib.sha256(text).digest() + len(text).to_bytes(4, "little") + body
    return torch.frombuffer(bytearray(raw.ljust(HEADER_BYTES, b"\0")), dtype=torch.uint8).to(device)


def _matches(header: torch.Tensor, desc: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """Whether ``header`` describes ``desc``, and the description it holds (None if cut or unreadable)."""
    raw = bytes(header.cpu().tolist())
    mine = json.dumps(desc, sort_keys=True).encode()
    same = raw[:32] == hashlib.sha256(mine).digest()
    length = int.from_bytes(raw[32:36], "little")
    try:
        theirs = json.loads(raw[36:36 + length]) if length <= HEADER_BYTES - 36 else None
    except ValueError:
        theirs = None
    return same, theirs


def _differences(mine: dict[str, Any], theirs: dict[str, Any] | None, src: int) -> str:
    if theirs is None:
        return "the source's description is too long to show"
    keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    return "; ".join(f"{k}: {theirs.get(k)!r} on rank {src}, {mine.get(k)!r} here" for k in keys)


def _agree(ok: bool, pg_obj: Any, me: int, world: int, src: int, what: str, device: torch.device,
           timeout: int, differences: str) -> None:
    """All-gather every rank's verdict; raise on every rank if any rank's weight differs."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    flags = [torch.empty_like(flag) for _ in range(world)]
    _, work = torch.ops.c10d.allgather_.default([flags], [flag], pg_obj, False, timeout)
    work.wait()
    bad = [r for r, f in enumerate(flags) if int(f.item()) == 0]
    if not bad:
        return
    way_out = ("quantize the model the same way on every rank (the same config, dtype and shapes; the values of ranks "
               "other than the source do not matter, they are overwritten) before parallelize_module / distribute_tensor, "
               "or pass src_data_rank=None so that every rank keeps the weight it holds")
    if not ok:
        raise ValueError(f"torchq: {what} from rank {src}: this rank ({me}) holds a quantized weight of another format "
                         f"than the one rank {src} sends ({differences}); {way_out}")
    raise ValueError(f"torchq: {what} from rank {src}: rank(s) {bad} hold a quantized weight of another format than "
                     f"rank {src}'s (their errors name the differences); {way_out}")


def _process_group(pg_obj: Any) -> tuple[int, int]:
    import torch.distributed as dist

    pg = dist.ProcessGroup.unbox(pg_obj)
    return pg.rank(), pg.size()


# -- the c10d ops ---------------------------------------------------------------------------------------
def _scatter(func, args, kwargs):
    """``c10d.scatter_(output_tensors, input_tensors, process_group, root_rank, async_op, timeout)``
    with quantized weights: the protocol of the module doc. Returns ``([output], work)`` with the
    work already complete."""
    names = ("output_tensors", "input_tensors", "process_group", "root_rank", "async_op", "timeout")
    a = dict(zip(names, args))
    a.update(kwargs)
    outputs, inputs, pg_obj, src = a["output_tensors"], a["input_tensors"], a["process_group"], int(a["root_rank"])
    timeout = int(a.get("timeout", -1))
    me, world = _process_group(pg_obj)
    if len(outputs) != 1 or not isinstance(outputs[0], AQT):
        raise TypeError(f"torchq: scatter of quantized weights: expected one quantized output tensor, got "
                        f"{[type(t).__name__ for t in outputs]}")
    out: AQT = outputs[0]
    what = f"scatter of the quantized weight {_name(out)}"
    if me == src:
        if len(inputs) != 1 or len(inputs[0]) != world or not all(isinstance(t, AQT) for t in inputs[0]):
            raise TypeError(f"torchq: {what}: expected a scatter_list of {world} quantized weights on the source rank, "
                            f"got {[type(t).__name__ for t in (inputs[0] if inputs else [])]}")
        pieces: list[AQT] = list(inputs[0])
        headers = [[_header(describe(t), out.device) for t in pieces]]
    else:
        if inputs and any(len(x) for x in inputs):
            raise ValueError(f"torchq: {what}: a scatter_list is given on rank {me}, which is not the source ({src})")
        headers = []
    desc = describe(out)
    header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=out.device)
    _, work = torch.ops.c10d.scatter_.default([header], headers, pg_obj, src, False, timeout)
    work.wait()
    ok, theirs = _matches(header, desc)
    _agree(ok, pg_obj, me, world, src, what, out.device, timeout, "" if ok else _differences(desc, theirs, src))
    payloads = [[encode(t) for t in pieces]] if me == src else []
    buf = torch.empty(_nbytes(_parts(desc)), dtype=torch.uint8, device=out.device)
    _, work = torch.ops.c10d.scatter_.default([buf], payloads, pg_obj, src, False, timeout)
    work.wait()
    decode_into(out, buf, f"torchq: {what} from rank {src}", desc)
    return [out], work


def _broadcast(func, args, kwargs):
    """``c10d.broadcast_(tensors, process_group, root_rank, root_tensor, async_op, timeout)`` with a
    quantized weight: every rank's weight gets the source's values, in its own layout."""
    names = ("tensors", "process_group", "root_rank", "root_tensor", "async_op", "timeout")
    a = dict(zip(names, args))
    a.update(kwargs)
    tensors, pg_obj, src = a["tensors"], a["process_group"], int(a["root_rank"])
    timeout = int(a.get("timeout", -1))
    if len(tensors) != 1 or not isinstance(tensors[0], AQT) or int(a.get("root_tensor", 0)) != 0:
        raise TypeError(f"torchq: broadcast of quantized weights: expected one quantized tensor, got "
                        f"{[type(t).__name__ for t in tensors]}")
    w: AQT = tensors[0]
    me, world = _process_group(pg_obj)
    what = f"broadcast of the quantized weight {_name(w)}"
    desc = describe(w)
    header = _header(desc, w.device)
    _, work = torch.ops.c10d.broadcast_.default([header], pg_obj, src, 0, False, timeout)
    work.wait()
    ok, theirs = (True, None) if me == src else _matches(header, desc)
    _agree(ok, pg_obj, me, world, src, what, w.device, timeout, "" if ok else _differences(desc, theirs, src))
    buf = encode(w) if me == src else torch.empty(_nbytes(_parts(desc)), dtype=torch.uint8, device=w.device)
    _, work = torch.ops.c10d.broadcast_.default([buf], pg_obj, src, 0, False, timeout)
    work.wait()
    if me != src:
        decode_into(w, buf, f"torchq: {what} from rank {src}", desc)
    return [w], work


def _register() -> None:
    c10d = getattr(torch.ops, "c10d", None)
    try:
        scatter, broadcast = c10d.scatter_.default, c10d.broadcast_.default
    except (AttributeError, RuntimeError):  # torch built without distributed
        return
    implements(scatter)(_scatter)
    implements(broadcast)(_broadcast)


_register()
