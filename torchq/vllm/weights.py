"""One vLLM linear layer's torchq weight: the parameters each rank allocates for its shard, and the
quantized weight they become (imports no vLLM).

A vLLM linear layer may fuse several checkpoint weights along its output rows (``qkv_proj`` from
``q_proj``, ``k_proj``, ``v_proj``; ``gate_up_proj`` from ``gate_proj``, ``up_proj``), and a rank
holds some rows of each (column-parallel) or some input columns of all rows (row-parallel). The
checkpoint stores each weight as the parts of its device-independent record
(:mod:`torchq.checkpoint.codec`), all of whose leading dimension is the weight's rows, so a rank's
parameters are those parts cut the way vLLM cuts a float weight:

* ``tq_codes``: the codes as stored: ``[rows, ceil(k/8)*b]`` uint8 bit streams (``b < 8`` bits;
  cutting ``k`` input features at a multiple of 8 cuts the bytes there), or the 8-bit codes
  ``[rows, k]`` (int8 / uint8 / float8_e4m3fn);
* ``tq_scale``, ``tq_zero_point``: ``[rows, k/g]`` (groups of ``g`` input features; a rank's input
  features are whole groups), or ``[rows, 1]`` for one group per row, which every rank of a
  row-parallel layer keeps whole;
* double-quantized scales (NF4/FP4): ``tq_scale_codes``, ``tq_scale_absmax``, ``tq_scale_offset``,
  each checkpoint weight's whole (they are 1 byte per group plus 4 per 256 groups), turned into
  the fp32 ``tq_scale`` after loading;
* ``tq_input_scale`` (AWQ) and ``tq_input_perm`` (activation order): ``[k]``, whole.

After loading, the parts become a :class:`torchq.canonical.PlainForm` and are packed into the
layout the device prefers (or the checkpoint's, per the layout policy): nothing is dequantized.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ..activation import PerTokenInt8, StaticInt8
from ..bitpack import packed_width
from ..blockwise.nested import double_dequantize
from ..canonical import QuantSpec, decode_codes
from ..checkpoint.codec import CheckpointError, LayoutPolicy, ParsedRecord, check_values, pack_plain
from ..layouts.int8_vnni import Int8VnniLayout
from ..primitives import ZeroPointDomain
from ..tensor import AffineQuantizedTensor

__all__ = ["PartPlan", "ShardPlan", "plan_shard", "build_weight", "whole_offsets"]

WHOLE_PARTS = ("scale_codes", "scale_absmax", "scale_offset", "input_scale", "input_perm")


@dataclasses.dataclass(frozen=True)
class PartPlan:
    """One parameter of the layer: its dtype and local shape; ``output_dim`` / ``input_dim`` (0 /
    1, or None) as vLLM's loaders read them; ``whole``: each fused weight's part is kept whole, one
    after the other in a flat parameter."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    output_dim: int | None
    input_dim: int | None
    whole: bool = False


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """What one rank holds of one layer: ``rows`` output rows (the fused weights' local rows one
    after the other), ``k_local`` of ``k`` input features starting at ``k_start``; the spec the
    local weight is quantized with; the parameters."""

    names: tuple[str, ...]
    records: tuple[ParsedRecord, ...]
    rows: int
    k: int
    k_local: int
    k_start: int
    spec: QuantSpec
    parts: tuple[PartPlan, ...]

    @property
    def record(self) -> ParsedRecord:
        return self.records[0]

    def part(self, name: str) -> PartPlan | None:
        return next((p for p in self.parts if p.name == name), None)


def _signature(rec: ParsedRecord) -> tuple:
    """What fused weights must share to be one quantized weight."""
    dtypes = tuple(sorted((p, d) for p, (d, _, _) in rec.parts.items()))
    return (rec.spec, rec.encoding, rec.dtype, rec.act_quant, rec.compute_dtype, rec.transposed, dtypes)


