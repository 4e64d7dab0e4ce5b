"""compressed-tensors (llm-compressor) integer checkpoints <-> torchq weights, losslessly.

A compressed-tensors checkpoint is a safetensors state dict plus ``config.json``'s
``quantization_config`` (``quant_method: "compressed-tensors"``). Its ``config_groups`` map names
to schemes ``{targets, weights, input_activations, output_activations, format}``; a module is
quantized by the scheme whose targets match its name (``"re:<regex>"`` as ``re.match`` would, by
:mod:`torchq.patterns`' linear-time matcher, which refuses backreferences and lookaround; or the
exact name) or its class (``"Linear"``), unless ``ignore`` matches it. ``weights`` holds
``num_bits``, ``type`` (``"int"`` here), ``symmetric``, ``strategy`` (``tensor`` / ``channel`` /
``group`` / ``block``), ``group_size``, ``block_structure`` and ``actorder``.

The bytes of an integer weight ``[N, K]`` of ``b`` bits (``qmin = -2^(b-1)``, ``qmax = 2^(b-1) - 1``),
for a module ``<m>``:

* ``pack-quantized``: ``<m>.weight_packed`` int32 ``[N, ceil(K·b / 32)]``: each row is one dense
  little-endian bit stream of the codes ``q + 2^(b-1)`` (unsigned ``b``-bit), code ``i`` at bits
  ``[i·b, i·b + b)``, word ``w`` holding bits ``[32w, 32w + 32)`` LSB first, zero padding at the end;
  ``<m>.weight_shape`` int64 ``[2]`` = ``[N, K]``;
* ``int-quantized`` / ``naive-quantized``: ``<m>.weight`` int8 ``[N, K]``, the codes themselves;
* ``<m>.weight_scale``: the model's float dtype (fp32 / bf16 / fp16), shaped ``[1]`` (tensor),
  ``[N, 1]`` (channel), ``[N, K / group_size]`` (group) or ``[ceil(N / bh), ceil(K / bw)]`` (block);
* ``<m>.weight_zero_point`` (asymmetric schemes only): int8 codes of the scale's shape; in
  ``pack-quantized`` group/channel schemes packed like the codes but along dim 0 (each column of
  the ``[N, G]`` zero points is a bit stream): int32 ``[ceil(N·b / 32), G]``;
* ``<m>.weight_g_idx`` (legacy ``actorder: "group"``, compressed-tensors < 0.20; 0.20 refuses
  such configs): int32 ``[K]``, the group of each input column (``-1`` everywhere: unset).

compressed-tensors dequantizes in the scale's dtype: ``(q.to(s.dtype) - z.to(s.dtype)) * s`` per
element (``q * s`` when symmetric), the group of column ``c`` being ``c // group_size`` (or
``g_idx[c]``). As torchq plain forms: codes int8 ``[qmin, qmax]``, the scale as is, block
``(1, group_size)`` / ``(1, K)`` / ``(N, K)`` / ``(bh, bw)``, zero-point domain NONE (symmetric)
or INT with the int8 zero points. torchq computes ``(q - z)`` exactly in int32 and multiplies in
the scale's dtype; ``q - z`` is an integer of magnitude <= 255, exact in fp32, bf16 and fp16, and
both sides then round the one product once, so every dequantized value is bit for bit
compressed-tensors' own (``aqt.dequantize(scale dtype)``; in another dtype, that value cast once).

Activation order: with ``actorder: "weight"`` (GPTQ's static groups) the checkpoint is the plain
grouped one. A legacy ``weight_g_idx`` that is ``c // group_size`` (or all ``-1``) imports to plain
contiguous groups. Any other ``g_idx`` must put exactly ``group_size`` columns in each group (GPTQ's
``(i // group_size)[invperm]``; compressed-tensors < 0.20 decoded it by sorting the columns by
group, which is only meaningful then): it imports as the codes with their columns sorted by group
(stable), so groups are contiguous, plus ``input_perm`` = that order
(:attr:`~torchq.AffineQuantizedTensor.input_perm`: a linear computes ``x[..., input_perm] @ codes^T``).

Activation quantization (``input_activations``, ``output_activations``, ``kv_cache_scheme``, e.g.
``int-quantized`` W8A8) is not carried over: ``activations="ignore"`` (default) imports the weights
exactly and drops the static activation scales (linears then run on unquantized activations, as
compressed-tensors' own dequantizing loader does); ``activations="error"`` refuses such configs.

FP8 (``float-quantized``, llm-compressor's ``FP8`` / ``FP8_DYNAMIC`` / ``FP8_BLOCK`` schemes: ``type:
"float"``, 8 bits): ``<m>.weight`` float8_e4m3fn ``[N, K]`` and ``<m>.weight_scale`` shaped as above
(any float dtype). compressed-tensors dequantizes ``weight.to(s.dtype) * s``: a 4-bit significand
times a bf16/fp16/fp32 scale is exact in fp32, so torchq's ``e4m3fn`` plain form (the weight's own
bytes, the scale in fp32) dequantizes bit for bit to the same values. Per-channel and per-tensor
weights load into :class:`~torchq.layouts.Float8Layout`; dynamic float8 activations per token or
per tensor (``input_activations: {type: float, num_bits: 8, dynamic: true}``) are carried over
as :class:`~torchq.activation.Float8Activations` (torchq's own scale rule at run time); static
activation scales follow ``activations`` as for integer schemes. Block / group FP8 weights import
into the plain layout (dequantized per call, warned).

Not importable (a ValueError says so): FP4 weights (NVFP4, MXFP4), ``tensor_group``,
transforms, sparsity, 3-D (fused MoE) weights, group sizes that do not divide ``in_features``.
:func:`to_compressed_tensors` writes torchq weights whose zero point is an integer (symmetric, or
ZeroPointDomain.INT) back; FLOAT zero points (torchq's default int4), codebooks (NF4) and AWQ's
``input_scale`` have no compressed-tensors form. The conversions need only torch; reading files
needs ``safetensors``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..activation import Float8Activations
from ..canonical import FLOAT8_CODEBOOK, PlainForm, QuantSpec
from ..checkpoint.codec import CheckpointError
from ..checkpoint.model_state import BufferInit, Incoming, install_checkpoint
from ..checkpoint.safetensors_io import SAFETENSORS_DTYPES
from ..float8 import FLOAT8_DTYPE
from ..hooks import prepare_weights_installed
from ..patterns import SafePattern, check_total_states, compile_pattern
from ..primitives import ZeroPointDomain
from ..tensor import AffineQuantizedTensor

__all__ = [
    "QUANT_METHOD",
    "pack_int32",
    "unpack_int32",
    "from_compressed_tensors",
    "to_compressed_tensors",
    "load_compressed_tensors",
]

QUANT_METHOD = "compressed-tensors"
PACKED = "pack-quantized"
UNPACKED = ("int-quantized", "naive-quantized")
FLOAT_QUANTIZED = "float-quantized"
_READ_FORMATS = (PACKED, *UNPACKED, FLOAT_QUANTIZED)
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_ACT_PARTS = tuple(f"{base}_{suffix}" for base in ("input", "output") for suffix in ("scale", "zero_point", "global_scale"))
_KV_PARTS = tuple(f"{p}_{suffix}" for p in "kqv" for suffix in ("scale", "zero_point"))
_WEIGHT_PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_global_scale")


# -- bit packing (compressed_tensors.compressors.pack_quantized.helpers, without the dependency) -----------
def _check_bits(bits: Any) -> int:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
        raise ValueError(f"num_bits: expected an int in 1..8, got {bits!r}")
    return bits


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """The signed ``bits``-bit codes (int8 ``[R, cols]``) of int32 rows ``[R, ceil(cols·bits / 32)]``
    packed by compressed-tensors' ``pack_to_int32`` (each row one little-endian bit stream of
    ``q + 2^(bits-1)``); padding bits past ``cols`` are ignored."""
    bits = _check_bits(bits)
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed: expected a 2-D int32 tensor, got {packed.dtype} {list(packed.shape)}")
    rows, words = packed.shape
    if words != -(-cols * bits // 32):
        raise ValueError(f"packed: {cols} codes of {bits} bits need {-(-cols * bits // 32)} int32 words per row, got {words}")
    # the stream's bytes, least significant first (arithmetic shifts then a mask: endian-independent)
    stream = torch.stack([(packed >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8).reshape(rows, words * 4)
    offset = 1 << (bits - 1)
    if bits == 8:
        raw = stream[:, :cols].to(torch.int16)
    elif bits == 4:
        raw = torch.stack([stream & 0xF, stream >> 4], dim=-1).reshape(rows, -1)[:, :cols].to(torch.int16)
    else:
        stream = torch.nn.functional.pad(stream, (0, 1)).to(torch.int32)
        start = torch.arange(cols, device=packed.device) * bits
        lo = start // 8
        pair = stream[:, lo] | (stream[:, lo + 1] << 8)  # a code spans at most two bytes (bits <= 8)
        raw = ((pair >> (start % 8).to(torch.int32)) & ((1 << bits) - 1)).to(torch.int16)
    return (raw - offset).to(torch.int8)


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_int32`: int8 codes ``[R, C]`` in ``[-2^(bits-1), 2^(bits-1) - 1]`` as
    int32 ``[R, ceil(C·bits / 32)]``, byte for byte what ``pack_to_int32`` writes."""
    bits = _check_bits(bits)
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"codes: expected a 2-D int8 tensor, got {codes.dtype} {list(codes.shape)}")
    rows, cols = codes.shape
    offset = 1 << (bits - 1)
    raw = codes.to(torch.int32) + offset
    if codes.numel() and bool(((raw < 0) | (raw >= 1 << bits)).any()):
        raise ValueError(f"codes: expected values in [{-offset}, {offset - 1}] for {bits} bits")
    words = -(-cols * bits // 32)
    nbytes = words * 4
    if bits == 8:
        stream = raw
    elif bits == 4:
        raw = torch.nn.functional.pad(raw, (0, cols % 2))
        stream = raw[:, 0::2] | (raw[:, 1::2] << 4)
    else:
        start = torch.arange(cols, device=codes.device) * bits
        lo, shift = start // 8, (start % 8).to(torch.int32)
        stream = torch.zeros(rows, nbytes + 1, dtype=torch.int32, device=codes.device)
        stream.index_add_(1, lo, (raw << shift) & 0xFF)  # disjoint bits: adding is or-ing
        stream.index_add_(1, lo + 1, raw >> (8 - shift))
    stream = torch.nn.functional.pad(stream, (0, max(0, nbytes - stream.shape[1])))[:, :nbytes].to(torch.int64)
    b = stream.reshape(rows, words, 4)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)
    return word.clone(memory_format=torch.contiguous_format)  # fresh row-major strides, as pack_to_int32's


