"""Row parts: a quantized weight as rows-leading tensors that shard, gather and save along dim 0.

Every layout converts to the canonical plain form; the row parts are that form with sub-byte
codes bit-packed along each row, so that cutting the parts at any row cuts the weight there and
nothing else. For an ``[N, K]`` weight of ``b``-bit codes in groups of ``g`` along K:

* ``codes``  as checkpoints store them (:func:`torchq.canonical.encode_codes`): uint8
  ``[N, ceil(K/8)*b]``, one bit stream of ``code - quant_min`` per row, for ``b < 8``; the 8-bit
  codes themselves (int8 or uint8) ``[N, K]`` for ``b = 8``;
* ``scale``  ``[N, ceil(K/g)]`` in the scales' dtype;
* ``zero_point`` ``[N, ceil(K/g)]`` in its dtype, for formats that have one.

A row's parts depend on that row only, so blocks and groups are never split: formats whose
blocks span several rows (``block_size[0] > 1``, e.g. per-tensor scales) have no row parts and
get a ValueError that says so. Double-quantized scales (NF4/FP4 ``double_quant``) travel as the
fp32 scales they reconstruct to (bit-equal values): their 256-scale nested blocks run across
rows, so a row range cannot carry them. The bytes per weight are then ``b/8 + 4/g`` instead of
``b/8 + ~1/g``.

FSDP2's all-gather (:mod:`torchq.distributed.fsdp`) and distributed checkpoints
(:mod:`torchq.distributed.checkpoint`) move these parts; the float weight is never formed.
"""

from __future__ import annotations

import dataclasses

import torch

from ..bitpack import packed_width
from ..canonical import PlainForm, QuantSpec, decode_codes, encode_codes
from ..layouts.base import Layout, choose_layout
from ..primitives import ZeroPointDomain, scale_shape

__all__ = ["RowFormat", "row_format", "to_row_parts", "from_row_parts", "zero_plain"]


@dataclasses.dataclass(frozen=True)
class RowFormat:
    """What the row parts of one weight are: the spec they decode to (never double-quantized),
    ``k`` (input features), the part names in order, and each part's dtype and width (its size
    along dim 1)."""

    spec: QuantSpec
    k: int
    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    widths: tuple[int, ...]

    def row_bytes(self) -> int:
        """Bytes one row of the weight takes in its parts."""
        return sum(w * d.itemsize for w, d in zip(self.widths, self.dtypes))

    def empty(self, rows: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """Zero-filled parts for ``rows`` rows (padding rows dequantize to 0: their scales are 0)."""
        return tuple(torch.zeros(rows, w, dtype=d, device=device) for w, d in zip(self.widths, self.dtypes))


def _check_rows_independent(spec: QuantSpec, what: str) -> None:
    if spec.block_size[0] != 1:
        raise ValueError(
            f"{what}: its quantization blocks span {spec.block_size[0]} rows ({spec.describe()}), so it cannot be "
            f"cut into row shards without splitting a block; quantize it with one scale per row or group of a row"
        )


def row_format(spec: QuantSpec, k: int, scale_dtype: torch.dtype, zero_dtype: torch.dtype | None,
               what: str = "weight") -> RowFormat:
    """The :class:`RowFormat` of a weight with ``k`` input features, scales of ``scale_dtype`` and
    zero points of ``zero_dtype`` (None: no zero point)."""
    _check_rows_independent(spec, what)
    spec = dataclasses.replace(spec, double_quant=False)
    groups = scale_shape((1, k), spec.block_size)[1]
    bits = spec.bits
    code_part = (torch.uint8, packed_width(k, bits)) if bits < 8 else (spec.code_dtype, k)
    names, dtypes, widths = ["codes", "scale"], [code_part[0], scale_dtype], [code_part[1], groups]
    if spec.zero_point_domain is not ZeroPointDomain.NONE:
        if zero_dtype is None:
            raise ValueError(f"{what}: {spec.describe()} needs a zero-point dtype")
        names.append("zero_point")
        dtypes.append(zero_dtype)
        widths.append(groups)
    return RowFormat(spec, k, tuple(names), tuple(dtypes), tuple(widths))


def _single_quantized(plain: PlainForm) -> PlainForm:
    if plain.nested is None:
        return plain
    return PlainForm(plain.codes, plain.scale, plain.zero_point, dataclasses.replace(plain.spec, double_quant=False))


def to_row_parts(plain: PlainForm, what: str = "weight") -> tuple[RowFormat, tuple[torch.Tensor, ...]]:
    """The row parts of ``plain`` (fresh contiguous tensors, or the plain form's own where no
    packing is needed) and their :class:`RowFormat`."""
    plain = _single_quantized(plain)
    spec = plain.spec
    fmt = row_format(spec, plain.shape[1], plain.scale.dtype, None if plain.zero_point is None else plain.zero_point.dtype, what)
    codes, _ = encode_codes(plain.codes, spec)
    parts = [codes.contiguous(), plain.scale.contiguous()]
    if plain.zero_point is not None:
        parts.append(plain.zero_point.contiguous())
    return fmt, tuple(parts)


def from_row_parts(fmt: RowFormat, parts: tuple[torch.Tensor, ...] | list[torch.Tensor], what: str = "row parts") -> PlainForm:
    """The plain form the row parts hold (their row count is the weight's). Checks each part's
    dtype and width against ``fmt`` and every code against the format's range (a
    :class:`~torchq.checkpoint.CheckpointError` naming ``what``)."""
    if len(parts) != len(fmt.names):
        raise ValueError(f"{what}: expected {len(fmt.names)} tensors ({', '.join(fmt.names)}), got {len(parts)}")
    rows = parts[0].shape[0] if parts[0].dim() == 2 else -1
    for name, t, dtype, width in zip(fmt.names, parts, fmt.dtypes, fmt.widths):
        if t.dim() != 2 or t.dtype != dtype or t.shape[1] != width or t.shape[0] != rows:
            raise ValueError(
                f"{what}: {name}: expected {dtype} [{rows}, {width}], got {t.dtype} {list(t.shape)}"
            )
    spec = fmt.spec
    codes = decode_codes(parts[0], spec, fmt.k, "bitstream" if spec.bits <= 7 else "bytes", what)
    zero = parts[2] if len(parts) > 2 else None
    return PlainForm(codes, parts[1], zero, spec)


def zero_plain(spec: QuantSpec, shape: tuple[int, int], scale_dtype: torch.dtype, zero_dtype: torch.dtype | None,
               device: torch.device | str) -> PlainForm:
    """A plain form whose values are all 0 (scales 0, the code nearest 0, zero points 0): the
    padding rows of a shard. Double quantization is dropped (see the module doc)."""
    spec = dataclasses.replace(spec, double_quant=False)
    grid = scale_shape(shape, spec.block_size)
    code = min(max(0, spec.quant_min), spec.quant_max)
    codes = torch.full(shape, code, dtype=spec.code_dtype, device=device)
    zero = None if spec.zero_point_domain is ZeroPointDomain.NONE else torch.zeros(grid, dtype=zero_dtype, device=device)
    return PlainForm(codes, torch.zeros(grid, dtype=scale_dtype, device=device), zero, spec)


def pack_in(layout: Layout, plain: PlainForm):
    """``layout.pack(plain)`` where the layout can hold it, else the best layout for it: a shard's
    shape can rule out the whole weight's layout (tile sizes)."""
    if not layout.fit(plain.spec, plain.shape, plain.scale.dtype, plain.device).holds:
        layout = choose_layout(plain.spec, plain.shape, plain.scale.dtype, plain.device)
    return layout.pack(plain)