def plan_shard(prefix: str, names: Sequence[str], records: Sequence[ParsedRecord], local_rows: Sequence[int],
               k: int, k_local: int, k_start: int, full_rows: Sequence[int] | None = None) -> ShardPlan:
    """The parameters of layer ``prefix`` on this rank: the fused checkpoint weights ``names``
    (their ``records``), of which it holds ``local_rows[i]`` rows each and input features
    ``[k_start, k_start + k_local)`` of ``k``; ``full_rows[i]``: the rows the model gives weight
    ``i`` on all ranks, which its record must have (vLLM's loaders cut a rank's rows out of a
    longer weight without a word, and stop with an error naming nothing at a shorter one). A
    CheckpointError (naming the layer) for weights that cannot be served this way."""
    where = f"vLLM layer {prefix!r}"
    first = records[0]
    for name, rec in zip(names, records):
        if _signature(rec) != _signature(first):
            raise CheckpointError(
                f"{where}: vLLM fuses {list(names)} into one layer, but {name!r} is quantized differently from "
                f"{names[0]!r} ({rec.spec.describe()} vs {first.spec.describe()}, or another dtype, activation "
                f"quantization or part); quantize the fused weights alike"
            )
        if rec.transposed:
            raise CheckpointError(f"{where}: {name!r} is stored transposed; vLLM linear weights are [out, in]")
        if rec.shape[1] != k:
            raise CheckpointError(f"{where}: {name!r} has {rec.shape[1]} input features, the model {k}")
    if full_rows is not None:
        if len(full_rows) != len(names):
            raise CheckpointError(f"{where}: the model has {len(full_rows)} weights here, the checkpoint {list(names)}")
        for name, rec, rows in zip(names, records, full_rows):
            if rec.shape[0] != rows:
                raise CheckpointError(f"{where}: {name!r} has {rec.shape[0]} output rows, the model {rows}")
    spec = first.spec
    if spec.block_size[0] != 1:
        raise CheckpointError(
            f"{where}: {spec.describe()} has blocks spanning {spec.block_size[0]} rows; vLLM cuts and fuses weights by "
            f"rows, so torchq serves formats whose scales are per row or per group of a row"
        )
    g = spec.block_size[1]
    per_row = g >= k
    sharded_cols = k_local != k
    if sharded_cols:
        if not per_row and k_local % g:
            raise CheckpointError(
                f"{where}: each rank holds {k_local} of the {k} input features, which cuts groups of {g}; serve it with "
                f"a tensor-parallel size that splits {k} into multiples of {g}"
            )
        if first.encoding == "bitstream" and k_local % 8:
            raise CheckpointError(
                f"{where}: each rank holds {k_local} of the {k} input features, which cuts a byte of {spec.bits}-bit "
                f"codes; serve it with a tensor-parallel size that splits {k} into multiples of 8"
            )
        if "input_perm" in first.parts:
            raise CheckpointError(f"{where}: an input permutation (activation-order weights) cannot be split across "
                                  f"ranks by input features; serve it without tensor parallelism")
    rows = sum(local_rows)
    in_dim = 1 if sharded_cols else None
    parts: list[PartPlan] = []
    dtype, _, _ = first.parts["codes"]
    width = packed_width(k_local, spec.bits) if first.encoding == "bitstream" else k_local
    parts.append(PartPlan("codes", dtype, (rows, width), 0, in_dim))
    groups = 1 if per_row else k_local // g if sharded_cols else math.ceil(k / g)
    group_dim = None if per_row else in_dim
    if spec.double_quant:
        parts.append(PartPlan("scale", torch.float32, (rows, groups), 0, group_dim))
        for p in ("scale_codes", "scale_absmax", "scale_offset"):
            d, _, _ = first.parts[p]
            size = sum(max(1, math.prod(rec.parts[p][1])) for rec in records)
            parts.append(PartPlan(p, d, (size,), None, None, whole=True))
    else:
        parts.append(PartPlan("scale", first.parts["scale"][0], (rows, groups), 0, group_dim))
    if "zero_point" in first.parts:
        parts.append(PartPlan("zero_point", first.parts["zero_point"][0], (rows, groups), 0, group_dim))
    for p in ("input_scale", "input_perm"):
        if p in first.parts:
            parts.append(PartPlan(p, first.parts[p][0], (len(records) * k,), None, None, whole=True))
    local_spec = spec
    if per_row or spec.double_quant:
        local_spec = QuantSpec((1, k_local if per_row else g), spec.quant_min, spec.quant_max, spec.zero_point_domain,
                               spec.codebook, False)
    return ShardPlan(tuple(names), tuple(records), rows, k, k_local, k_start, local_spec, tuple(parts))


def whole_offsets(plan: ShardPlan, part: str) -> list[tuple[int, int]]:
    """``(start, length)`` of each fused weight's whole ``part`` in its flat parameter."""
    out, start = [], 0
    for rec in plan.records:
        n = plan.k if part in ("input_scale", "input_perm") else max(1, math.prod(rec.parts[part][1]))
        out.append((start, n))
        start += n
    return out