# -- the quantization_config ------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightArgs:
    """The weight half of a compressed-tensors scheme (integer weights, or 8-bit float: ``type``)."""

    num_bits: int
    symmetric: bool
    strategy: str
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    actorder: str | None = None
    type: str = "int"

    @property
    def qrange(self) -> tuple[int, int]:
        return -(1 << (self.num_bits - 1)), (1 << (self.num_bits - 1)) - 1

    def block(self, n: int, k: int) -> tuple[int, int]:
        """torchq's block size for an ``[N, K]`` weight."""
        if self.strategy == "tensor":
            return (n, k)
        if self.strategy == "channel":
            return (1, k)
        if self.strategy == "group":
            return (1, self.group_size)
        return self.block_structure  # type: ignore[return-value]

    def grid(self, n: int, k: int) -> tuple[int, int]:
        bn, bk = self.block(n, k)
        return (-(-n // bn), -(-k // bk))

    def to_json(self) -> dict:
        out: dict[str, Any] = {"num_bits": self.num_bits, "type": self.type, "symmetric": self.symmetric,
                               "group_size": self.group_size if self.strategy == "group" else None,
                               "strategy": self.strategy, "dynamic": False}
        if self.strategy == "block":
            out["block_structure"] = list(self.block_structure)  # type: ignore[arg-type]
        if self.actorder is not None:
            out["actorder"] = self.actorder
        return out


@dataclass(frozen=True)
class Scheme:
    name: str
    targets: tuple[str, ...]
    weights: WeightArgs | None
    quantizes_activations: bool  # activation quantization torchq drops (or refuses: activations='error')
    format: str
    act_quant: Float8Activations | None = None  # dynamic float8 activations torchq carries over


@dataclass(frozen=True)
class ParsedConfig:
    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...]
    kv_cache: bool
    patterns: Mapping[str, SafePattern] = field(default_factory=dict, compare=False, repr=False)  # "re:<regex>" -> matcher


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _weight_args(d: Any, where: str) -> WeightArgs:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
    kind = d.get("type", "int")
    kind = getattr(kind, "value", kind)  # a QuantizationType from model_dump()
    if kind not in ("int", "float"):
        raise ValueError(f"{where}.type: expected 'int' or 'float', got {kind!r}")
    bits = d.get("num_bits", 8)
    if not _is_int(bits) or not 1 <= bits <= 8:
        raise ValueError(f"{where}.num_bits: expected an int in 1..8, got {bits!r}")
    if kind == "float" and bits != 8:
        raise ValueError(f"{where}.num_bits: torchq imports 8-bit float weights (FP8 e4m3); {bits}-bit float (NVFP4/MXFP4) "
                         f"is not supported")
    symmetric = d.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ValueError(f"{where}.symmetric: expected true/false, got {symmetric!r}")
    if kind == "float" and not symmetric:
        raise ValueError(f"{where}.symmetric: float weights have no zero point, got false")
    if d.get("dynamic", False) not in (False, None):
        raise ValueError(f"{where}.dynamic: weights must be static, got {d.get('dynamic')!r}")
    group_size, block = d.get("group_size"), d.get("block_structure")
    strategy = d.get("strategy")
    if strategy is None:  # compressed-tensors' inference
        strategy = "tensor" if group_size is None else "group" if _is_int(group_size) and group_size > 0 else "channel"
    if strategy not in ("tensor", "channel", "group", "block"):
        raise ValueError(f"{where}.strategy: expected tensor, channel, group or block, got {strategy!r}")
    if strategy == "group":
        if not _is_int(group_size) or group_size <= 0:
            raise ValueError(f"{where}.group_size: strategy group needs a positive int, got {group_size!r}")
    else:
        group_size = None
    if strategy == "block":
        if isinstance(block, str):
            block = block.split("x")
            block = [int(b) for b in block] if all(b.isdigit() for b in block) else block
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(_is_int(b) and b > 0 for b in block)):
            raise ValueError(f"{where}.block_structure: strategy block needs [rows, cols] positive ints, got {block!r}")
        block = (block[0], block[1])
    else:
        block = None
    actorder = d.get("actorder")
    if actorder is False:
        actorder = None
    aliases = {"static": "weight", "dynamic": "group", True: "group"}
    actorder = aliases.get(actorder, actorder)
    if actorder not in (None, "weight", "group"):
        raise ValueError(f"{where}.actorder: expected null, 'weight' or 'group', got {d.get('actorder')!r}")
    return WeightArgs(bits, symmetric, strategy, group_size, block, actorder, kind)


