"""Distributed checkpoints (``torch.distributed.checkpoint``) of models with quantized weights.

DCP saves and reshards plain tensors and DTensors; a quantized weight is several tensors in a
layout. :func:`state_dict` therefore lists each quantized weight as its :mod:`row parts
<torchq.distributed.rows>`, each a tensor (whole weight), or a DTensor with the weight's own
placement (FSDP2 and ``ColwiseParallel``: ``Shard(0)``; ``RowwiseParallel``: ``Shard(1)``), plus
a small uint8 tensor holding the format as JSON::

    <name>.torchq.codes        uint8 [N, ceil(K/8)*b] bit-packed codes (b < 8), or the 8-bit codes [N, K]
    <name>.torchq.scale        [N, ceil(K/g)] scales, in their dtype
    <name>.torchq.zero_point   [N, ceil(K/g)] zero points (formats that have them)
    <name>.torchq.input_scale  fp32 [K] / <name>.torchq.input_perm [K]  (weights that have them)
    <name>.torchq.format       uint8 [bytes]: {"spec", "shape", "dtype", "dtypes", "widths"}

so DCP reshards them like any tensor (saved on 2 ranks, loaded on 4). Everything else in the
model's state dict passes through unchanged. To load, build the model the same way (quantized
with the same config, sharded any way), take its :func:`state_dict` as the template, let
``dcp.load`` fill it, and call :func:`load_state_dict`::

    sd = torchq.distributed.checkpoint.state_dict(model)
    dcp.save(sd, checkpoint_id=folder)
    ...
    sd = torchq.distributed.checkpoint.state_dict(other_model)
    dcp.load(sd, checkpoint_id=folder)
    torchq.distributed.checkpoint.load_state_dict(other_model, sd)

:func:`load_quantized_sharded` reads a single-file :func:`torchq.save_quantized` checkpoint into
a sharded model: each rank reads its own rows (or columns) of each weight's parts, never the
whole weight.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn as nn

from ..canonical import QuantSpec
from ..checkpoint.codec import CheckpointError, dtype_from_name, dtype_name
from ..tensor import AQT, check_input_perm, check_input_scale, is_permutation
from .placement import dtensor_types, local_and_placement, set_weight, shard_width
from .rows import RowFormat, from_row_parts, pack_in, row_format, to_row_parts

__all__ = ["state_dict", "load_state_dict", "load_quantized_sharded", "PART_TAG"]

PART_TAG = ".torchq."


def _format_tensor(fmt: RowFormat, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    doc = {"spec": fmt.spec.to_json(), "shape": list(shape), "dtype": dtype_name(dtype),
           "dtypes": [dtype_name(d) for d in fmt.dtypes], "widths": list(fmt.widths)}
    return torch.frombuffer(bytearray(json.dumps(doc, sort_keys=True).encode()), dtype=torch.uint8)


def _format_from_tensor(t: torch.Tensor, name: str) -> tuple[RowFormat, tuple[int, int], torch.dtype]:
    try:
        doc = json.loads(bytes(t.cpu().numpy().tobytes()).decode())
        spec = QuantSpec.from_json(doc["spec"])
        n, k = (int(v) for v in doc["shape"])
        dtype = dtype_from_name(doc["dtype"], f"{name}: dtype")
        dtypes = [dtype_from_name(d, f"{name}: dtypes") for d in doc["dtypes"]]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{name}{PART_TAG}format: not a torchq row-parts format ({e})") from None
    fmt = row_format(spec, k, dtypes[1], dtypes[2] if len(dtypes) > 2 else None, name)
    if list(fmt.dtypes) != dtypes or list(fmt.widths) != list(doc["widths"]):
        raise CheckpointError(f"{name}{PART_TAG}format: parts {doc['dtypes']} {doc['widths']} do not match {spec.describe()}")
    return fmt, (n, k), dtype


def _global_format(name: str, local: AQT, shape: tuple[int, ...]) -> tuple[RowFormat, tuple[int, int]]:
    """The row format and ``[N, K]`` of the whole weight whose piece ``local`` is (``shape``: the
    whole weight's, a DTensor's global shape)."""
    plain = local.to_plain()
    zero_dtype = None if plain.zero_point is None else plain.zero_point.dtype
    n, k = (int(v) for v in shape)
    return row_format(plain.spec, k, plain.scale.dtype, zero_dtype, f"quantized weight {name!r}"), (n, k)


def state_dict(model: nn.Module | dict[str, Any]) -> dict[str, Any]:
    """``model.state_dict()`` (or the given state dict) with every quantized weight replaced by
    its row parts and format tensor (see the module doc), ready for ``dcp.save`` or as the
    template ``dcp.load`` fills (each rank lists its own pieces; no collective)."""
    sd = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    DTensor, Replicate, Shard = dtensor_types()
    out: dict[str, Any] = {}
    for name, value in sd.items():
        local, mesh, placement = local_and_placement(value)
        if local is None:
            out[name] = value
            continue
        if local.transposed:
            raise NotImplementedError(f"torchq: quantized weight {name!r} is transposed; checkpoints hold [N, K] weights")
        fmt, shape = _global_format(name, local, value.shape)
        _, parts = to_row_parts(local.to_plain(), f"quantized weight {name!r}")
        # copies, never the weight's own tensors: dcp.load writes into this dict, and a load must
        # change nothing before load_state_dict has checked it
        parts = tuple(p.clone(memory_format=torch.contiguous_format) for p in parts)
        for pname, part, width in zip(fmt.names, parts, fmt.widths):
            key = f"{name}{PART_TAG}{pname}"
            if placement is None or not placement.is_shard():
                out[key] = part if placement is None else DTensor.from_local(part, mesh, [Replicate()], run_check=False)
                continue
            dim = placement.dim % 2
            gshape = (shape[0], width)
            if dim == 1:
                start, length = shard_width(width, mesh)
                if part.shape[1] != length:
                    raise ValueError(
                        f"torchq: quantized weight {name!r} is sharded along its {shape[1]} input features into pieces whose "
                        f"{pname} ({part.shape[1]} wide here) are not torch.chunk's pieces of the whole ({width} wide): "
                        f"the input features per rank must be a multiple of 8 and of the group size"
                    )
            out[key] = DTensor.from_local(part.contiguous(), mesh, [Shard(dim)], run_check=False, shape=torch.Size(gshape),
                                          stride=(gshape[1], 1))
        for extra in ("input_scale", "input_perm"):
            t = getattr(local, extra)
            if t is not None:
                if placement is not None and placement.is_shard() and placement.dim % 2 == 1:
                    raise NotImplementedError(f"torchq: {extra} of {name!r} with its input features sharded")
                out[f"{name}{PART_TAG}{extra}"] = t.clone()
        out[f"{name}{PART_TAG}format"] = _format_tensor(fmt, shape, local.dtype)
    return out


def load_state_dict(model: nn.Module, state_dict: dict[str, Any]) -> None:
    """Install the quantized weights of ``state_dict`` (a :func:`state_dict` template that
    ``dcp.load`` filled) into ``model``: each rank decodes its own parts and copies them into its
    shard in place (FSDP2's and DTensor's bookkeeping stay valid), or replaces a whole weight.
    The other entries of ``state_dict`` that the model has are loaded with
    ``model.load_state_dict(strict=False)`` (after ``dcp.load`` they already share the model's
    storage: a copy onto itself). Every weight is decoded and checked (codes in range, finite
    scales and zero points) before any is installed."""
    current = model.state_dict()
    staged: list[tuple[str, Any, AQT]] = []
    for name, value in current.items():
        local, mesh, placement = local_and_placement(value)
        if local is None:
            continue
        fkey = f"{name}{PART_TAG}format"
        if fkey not in state_dict:
            raise CheckpointError(f"load_state_dict: quantized weight {name!r} has no {fkey!r} in the state dict")
        fmt, shape, _ = _format_from_tensor(state_dict[fkey], name)
        want, want_shape = _global_format(name, local, value.shape)
        if (want.spec, want.dtypes, want.widths, want_shape) != (fmt.spec, fmt.dtypes, fmt.widths, shape):
            raise CheckpointError(
                f"load_state_dict: quantized weight {name!r}: the checkpoint holds {fmt.spec.describe()} {list(shape)}, "
                f"the model {want.spec.describe()} {list(want_shape)}; quantize the model with the same config first"
            )
        parts = []
        for pname in fmt.names:
            t = state_dict[f"{name}{PART_TAG}{pname}"]
            parts.append(t._local_tensor if hasattr(t, "_local_tensor") else t)
        k_local = local.shape[1]
        local_fmt = fmt if k_local == fmt.k else row_format(fmt.spec, k_local, fmt.dtypes[1], fmt.dtypes[2] if len(fmt.dtypes) > 2 else None)
        # copies: the installed weight must not share memory with the caller's state dict
        plain = from_row_parts(local_fmt, [p.to(local.device, copy=True) for p in parts], f"quantized weight {name!r}")
        extras = {e: state_dict.get(f"{name}{PART_TAG}{e}") for e in ("input_scale", "input_perm")}
        extras = {e: None if t is None else (t._local_tensor if hasattr(t, "_local_tensor") else t).to(local.device, copy=True)
                  for e, t in extras.items()}
        _check_values(name, plain, **extras)
        new = local._replace(pack_in(local.tensor_impl.layout, plain), **extras)
        staged.append((name, value, new))
    for name, value, new in staged:
        if isinstance(value, AQT):
            set_weight(model, name, new)
        else:
            value._local_tensor.copy_(new)
    rest = {k: v for k, v in state_dict.items() if PART_TAG not in k and k in current}
    if rest:
        model.load_state_dict(rest, strict=False)


def _check_values(name: str, plain, input_scale: torch.Tensor | None, input_perm: torch.Tensor | None) -> None:
    """What a file could get wrong that the shapes do not show: non-finite scales or zero points, an
    input scale that is not finite and positive, an input permutation that is not one."""
    where = f"load_state_dict: quantized weight {name!r}"
    if not bool(torch.isfinite(plain.scale).all()):
        raise CheckpointError(f"{where}: scale contains NaN/inf")
    z = plain.zero_point
    if z is not None and z.is_floating_point() and not bool(torch.isfinite(z).all()):
        raise CheckpointError(f"{where}: zero_point contains NaN/inf")
    if input_scale is not None:
        check_input_scale(input_scale, plain.shape[1], input_scale.device)
        if not bool((torch.isfinite(input_scale) & (input_scale > 0)).all()):
            raise CheckpointError(f"{where}: input_scale must be finite and positive")
    if input_perm is not None:
        check_input_perm(input_perm, plain.shape[1], input_perm.device)
        if not is_permutation(input_perm):
            raise CheckpointError(f"{where}: input_perm must be a permutation of 0..{plain.shape[1] - 1}")


def load_quantized_sharded(model: nn.Module, path: str, *, verify: bool = True, strict: bool = True,
                           device: torch.device | str | None = None) -> None:
    """Load a single-file (or one-folder) :func:`torchq.save_quantized` checkpoint into a model
    whose quantized weights are sharded (FSDP2, ``ColwiseParallel``/``RowwiseParallel``) or
    whole. Each rank reads only its own rows or columns of each weight's stored parts from the
    safetensors file (``safe_open(...).get_slice``); with ``verify`` each part's CRC-32 is
    checked by streaming it in 4 MiB pieces, so no rank holds a whole weight. The model must be
    quantized with the checkpoint's formats before it is sharded (on the meta device is fine:
    meta shards are replaced, in ``device``'s best layout (default the CPU; the meta device's
    layout was chosen for no device), real ones are written in place). Float tensors are read the same
    way, each rank its own piece. ``strict``: entries of the model the file lacks (LoRA adapters
    added after saving), or of the file the model lacks, are an error; with ``strict=False`` they
    are left alone. Everything is read and checked before anything is installed."""
    from .sharded_file import load_sharded

    load_sharded(model, path, verify=verify, strict=strict, device=device)
