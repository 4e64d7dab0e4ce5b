"""bitsandbytes 4-bit state dicts <-> torchq NF4/FP4 weights, losslessly.

bitsandbytes stores a 4-bit weight ``<name>`` (``Linear4bit.weight``) as these state-dict entries:

* ``<name>``: the packed nibbles, uint8 ``[(numel + 1) // 2, 1]`` (another ``quant_storage``
  dtype views the same bytes);
* ``<name>.absmax``: fp32 ``[blocks]``; with double quantization, uint8 codes of
  ``absmax - offset`` instead;
* ``<name>.quant_map``: the fp32 ``[16]`` codebook;
* with double quantization, ``<name>.nested_absmax`` (fp32 ``[ceil(blocks / 256)]``) and
  ``<name>.nested_quant_map`` (the fp32 ``[256]`` dynamic map);
* ``<name>.quant_state.bitsandbytes__nf4`` (or ``__fp4``): uint8 bytes of UTF-8 JSON with
  ``quant_type``, ``blocksize``, ``dtype``, ``shape`` and, if nested, ``nested_blocksize``,
  ``nested_dtype``, ``nested_offset``.

:func:`from_bitsandbytes` turns each such group into one torchq weight in
``Blockwise4bitLayout`` (the same bytes); :func:`to_bitsandbytes` writes the groups back.
torchq holds weights whose ``in_features`` is a multiple of the block size (its blocks are row
groups); others raise a clear error.

A group can also be used directly with ``torch.ops.torchq.gemm_4bit`` (bitsandbytes' schema):
``B = <name>``, ``shapeB = shape``, and either ``absmax = <name>.absmax`` or, nested,
``absmax = <name>.nested_absmax``, ``absmax_8bit = <name>.absmax``,
``absmax_code = <name>.nested_quant_map``, ``absmax_offset = tensor(nested_offset)``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from ..bitpack import pack_bits, unpack_bits
from ..blockwise.codebooks import codebook, dynamic_map
from ..blockwise.nested import NESTED_BLOCKSIZE
from ..canonical import NestedScale, PlainForm, QuantSpec
from ..checkpoint.codec import CheckpointError
from ..configs import NF4WeightOnlyConfig
from ..primitives import ZeroPointDomain
from ..tensor import AffineQuantizedTensor

__all__ = ["from_bitsandbytes", "to_bitsandbytes"]

_STATE = ".quant_state.bitsandbytes__"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _json_tensor(t: torch.Tensor, key: str) -> dict:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise CheckpointError(f"{key}: expected a 1-D uint8 tensor of UTF-8 JSON")
    try:
        data = json.loads(bytes(t.tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{key}: not UTF-8 JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{key}: expected a JSON object, got {type(data).__name__}")
    return data


def _weight_from_group(sd: Mapping[str, torch.Tensor], name: str, state_key: str, used: set[str]) -> AffineQuantizedTensor:
    meta = _json_tensor(sd[state_key], state_key)
    where = f"bitsandbytes weight {name!r}"
    try:
        qt, block, dtype_name, shape = meta["quant_type"], meta["blocksize"], meta["dtype"], meta["shape"]
    except KeyError as e:
        raise CheckpointError(f"{where}: quant state misses {e.args[0]!r}") from None
    if qt not in ("nf4", "fp4") or state_key[-3:] != qt:
        raise CheckpointError(f"{where}: quant_type {qt!r} does not match its key {state_key!r}")
    if dtype_name not in _DTYPES:
        raise CheckpointError(f"{where}: dtype {dtype_name!r} is not fp32/bf16/fp16")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) and s > 0 for s in shape)):
        raise CheckpointError(f"{where}: shape must be [out_features, in_features], got {shape!r}")
    n, k = shape
    cfg_block = block if isinstance(block, int) else -1
    if k % max(cfg_block, 1) or cfg_block < 32:
        raise CheckpointError(f"{where}: in_features {k} is not a multiple of blocksize {block}; torchq cannot hold it")
    nested = "nested_offset" in meta
    keys = {"": name, "absmax": f"{name}.absmax", "quant_map": f"{name}.quant_map"}
    if nested:
        keys.update(nested_absmax=f"{name}.nested_absmax", nested_quant_map=f"{name}.nested_quant_map")
    missing = [key for key in keys.values() if key not in sd]
    if missing:
        raise CheckpointError(f"{where}: missing entries {missing}")
    used.update(keys.values())
    used.add(state_key)
    if not torch.equal(sd[keys["quant_map"]].float().cpu(), codebook(qt)):
        raise CheckpointError(f"{where}: quant_map is not the standard {qt} codebook (custom maps are not supported)")
    packed = sd[name].reshape(-1)
    packed = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    if packed.numel() != n * k // 2:
        raise CheckpointError(f"{where}: expected {n * k // 2} packed bytes for shape {shape}, got {packed.numel()}")
    codes = unpack_bits(packed.reshape(n, k // 2), 4, k).contiguous()
    grid = (n, k // block)
    if nested:
        if meta.get("nested_blocksize") != NESTED_BLOCKSIZE or meta.get("nested_dtype") != "float32":
            raise CheckpointError(f"{where}: nested statistics must be fp32 in blocks of 256, got {meta}")
        if not torch.equal(sd[keys["nested_quant_map"]].float().cpu(), dynamic_map()):
            raise CheckpointError(f"{where}: nested_quant_map is not the signed 8-bit dynamic map")
        qcodes = sd[keys["absmax"]]
        if qcodes.dtype != torch.uint8 or qcodes.numel() != grid[0] * grid[1]:
            raise CheckpointError(f"{where}: nested absmax codes must be uint8 with {grid[0] * grid[1]} entries")
        nq = NestedScale(qcodes.reshape(grid), sd[keys["nested_absmax"]].float(),
                         torch.tensor(float(meta["nested_offset"]), dtype=torch.float32, device=qcodes.device))
        scale = nq.dequantize()
    else:
        nq = None
        scale = sd[keys["absmax"]]
        if scale.dtype != torch.float32 or scale.numel() != grid[0] * grid[1]:
            raise CheckpointError(f"{where}: absmax must be fp32 with {grid[0] * grid[1]} entries")
        scale = scale.reshape(grid)
    spec = QuantSpec((1, block), 0, 15, ZeroPointDomain.NONE, codebook=qt, double_quant=nested)
    try:
        plain = PlainForm(codes, scale, None, spec, nq)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    label = name.removesuffix(".weight") or name
    config = NF4WeightOnlyConfig(block_size=block, double_quant=nested, quant_type=qt)
    return AffineQuantizedTensor.from_plain(plain, _DTYPES[dtype_name], label=label, config=config)


def from_bitsandbytes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with every bitsandbytes 4-bit weight group replaced by one torchq weight
    (same name, same bytes); other entries are passed through. Load it with
    ``model.load_state_dict(sd, assign=True)`` or save it with ``torchq.save_quantized``."""
    groups = {k[: k.index(_STATE)]: k for k in state_dict if _STATE in k}
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    weights = {name: _weight_from_group(state_dict, name, key, used) for name, key in groups.items()}
    for key, value in state_dict.items():
        if key in weights:
            out[key] = weights[key]
        elif key not in used:
            out[key] = value
    return out