def _infer_format(weights: WeightArgs | None, act: Any) -> str:
    """compressed-tensors' ``infer_module_format`` for a Linear."""
    if weights is not None and weights.type == "float":
        return FLOAT_QUANTIZED if isinstance(act, dict) else "naive-quantized"
    if isinstance(act, dict) and act.get("type", "int") == "int":
        return "int-quantized"
    return PACKED


def _float8_activations(weights: WeightArgs | None, act: Any) -> Float8Activations | None:
    """The dynamic float8 activations a float8 weight's scheme asks for (per token or tensor), which
    torchq runs itself; None for anything else (static scales, integer or absent activations)."""
    if weights is None or weights.type != "float" or not isinstance(act, dict):
        return None
    if act.get("type") != "float" or act.get("num_bits", 8) != 8 or act.get("dynamic") is not True:
        return None
    strategy = act.get("strategy") or "token"
    return Float8Activations({"token": "row", "tensor": "tensor"}[strategy]) if strategy in ("token", "tensor") else None


def parse_quantization_config(config: Any) -> ParsedConfig:
    """Validate a compressed-tensors ``quantization_config`` (a dict as in ``config.json``, the
    whole ``config.json`` dict, or a ``compressed_tensors.QuantizationConfig``)."""
    if hasattr(config, "model_dump") and not isinstance(config, dict):
        config = config.model_dump()
    if not isinstance(config, dict):
        raise ValueError(f"quantization_config: expected a dict, got {type(config).__name__}")
    if "config_groups" not in config and isinstance(config.get("quantization_config"), dict):
        config = config["quantization_config"]
    method = config.get("quant_method", QUANT_METHOD)
    if method != QUANT_METHOD:
        raise ValueError(f"quantization_config.quant_method: expected {QUANT_METHOD!r}, got {method!r}")
    for key in ("transform_config", "sparsity_config", "moe_sparsity_config"):
        if config.get(key):
            raise ValueError(f"quantization_config.{key}: torchq imports plain quantized weights only, got {config[key]!r}")
    top = config.get("format") or PACKED
    if top not in (*_READ_FORMATS, "mixed-precision"):
        raise ValueError(
            f"quantization_config.format: torchq imports {', '.join(_READ_FORMATS)} (or mixed-precision of them), got {top!r}"
        )
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"quantization_config.config_groups: expected a non-empty object, got {groups!r}")
    schemes = []
    patterns: dict[str, SafePattern] = {}
    for name, d in groups.items():
        where = f"quantization_config.config_groups[{name!r}]"
        if isinstance(d, list):
            raise ValueError(f"{where}: a preset scheme name with targets {d!r}; expand it first "
                             f"(compressed_tensors.QuantizationConfig(...).model_dump())")
        if not isinstance(d, dict):
            raise ValueError(f"{where}: expected a scheme object, got {type(d).__name__}")
        targets = d.get("targets")
        if not (isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)):
            raise ValueError(f"{where}.targets: expected a non-empty list of strings, got {targets!r}")
        _compile_targets(targets, f"{where}.targets", patterns)
        weights = None if d.get("weights") is None else _weight_args(d["weights"], f"{where}.weights")
        act_in, act_out = d.get("input_activations"), d.get("output_activations")
        fmt = d.get("format") or (top if top != "mixed-precision" else _infer_format(weights, act_in))
        if weights is not None and fmt not in _READ_FORMATS:
            raise ValueError(f"{where}.format: torchq imports {', '.join(_READ_FORMATS)}, got {fmt!r}")
        if weights is not None and (weights.type == "float") != (fmt == FLOAT_QUANTIZED) and fmt != "naive-quantized":
            raise ValueError(f"{where}.format: {fmt!r} does not store {weights.type} weights")
        act_quant = _float8_activations(weights, act_in)
        drops = (act_in is not None and act_quant is None) or act_out is not None
        schemes.append(Scheme(str(name), tuple(targets), weights, drops, fmt, act_quant))
    ignore = config.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(t, str) for t in ignore)):
        raise ValueError(f"quantization_config.ignore: expected a list of strings, got {ignore!r}")
    _compile_targets(ignore, "quantization_config.ignore", patterns)
    check_total_states(list(patterns.values()), where="quantization_config (targets and ignore)")
    return ParsedConfig(tuple(schemes), tuple(ignore), config.get("kv_cache_scheme") is not None, patterns)