def nested_scale(plan: ShardPlan, params: dict[str, torch.Tensor], index: int) -> torch.Tensor:
    """The fp32 scales ``[N_i, groups]`` of fused weight ``index`` from its double-quantized form."""
    rec = plan.records[index]
    (c0, cn), (a0, an), (o0, _) = (whole_offsets(plan, p)[index] for p in ("scale_codes", "scale_absmax", "scale_offset"))
    absmax, offset = params["scale_absmax"][a0:a0 + an], params["scale_offset"][o0]
    where = f"quantized tensor {plan.names[index]!r}"
    if not bool(torch.isfinite(absmax).all() and torch.isfinite(offset)):
        raise CheckpointError(f"{where}: double-quantized scale statistics contain NaN/inf")
    return double_dequantize(params["scale_codes"][c0:c0 + cn], absmax, offset).reshape(rec.parts["scale_codes"][1])


def _same_whole(plan: ShardPlan, params: dict[str, torch.Tensor], part: str, prefix: str) -> torch.Tensor | None:
    if plan.part(part) is None:
        return None
    pieces = [params[part][s:s + n] for s, n in whole_offsets(plan, part)]
    if any(not torch.equal(p, pieces[0]) for p in pieces[1:]):
        raise CheckpointError(f"vLLM layer {prefix!r}: vLLM fuses {list(plan.names)}, whose {part} differ; one "
                              f"quantized weight has one {part}")
    return pieces[0][plan.k_start:plan.k_start + plan.k_local].contiguous()


def serving_layout(policy: LayoutPolicy, rec: ParsedRecord, spec: QuantSpec, shape: tuple[int, ...], scale_dtype: torch.dtype,
                   device: torch.device) -> LayoutPolicy:
    """``policy``, except that under ``"auto"`` an int8 per-channel weight with int8 activations
    (per token or static) is served in :class:`~torchq.layouts.int8_vnni.Int8VnniLayout` where its
    fit allows automatic placement (CPUs whose int8 kernels use VNNI): its activation kernels beat
    the plain layout's there at 1-64 rows (a decode batch; 1.05-1.6x on a Zen 4) and are within 4%
    of them at 256 (a prompt; docs/vllm.md). A weight-only int8 weight stays ``plain``: its kernels
    sum in the row-major order, so on panels they run on unpacked rows (slower than plain at every
    row count measured). torchq's general automatic choice does not take it: a layout's fit sees
    the format, not the activation scheme, and LLM.int8 weights share the format."""
    act = rec.act_quant
    if policy != "auto" or type(act) not in (PerTokenInt8, StaticInt8):
        return policy
    layout = Int8VnniLayout()
    return layout if layout.fit(spec, shape, scale_dtype, device).automatic else policy


def build_weight(plan: ShardPlan, params: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype,
                 layout: LayoutPolicy = "auto") -> AffineQuantizedTensor:
    """The rank's quantized weight ``[rows, k_local]`` from its loaded parameters ``params`` (part
    name -> tensor; ``scale`` already filled for double-quantized formats), packed per ``layout``
    on the parameters' device; ``dtype``: the model's (its outputs' dtype)."""
    rec, spec = plan.record, plan.spec
    where = f"vLLM layer {prefix!r} ({', '.join(plan.names)})"
    codes = decode_codes(params["codes"], spec, plan.k_local, rec.encoding, where)
    scale = params["scale"]
    zero = params.get("zero_point")
    in_scale = _same_whole(plan, params, "input_scale", prefix)
    in_perm = _same_whole(plan, params, "input_perm", prefix)
    check_values(where, scale, zero, in_scale, in_perm, plan.k)
    if spec.zero_point_domain is ZeroPointDomain.NONE:
        zero = None
    layout = serving_layout(layout, rec, spec, tuple(codes.shape), scale.dtype, codes.device)
    impl = pack_plain(where, codes.contiguous(), scale.contiguous(), None if zero is None else zero.contiguous(), spec, None,
                      layout, rec.saved_layout)
    return AffineQuantizedTensor(impl, dtype, act_quant=rec.act_quant, label=prefix, config=rec.config,
                                 compute_dtype=rec.compute_dtype, input_scale=in_scale, input_perm=in_perm)