def to_bitsandbytes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`from_bitsandbytes`: torchq NF4/FP4 weights become bitsandbytes
    4-bit groups (readable by ``bitsandbytes.nn.Linear4bit``); other entries pass through.
    Other quantized formats raise (bitsandbytes has no equivalent)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state_dict.items():
        if not isinstance(w, AffineQuantizedTensor):
            out[name] = w
            continue
        try:
            plain = w.to_plain_codes()
        except ValueError as e:
            raise ValueError(f"to_bitsandbytes: {name!r}: {e}") from None
        spec = plain.spec
        if spec.codebook not in ("nf4", "fp4") or w.transposed or spec.block_size[0] != 1:
            raise ValueError(f"to_bitsandbytes: {name!r} is {spec.describe()}; only NF4/FP4 weights have a bitsandbytes form")
        n, k = plain.shape
        c = plain.codes
        packed = pack_bits(c, 4).reshape(-1, 1).contiguous()
        meta = {"quant_type": spec.codebook, "blocksize": spec.block_size[1], "dtype": str(w.dtype).removeprefix("torch."),
                "shape": [n, k]}
        out[name] = packed
        if plain.nested is not None:
            nq = plain.nested
            out[f"{name}.absmax"] = nq.codes.reshape(-1).contiguous()
            out[f"{name}.quant_map"] = codebook(spec.codebook).to(c.device)
            out[f"{name}.nested_absmax"] = nq.absmax.contiguous()
            out[f"{name}.nested_quant_map"] = dynamic_map().to(c.device)
            meta.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32", nested_offset=float(nq.offset))
        else:
            out[f"{name}.absmax"] = plain.scale.reshape(-1).contiguous()
            out[f"{name}.quant_map"] = codebook(spec.codebook).to(c.device)
        text = json.dumps(meta).encode("utf-8")
        out[f"{name}{_STATE}{spec.codebook}"] = torch.tensor(list(text), dtype=torch.uint8)
    return out