def _compile_targets(targets: list[str], where: str, patterns: dict[str, SafePattern]) -> None:
    """Compile the ``"re:<regex>"`` entries (regexes from a file: a PatternError, a ValueError naming
    ``where`` and the pattern, refuses what the linear-time matcher cannot take)."""
    for t in targets:
        if t.startswith("re:") and t not in patterns:
            patterns[t] = compile_pattern(t[3:], where=where)


def _match_name(name: str, target: str, patterns: Mapping[str, SafePattern]) -> bool:
    if target.startswith("re:"):
        pat = patterns.get(target) or compile_pattern(target[3:], where="compressed-tensors target")
        return pat.match(name)  # re.match: anchored at the start only
    return target == name


def _is_class_target(target: str, classes: tuple[str, ...] | None) -> bool:
    """A target naming the module's class; without the model only ``Linear`` (as compressed-tensors'
    model-free tools assume: every quantized weight belongs to a Linear-like module)."""
    if target.startswith("re:"):
        return False
    return target in classes if classes is not None else target == "Linear"


def _scheme_for(name: str, cfg: ParsedConfig, classes: tuple[str, ...] | None) -> tuple[Scheme | None, str | None]:
    """``(scheme, target)``: the scheme compressed-tensors' ``apply_quantization_config`` gives module
    ``name`` and the target that chose it: exact-name targets first, then regexes, then classes; a
    target listed by several schemes belongs to the last one; None when nothing matches or
    ``ignore`` does."""
    if any(_match_name(name, t, cfg.patterns) or _is_class_target(t, classes) for t in cfg.ignore):
        return None, None
    target_to_scheme: OrderedDict[str, Scheme] = OrderedDict()
    for s in cfg.schemes:
        for t in s.targets:
            target_to_scheme[t] = s
    ordered = sorted(target_to_scheme, key=lambda t: ("re:" in t, t))
    matched = [t for t in ordered if _match_name(name, t, cfg.patterns)] + [t for t in ordered if _is_class_target(t, classes)]
    return (target_to_scheme[matched[0]], matched[0]) if matched else (None, None)


# -- one module's tensors -----------------------------------------------------------------------------------
Meta = Mapping[str, tuple[Any, tuple[int, ...]]]  # name -> (torch dtype or unknown, shape)


@dataclass
class _Plan:
    """A quantized module whose tensors were checked against its scheme."""

    module: str
    scheme: Scheme
    shape: tuple[int, int]
    keys: dict[str, str]  # part -> tensor name


def _key(prefix: str, part: str) -> str:
    return f"{prefix}.{part}" if prefix else part


def _expect(meta: Meta, name: str, dtypes: tuple, shape: tuple[int, ...] | None, what: str) -> None:
    if name not in meta:
        raise CheckpointError(f"{what}: missing tensor {name!r}")
    dtype, got = meta[name]
    if dtype not in dtypes:
        raise CheckpointError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {dtype}")
    if shape is not None and tuple(got) != shape:
        raise CheckpointError(f"{name}: expected shape {list(shape)}, got {list(got)}")


