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
from ..blockwise.codebooks import codebook
from ..canonical import FLOAT8_CODEBOOK, NestedScale, PlainForm, QuantSpec, decode_codes, encode_codes
from ..layouts.base import Layout, choose_layout
from ..primitives import ZeroPointDomain, expand_grid, scale_shape

__all__ = ["RowFormat", "row_format", "to_row_parts", "from_row_parts", "zero_plain", "pad_plain", "pack_in"]


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
               device: torch.device | str, *, nested: bool = False) -> PlainForm:
    """A plain form whose values are all 0 (scales 0, the code nearest 0, zero points 0): the
    padding rows of a shard. Double quantization is dropped (see the module doc) unless ``nested``
    and ``spec`` has it: then the scales are held double-quantized too (all 0), as the same weight's
    (``empty_like`` of a whole NF4 weight)."""
    keep = nested and spec.double_quant
    spec = spec if keep else dataclasses.replace(spec, double_quant=False)
    grid = scale_shape(shape, spec.block_size)
    code = min(max(0, spec.quant_min), spec.quant_max)
    codes = torch.full(shape, code, dtype=spec.code_dtype, device=device)
    zero = None if spec.zero_point_domain is ZeroPointDomain.NONE else torch.zeros(grid, dtype=zero_dtype, device=device)
    scale = torch.zeros(grid, dtype=scale_dtype, device=device)
    if not keep:
        return PlainForm(codes, scale, zero, spec)
    count = scale.numel()  # scale = dyn[127] * 0 + 0 = 0 for every code (dyn[127] is 0)
    nq = NestedScale(torch.full(grid, 127, dtype=torch.uint8, device=device),
                     torch.zeros(-(-count // 256), dtype=torch.float32, device=device),
                     torch.zeros((), dtype=torch.float32, device=device))
    return PlainForm(codes, scale, None, spec, nq)


def pad_plain(plain: PlainForm, rows: int, cols: int) -> PlainForm:
    """``plain`` with ``rows`` more rows and ``cols`` more columns at the end (DTensor's padding of
    uneven shards before a scatter), every original tensor value kept bit for bit.

    New blocks get scale 0 and zero point 0 (their values are 0). A block along dim 1 that spans
    the row spans the padded row (the padded columns share the row's scale; the block becomes the
    new width, as :meth:`~torchq.canonical.PlainForm.narrow` makes it), and padded elements inside
    an existing block take the code whose value is nearest 0 there: exactly 0 for every format but
    a float zero point (``(q - mid) * s + z``), whose nearest code is ``round(mid - z / s)``.
    Double-quantized scales become the fp32 scales they stand for."""
    if rows < 0 or cols < 0:
        raise ValueError(f"rows, cols: expected counts >= 0 to add, got {rows}, {cols}")
    spec = dataclasses.replace(plain.spec, double_quant=False)
    n, k = plain.shape
    shape = (n + rows, k + cols)
    b0, b1 = spec.block_size
    if cols and b1 >= k:
        b1 = max(shape[1], 1)
    spec = dataclasses.replace(spec, block_size=(b0, b1))
    grid = scale_shape(shape, spec.block_size)
    g0, g1 = plain.scale.shape
    scale = plain.scale.new_zeros(grid)
    scale[:g0, :g1] = plain.scale
    zero = None
    if plain.zero_point is not None:
        zero = plain.zero_point.new_zeros(grid)
        zero[:g0, :g1] = plain.zero_point
    codes = _codes_nearest_zero(spec, scale, zero, shape)
    codes[:n, :k] = plain.codes
    return PlainForm(codes, scale, zero, spec)


def _codes_nearest_zero(spec: QuantSpec, scale: torch.Tensor, zero: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
    """Per element of ``shape``, the code whose value is nearest 0 under its block's scale and zero point."""
    device = scale.device
    if spec.codebook is not None:  # the index of 0.0 in the table (nf4: 7, fp4 and e4m3fn bytes: 0)
        code = 0 if spec.codebook == FLOAT8_CODEBOOK else int((codebook(spec.codebook) == 0).nonzero()[0])
        return torch.full(shape, code, dtype=spec.code_dtype, device=device)
    domain = spec.zero_point_domain
    if domain is ZeroPointDomain.NONE:  # codes centred on 0
        return torch.zeros(shape, dtype=spec.code_dtype, device=device)
    z = expand_grid(zero, spec.block_size, shape)
    if domain is ZeroPointDomain.INT:  # (q - z) * s = 0 at q = z
        q = z.to(torch.int32)
    else:  # (q - mid) * s + z = 0 at q = mid - z / s (mid where s is 0)
        s = expand_grid(scale, spec.block_size, shape).to(torch.float32)
        off = torch.where(s == 0, 0.0, z.to(torch.float32) / torch.where(s == 0, 1.0, s))
        q = torch.round(spec.mid - off).nan_to_num(spec.mid).clamp(-2**20, 2**20).to(torch.int32)
    return q.clamp(spec.quant_min, spec.quant_max).to(spec.code_dtype)


def pack_in(layout: Layout, plain: PlainForm):
    """``layout.pack(plain)`` where the layout can hold it, else the best layout for it: a shard's
    shape can rule out the whole weight's layout (tile sizes)."""
    if not layout.fit(plain.spec, plain.shape, plain.scale.dtype, plain.device).holds:
        layout = choose_layout(plain.spec, plain.shape, plain.scale.dtype, plain.device)
    return layout.pack(plain)