def _plan_module(prefix: str, scheme: Scheme, meta: Meta, read: Callable[[str], torch.Tensor]) -> _Plan:
    """Check every tensor of one module (dtype and shape; only ``weight_shape`` is read) before
    any data is decoded or allocated."""
    w = scheme.weights
    what = f"compressed-tensors module {prefix!r} ({scheme.format}, config group {scheme.name!r})"
    assert w is not None
    keys = {p: _key(prefix, p) for p in _WEIGHT_PARTS + ("weight",)}
    if keys["weight_global_scale"] in meta:
        raise CheckpointError(f"{what}: has weight_global_scale (a tensor_group / FP4 weight); torchq imports integer weights only")
    stored = PACKED if keys["weight_packed"] in meta else "int8 'weight'"
    if (scheme.format == PACKED) != (stored == PACKED) or (keys["weight_packed"] in meta and keys["weight"] in meta):
        found = " and ".join(repr(keys[p]) for p in ("weight_packed", "weight") if keys[p] in meta) or "no weight"
        want = "weight_packed" if scheme.format == PACKED else "a float8_e4m3fn weight" if w.type == "float" else "an int8 weight"
        raise CheckpointError(f"{what}: expected {want}, found {found}")
    if scheme.format == PACKED:
        _expect(meta, keys["weight_packed"], (torch.int32,), None, what)
        _expect(meta, keys["weight_shape"], _INT_DTYPES, (2,), what)
        packed_shape = tuple(meta[keys["weight_packed"]][1])
        if len(packed_shape) != 2:
            raise CheckpointError(f"{keys['weight_packed']}: expected a 2-D [out_features, words] tensor (3-D fused "
                                  f"expert weights are not supported), got shape {list(packed_shape)}")
        n, k = (int(v) for v in read(keys["weight_shape"]).reshape(-1).tolist())
        words = packed_shape[1]
        if n != packed_shape[0] or k < 1 or -(-k * w.num_bits // 32) != words:
            raise CheckpointError(
                f"{keys['weight_shape']}: [{n}, {k}] does not fit {keys['weight_packed']} of shape {list(packed_shape)} "
                f"({w.num_bits}-bit codes: expected [{packed_shape[0]}, K] with ceil(K * {w.num_bits} / 32) = {words})"
            )
    else:
        _expect(meta, keys["weight"], (FLOAT8_DTYPE,) if w.type == "float" else (torch.int8,), None, what)
        shape = tuple(meta[keys["weight"]][1])
        if len(shape) != 2:
            raise CheckpointError(f"{keys['weight']}: expected a 2-D [out_features, in_features] tensor, got shape {list(shape)}")
        n, k = shape
    if n < 1 or k < 1:
        raise CheckpointError(f"{what}: empty weight [{n}, {k}]")
    if w.strategy == "group" and k % w.group_size:  # type: ignore[operator]
        raise CheckpointError(f"{what}: in_features {k} is not a multiple of group_size {w.group_size} "
                              f"(compressed-tensors cannot decode it either)")
    grid = w.grid(n, k)
    _expect(meta, keys["weight_scale"], _SCALE_DTYPES, None, what)
    scale_shape = tuple(meta[keys["weight_scale"]][1])
    ok = {"tensor": [(1,), (), (1, 1)], "channel": [(n, 1), (n,)]}.get(w.strategy, [grid])
    if scale_shape not in ok:
        raise CheckpointError(f"{keys['weight_scale']}: expected shape {list(ok[0])} for {w.strategy} quantization of a "
                              f"[{n}, {k}] weight, got {list(scale_shape)}")
    zkey = keys["weight_zero_point"]
    if not w.symmetric:
        if scheme.format == PACKED and w.strategy in ("group", "channel"):
            _expect(meta, zkey, (torch.int32,), (-(-n * w.num_bits // 32), grid[1]), what)
        else:
            _expect(meta, zkey, _INT_DTYPES, None, what)
            if math.prod(meta[zkey][1]) != math.prod(grid) or tuple(meta[zkey][1]) not in ok:
                raise CheckpointError(f"{zkey}: expected shape {list(ok[0])}, got {list(meta[zkey][1])}")
    elif zkey in meta:  # a symmetric scheme's zero point (older writers kept zeros): must be zeros
        if meta[zkey][0] not in _INT_DTYPES or tuple(meta[zkey][1]) not in ok:
            raise CheckpointError(f"{zkey}: a symmetric scheme's zero point must be integers of shape {list(ok[0])}, "
                                  f"got {meta[zkey][0]} {list(meta[zkey][1])}")
    gkey = keys["weight_g_idx"]
    if gkey in meta:
        _expect(meta, gkey, (torch.int32, torch.int64), (k,), what)
    used = {p: keys[p] for p in ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx", "weight")
            if keys[p] in meta}
    return _Plan(prefix, scheme, (n, k), used)


def _group_order(g_idx: torch.Tensor, w: WeightArgs, k: int, where: str) -> torch.Tensor | None:
    """None for column-order groups (``g_idx`` is ``c // group_size``, all -1, or all 0 without
    groups); else the stable order of the columns by group (each group exactly ``group_size``)."""
    g = g_idx.long()
    if bool((g == -1).all()):
        return None
    if bool((g == -1).any()):
        raise CheckpointError(f"{where}: mixes -1 (unset) with group indices")
    if w.strategy != "group":
        if bool((g == 0).all()):
            return None
        raise CheckpointError(f"{where}: a {w.strategy} scheme has one group per row, but g_idx is not all 0")
    gs = w.group_size
    groups = k // gs  # type: ignore[operator]
    if bool(((g < 0) | (g >= groups)).any()):
        raise CheckpointError(f"{where}: group indices must be in [0, {groups - 1}]")
    if torch.equal(g, torch.arange(k, device=g.device) // gs):
        return None
    counts = torch.bincount(g, minlength=groups)
    if bool((counts != gs).any()):
        bad = int((counts != gs).nonzero()[0])
        raise CheckpointError(
            f"{where}: group {bad} has {int(counts[bad])} columns; activation order needs exactly group_size={gs} "
            f"columns per group (as GPTQ writes and compressed-tensors decodes)"
        )
    return torch.argsort(g, stable=True)


def _decode(plan: _Plan, read: Callable[[str], torch.Tensor], dtype: torch.dtype | None) -> AffineQuantizedTensor:
    """The torchq weight of one planned module (see the module docstring for the bytes)."""
    w = plan.scheme.weights
    assert w is not None
    n, k = plan.shape
    where = f"compressed-tensors module {plan.module!r}"
    keys = plan.keys
    if w.type == "float":
        return _decode_float8(plan, read, dtype)
    qmin, qmax = w.qrange
    if "weight_packed" in keys:
        codes = unpack_int32(read(keys["weight_packed"]), w.num_bits, k)
    else:
        codes = read(keys["weight"]).contiguous()
        if w.num_bits < 8 and bool(((codes < qmin) | (codes > qmax)).any()):
            raise CheckpointError(f"{keys['weight']}: codes outside [{qmin}, {qmax}] for {w.num_bits} bits")
    grid = w.grid(n, k)
    scale = read(keys["weight_scale"]).reshape(grid).contiguous()
    if not bool(torch.isfinite(scale).all()):
        raise CheckpointError(f"{keys['weight_scale']}: contains NaN/inf")
    zero = None
    zkey = keys.get("weight_zero_point")
    if not w.symmetric:
        z = read(zkey)  # type: ignore[arg-type]
        if plan.scheme.format == PACKED and w.strategy in ("group", "channel"):
            zero = unpack_int32(z.t().contiguous(), w.num_bits, n).t().contiguous()
        else:
            if bool(((z < qmin) | (z > qmax)).any()):
                raise CheckpointError(f"{zkey}: zero points outside [{qmin}, {qmax}]")
            zero = z.reshape(grid).to(torch.int8).contiguous()
    elif zkey is not None and bool((read(zkey) != 0).any()):
        raise CheckpointError(f"{zkey}: the scheme is symmetric but the zero points are not all 0")
    perm = None
    if "weight_g_idx" in keys:
        perm = _group_order(read(keys["weight_g_idx"]), w, k, keys["weight_g_idx"])
        if perm is not None:
            codes = codes.index_select(1, perm).contiguous()
    spec = QuantSpec(w.block(n, k), qmin, qmax, ZeroPointDomain.NONE if w.symmetric else ZeroPointDomain.INT)
    try:
        plain = PlainForm(codes, scale, zero, spec)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    q = AffineQuantizedTensor.from_plain(plain, dtype or scale.dtype, label=plan.module)
    return q if perm is None else q._replace(input_perm=perm)


def _decode_float8(plan: _Plan, read: Callable[[str], torch.Tensor], dtype: torch.dtype | None) -> AffineQuantizedTensor:
    """An FP8 module: the float8_e4m3fn bytes as the ``e4m3fn`` plain form's codes, the scale in
    fp32 (exact), dynamic float8 activations carried over."""
    w = plan.scheme.weights
    assert w is not None
    n, k = plan.shape
    keys = plan.keys
    where = f"compressed-tensors module {plan.module!r}"
    codes = read(keys["weight"]).contiguous().view(torch.uint8)
    scale = read(keys["weight_scale"])
    if not bool(torch.isfinite(scale).all()):
        raise CheckpointError(f"{keys['weight_scale']}: contains NaN/inf")
    zkey = keys.get("weight_zero_point")
    if zkey is not None and bool((read(zkey) != 0).any()):
        raise CheckpointError(f"{zkey}: float weights have no zero point, but the zero points are not all 0")
    if "weight_g_idx" in keys and _group_order(read(keys["weight_g_idx"]), w, k, keys["weight_g_idx"]) is not None:
        raise CheckpointError(f"{keys['weight_g_idx']}: activation order is not supported for float weights")
    spec = QuantSpec(w.block(n, k), 0, 255, ZeroPointDomain.NONE, codebook=FLOAT8_CODEBOOK)
    try:
        plain = PlainForm(codes, scale.reshape(w.grid(n, k)).to(torch.float32).contiguous(), None, spec)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from None
    return AffineQuantizedTensor.from_plain(plain, dtype or scale.dtype, act_quant=plan.scheme.act_quant, label=plan.module)


def _meta_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[Any, tuple[int, ...]]]:
    out = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors: expected str -> torch.Tensor, got {name!r} -> {type(t).__name__}")
        out[name] = (t.dtype, tuple(t.shape))
    return out


@dataclass
class _Layout:
    plans: list[_Plan]
    dropped: set[str]


def _plan(meta: Meta, config: Any, read: Callable[[str], torch.Tensor], activations: str,
          classes: Mapping[str, tuple[str, ...]] | None) -> _Layout:
    if activations not in ("ignore", "error"):
        raise ValueError(f"activations: expected 'ignore' or 'error', got {activations!r}")
    cfg = parse_quantization_config(config)
    if activations == "error":
        acts = [s.name for s in cfg.schemes if s.quantizes_activations] + (["kv_cache_scheme"] if cfg.kv_cache else [])
        if acts:
            raise ValueError(f"activations='error': the config quantizes activations ({', '.join(acts)}); torchq imports the "
                             f"weights only (activations='ignore' drops the activation quantization)")
    modules = sorted({n.rpartition(".")[0] for n in meta if n.rpartition(".")[2] in ("weight_scale", "weight_packed")})
    plans, dropped = [], set()
    for prefix in modules:
        scheme, target = _scheme_for(prefix, cfg, None if classes is None else classes.get(prefix, ()))
        hint = "" if classes is not None else "; pass model= to match class-name targets"
        if scheme is None or scheme.weights is None:
            raise CheckpointError(
                f"module {prefix!r} has quantized weight tensors, but no config group quantizes its weight (targets: "
                f"{sorted({t for s in cfg.schemes for t in s.targets})}, ignore: {list(cfg.ignore)}){hint}"
            )
        try:
            plan = _plan_module(prefix, scheme, meta, read)
        except CheckpointError as e:
            if classes is None and target == "Linear":  # 'Linear' stood for every module: maybe not this one's scheme
                raise CheckpointError(f"{e} (module {prefix!r} took config group {scheme.name!r} by its 'Linear' "
                                      f"target, assumed without the model{hint})") from None
            raise
        plans.append(plan)
        dropped.update(plan.keys.values())
        if scheme.quantizes_activations:
            dropped.update(k for k in (_key(prefix, p) for p in _ACT_PARTS) if k in meta)
    if cfg.kv_cache:
        dropped.update(n for n in meta if n.rpartition(".")[2] in _KV_PARTS)
    return _Layout(plans, dropped)


def from_compressed_tensors(
    tensors: Mapping[str, torch.Tensor],
    quantization_config: Any,
    *,
    dtype: torch.dtype | None = None,
    activations: str = "ignore",
    model: nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """A compressed-tensors state dict with every quantized module's tensors replaced by one torchq
    weight ``<module>.weight`` (an :class:`~torchq.AffineQuantizedTensor` in the layout
    ``choose_layout`` picks, dequantizing bit for bit to compressed-tensors' values); other
    entries pass through. ``quantization_config``: ``config.json``'s ``quantization_config`` (or
    the whole ``config.json`` dict, or a ``compressed_tensors.QuantizationConfig``). ``dtype``:
    the weights' float dtype (default: each weight's scale dtype, the dtype compressed-tensors
    dequantizes to). ``activations``: see the module docstring. ``model``: lets class-name targets
    other than ``Linear`` (e.g. ``"Embedding"``) match, as in compressed-tensors. Every tensor's
    dtype and shape are checked against the config before anything is decoded; problems raise a
    :class:`~torchq.checkpoint.CheckpointError` (a ValueError) naming the tensor."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors: expected a mapping of names to tensors, got {type(tensors).__name__}")
    _check_dtype(dtype)
    meta = _meta_of(tensors)
    classes = _module_classes(model) if model is not None else None
    layout = _plan(meta, quantization_config, tensors.__getitem__, activations, classes)
    weights = {_key(p.module, "weight"): _decode(p, tensors.__getitem__, dtype) for p in layout.plans}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in weights or name in layout.dropped:
            continue
        out[name] = t
    out.update(weights)
    return out


def _check_dtype(dtype: Any) -> None:
    if dtype is not None and dtype not in _SCALE_DTYPES:
        raise ValueError(f"dtype: expected torch.float32/bfloat16/float16 or None, got {dtype!r}")


def _module_classes(model: nn.Module) -> dict[str, tuple[str, ...]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    return {name: tuple(c.__name__ for c in type(m).__mro__ if issubclass(c, nn.Module))
            for name, m in model.named_modules(remove_duplicate=False)}


# -- files --------------------------------------------------------------------------------------------------


def _checkpoint_files(path: Path) -> tuple[list[Path], Path | None]:
    """``(safetensors files, config.json or None)`` of a folder or a single file."""
    if path.is_file():
        config = path.parent / "config.json"
        return [path], config if config.is_file() else None
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or folder")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        if any(f.parent != path or not f.is_file() for f in files):
            raise CheckpointError(f"{index}: lists files that are not in {path}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no .safetensors files")
    config = path / "config.json"
    return files, config if config.is_file() else None


def load_compressed_tensors(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    quantization_config: Any = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    strict: bool = True,
    activations: str = "ignore",
    init_buffers: BufferInit = None,
) -> nn.Module:
    """Load a compressed-tensors checkpoint (a folder with ``config.json`` and safetensors files,
    or one safetensors file) into ``model`` (e.g. built from the config on the ``meta`` device);
    returns ``model``. Quantized modules get torchq weights (see :func:`from_compressed_tensors`),
    other entries are loaded as they are. ``quantization_config``: overrides ``config.json``'s.
    Every tensor's dtype and shape (from the safetensors headers) is checked against the config
    and the model before any data is read (but each ``weight_shape``'s two integers); on any error
    the model is unchanged. ``device``,
    ``strict``, ``init_buffers``: as in :func:`torchq.load_quantized`."""
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - safetensors comes with transformers
        raise ImportError("reading compressed-tensors checkpoints needs the safetensors package") from e
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    _check_dtype(dtype)
    path = Path(path)
    files, config_file = _checkpoint_files(path)
    if quantization_config is None:
        if config_file is None:
            raise CheckpointError(f"{path}: no config.json next to the weights; pass quantization_config=")
        try:
            quantization_config = json.loads(config_file.read_text()).get("quantization_config")
        except (ValueError, AttributeError, RecursionError) as e:
            raise CheckpointError(f"{config_file}: not a JSON object ({e})") from None
        if quantization_config is None:
            raise CheckpointError(f"{config_file}: has no quantization_config (not a compressed-tensors checkpoint)")
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        meta: dict[str, tuple[Any, tuple[int, ...]]] = {}
        for f in files:
            try:
                h = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            except Exception as e:
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
            for name in h.keys():
                if name in handles:
                    raise CheckpointError(f"{f}: tensor {name!r} is also stored in another file")
                sl = h.get_slice(name)
                handles[name] = h
                meta[name] = (SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape()))

        def read(name: str) -> torch.Tensor:
            try:
                return handles[name].get_tensor(name)
            except Exception as e:  # safetensors' own errors on a damaged file
                raise CheckpointError(f"{path}: cannot read tensor {name!r} ({type(e).__name__}: {e})") from None

        def named(fn: Callable[[], torch.Tensor], name: str) -> torch.Tensor:
            """``fn()``, its ValueError raised as a CheckpointError naming the checkpoint and the tensor."""
            try:
                return fn()
            except ValueError as e:
                if str(e).startswith(str(path)):
                    raise
                raise CheckpointError(f"{path}: tensor {name!r}: {e}") from None

        def read_float(name: str, dev: torch.device, parameter: bool) -> torch.Tensor:
            t = read(name)
            wide = t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # float8: refused by its dtype
            if parameter and wide and not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"{path}: tensor {name!r} holds NaN or infinite values; a model's weights must be finite")
            return t.to(dev)

        try:
            layout = _plan(meta, quantization_config, read, activations, _module_classes(model))
        except ValueError as e:  # the config or a tensor's header entry: the checkpoint named with the field
            if str(e).startswith(str(path)):
                raise
            raise CheckpointError(f"{path}: {e}") from None
        incoming: dict[str, Incoming] = {}
        for plan in layout.plans:
            name = _key(plan.module, "weight")
            w = plan.scheme.weights
            incoming[name] = Incoming(
                name, plan.shape, True, f"compressed-tensors {plan.scheme.format} {w.num_bits}-bit {w.strategy}",  # type: ignore[union-attr]
                (lambda dev, plan=plan, name=name: named(lambda: _decode(plan, read, dtype), name).to(dev)))
        planned = {_key(p.module, "weight") for p in layout.plans}
        parameters = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        for name, (dt, shape) in meta.items():
            if name in layout.dropped or name in planned:
                continue
            incoming[name] = Incoming(name, shape, False, f"{dt} tensor",
                                      (lambda dev, name=name: read_float(name, dev, name in parameters)),
                                      dtype=dt if isinstance(dt, torch.dtype) else None)
        install_checkpoint(model, incoming, {}, device=None if device is None else torch.device(device), strict=strict,
                           source=str(path), init_buffers=init_buffers)
    attach = prepare_weights_installed(model, needs_weights=True)
    if attach is not None:
        attach()
    return model


# -- export ----------------------------------------------------------------------------------------------------
def _export_args(name: str, w: AffineQuantizedTensor, plain: PlainForm) -> tuple[WeightArgs, torch.Tensor, torch.Tensor | None]:
    """``(weight args, int8 codes, int8 zero points or None)`` of a torchq weight, or a ValueError
    saying why compressed-tensors cannot hold it."""
    spec = plain.spec
    where = f"to_compressed_tensors: {name!r} ({spec.describe()})"
    if spec.codebook is not None or spec.zero_point_domain is ZeroPointDomain.FLOAT:
        raise ValueError(f"{where}: compressed-tensors' integer weights have integer zero points; this format has "
                         f"{'a codebook' if spec.codebook else 'float zero points'} (quantize with zero_point_domain INT or NONE)")
    if w.transposed:
        raise ValueError(f"{where}: a transposed (Conv1D) weight; compressed-tensors stores [out_features, in_features]")
    if w.input_scale is not None:
        raise ValueError(f"{where}: has an input_scale (AWQ), which compressed-tensors cannot hold")
    if w.act_quant is not None:
        raise ValueError(f"{where}: quantizes activations ({w.act_quant.describe()}); compressed-tensors' activation "
                         f"schemes do not compute the same values")
    if plain.scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{where}: scale dtype {plain.scale.dtype}; compressed-tensors scales are fp32, bf16 or fp16")
    codes, zero = plain.codes.to(torch.int16), plain.zero_point
    lo, hi = spec.quant_min, spec.quant_max
    if not spec.signed:  # unsigned codes with an integer zero point: shift both, (q - z) is unchanged
        if spec.zero_point_domain is not ZeroPointDomain.INT:
            raise ValueError(f"{where}: unsigned codes need an integer zero point")
        shift = 1 << (spec.bits - 1)
        codes, zero, lo, hi = codes - shift, zero.to(torch.int16) - shift, lo - shift, hi - shift  # type: ignore[union-attr]
    bits = next(b for b in range(1, 9) if -(1 << (b - 1)) <= lo and hi <= (1 << (b - 1)) - 1)
    if zero is not None:
        zero = zero.to(torch.int16)
        if bool(((zero < -(1 << (bits - 1))) | (zero > (1 << (bits - 1)) - 1)).any()):
            raise ValueError(f"{where}: zero points outside the {bits}-bit code range")
        zero = zero.to(torch.int8)
    n, k = plain.shape
    bn, bk = spec.block_size
    if bn == 1 and bk >= k:  # also a one-group group scheme, or a one-row tensor scheme: the same values
        strategy, group, block = "channel", None, None
    elif bn >= n and bk >= k:
        strategy, group, block = "tensor", None, None
    elif bn == 1:
        if k % bk:
            raise ValueError(f"{where}: in_features {k} is not a multiple of the group size {bk}; compressed-tensors "
                             f"group quantization needs whole groups")
        strategy, group, block = "group", bk, None
    else:
        strategy, group, block = "block", None, (bn, bk)
    perm = w.input_perm
    actorder = None
    if perm is not None and not torch.equal(perm.long(), torch.arange(k, device=perm.device)):
        if strategy != "group":
            raise ValueError(f"{where}: an input_perm needs group quantization (compressed-tensors' g_idx)")
        actorder = "group"
    args = WeightArgs(bits, spec.zero_point_domain is ZeroPointDomain.NONE, strategy, group, block, actorder)
    return args, codes.to(torch.int8), zero


def to_compressed_tensors(
    model_or_weights: nn.Module | Mapping[str, torch.Tensor],
    *,
    format: str | Mapping[str, str] = PACKED,
) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, quantization_config)``: a compressed-tensors checkpoint of a model (or a state
    dict) holding torchq weights, the inverse of :func:`from_compressed_tensors`. ``format``:
    ``"pack-quantized"`` (1-8 bit codes packed in int32) or ``"naive-quantized"`` (int8 codes), or a
    mapping of module names to these (others: pack-quantized); ``int-quantized`` means activation
    quantization too, which torchq does not export (its weights are ``naive-quantized``'s bytes).
    Write ``tensors`` with ``safetensors.torch.save_file`` and the config under ``config.json``'s
    ``quantization_config``. Each scheme targets its modules by exact name and has no activation
    quantization; a weight with an ``input_perm`` is written with its
    ``weight_g_idx`` (legacy ``actorder: "group"``, which vLLM and compressed-tensors < 0.20 read).
    torchq's block size decides the strategy: ``(1, K)`` is written as channel (a one-group group
    scheme or a one-row tensor scheme comes back as channel: the same values, other metadata).
    Weights compressed-tensors cannot hold raise a ValueError naming them."""
    formats = format if isinstance(format, Mapping) else {}
    default = PACKED if isinstance(format, Mapping) else format
    for f in (default, *formats.values()):
        if f not in (PACKED, "naive-quantized"):
            raise ValueError(f"format: expected 'pack-quantized' or 'naive-quantized', got {f!r}")
    if isinstance(model_or_weights, nn.Module):
        state = model_or_weights.state_dict()
        linears = [n for n, m in model_or_weights.named_modules() if isinstance(m, nn.Linear)]
    elif isinstance(model_or_weights, Mapping):
        state, linears = dict(model_or_weights), []
    else:
        raise TypeError(f"model_or_weights: expected a torch.nn.Module or a state dict, got {type(model_or_weights).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[tuple[WeightArgs, str], list[str]] = {}
    for name, w in state.items():
        if not isinstance(w, AffineQuantizedTensor):
            tensors[name] = w
            continue
        prefix, _, attr = name.rpartition(".")
        if attr != "weight":
            raise ValueError(f"to_compressed_tensors: {name!r}: compressed-tensors quantizes parameters named 'weight' only")
        plain = w.to_plain()
        args, codes, zero = _export_args(name, w, plain)
        fmt = formats.get(prefix, default)
        n, k = plain.shape
        perm = w.input_perm
        if perm is not None:
            inverse = torch.argsort(perm.long())
            codes = codes.index_select(1, inverse).contiguous()  # back in input order
            if args.actorder == "group":
                tensors[_key(prefix, "weight_g_idx")] = (inverse // args.group_size).to(torch.int32)  # type: ignore[operator]
        scale_shape = {"tensor": (1,), "channel": (n, 1)}.get(args.strategy, args.grid(n, k))
        if fmt == PACKED:
            tensors[_key(prefix, "weight_packed")] = pack_int32(codes, args.num_bits)
            tensors[_key(prefix, "weight_shape")] = torch.tensor([n, k], dtype=torch.int64)
        else:
            tensors[_key(prefix, "weight")] = codes.contiguous()
        tensors[_key(prefix, "weight_scale")] = plain.scale.reshape(scale_shape).contiguous()
        if zero is not None:
            if fmt == PACKED and args.strategy in ("group", "channel"):
                # the transpose of a row-major [G, words] tensor, as pack_to_int32(packed_dim=0) returns it
                zero = pack_int32(zero.reshape(args.grid(n, k)).t().contiguous(), args.num_bits).t()
            else:
                zero = zero.reshape(scale_shape).contiguous()
            tensors[_key(prefix, "weight_zero_point")] = zero
        groups.setdefault((args, fmt), []).append(prefix)
    quantized = {m for mods in groups.values() for m in mods}
    config_groups = {
        f"group_{i}": {"targets": sorted(mods), "weights": args.to_json(), "input_activations": None,
                       "output_activations": None, "format": fmt}
        for i, ((args, fmt), mods) in enumerate(groups.items())
    }
    used = {fmt for _, fmt in groups} or {default}
    config = {
        "quant_method": QUANT_METHOD,
        "format": used.pop() if len(used) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": [n for n in linears if n not in quantized],
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }
    return tensors, config
