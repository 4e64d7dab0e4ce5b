"""Affine quantization primitives: choose_qparams / quantize / dequantize over any block size.

Notation (see the numerics spec): ``x`` high-precision input, ``q`` integer code, ``s`` scale,
``z`` zero point, ``qmin/qmax`` code range. ``round`` is round-half-to-even (``torch.round``).

``block_size`` has one entry per dimension: the extent that shares one ``(s, z)``. Per tensor is
the full shape, per channel of an ``[N, K]`` weight is ``(1, K)``, per group ``(1, g)``, per token
of ``[..., K]`` activations ``(1, ..., 1, K)``. A dimension that is not a multiple of its block
extent ends in a partial block; ``scale`` and ``zero_point`` have shape
``ceil(x.shape / block_size)`` (same number of dimensions as ``x``).

Zero-point domains:

* ``INT``:   ``q = clamp(round(x * (1/s)) + z, qmin, qmax)``;  ``x̂ = (q - z) * s``.
* ``NONE``:  ``q = clamp(round(x * (1/s)), qmin, qmax)``;      ``x̂ = q * s``  (symmetric, signed codes).
* ``FLOAT``: ``q = clamp(round((x - (z - mid*s)) / s), qmin, qmax)``; ``x̂ = (q - mid) * s + z``
  with ``mid = (qmax + qmin + 1) // 2`` (the int4 "tinygemm" numerics for codes 0..15, mid 8).

Arithmetic dtypes: ``choose_qparams_affine`` takes min/max in the input dtype (exact) and does
the scale arithmetic in ``scale_dtype``. ``quantize_affine`` computes in
``promote_types(x.dtype, scale.dtype)``; ``dequantize_affine`` computes ``(q - z)`` exactly in
int32 and multiplies in the scale's dtype, then casts once to ``output_dtype``. These orders are
bit-equal to ``torch.ops.quantized_decomposed`` where the schemes overlap.

The functions here are plain traceable PyTorch; the same computations are registered as
``torch.ops.torchq.{choose_qparams_affine, quantize_affine, dequantize_affine}`` with fake
implementations. Non-finite inputs give non-finite scales: callers that hold data (weights)
check ``isfinite`` before calling (``AffineQuantizedTensor.from_float`` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

import torch

from .division import divide
from .serialization import reduce_enum, register_kind

__all__ = [
    "MappingType",
    "ZeroPointDomain",
    "code_range",
    "dtype_code_range",
    "scale_shape",
    "choose_qparams_affine",
    "quantize_affine",
    "dequantize_affine",
    "fake_quantize_affine",
]


class MappingType(StrEnum):
    """How the float range of a block maps onto the code range."""

    SYMMETRIC = "symmetric"
    SYMMETRIC_NO_CLIPPING_ERR = "symmetric_no_clipping_err"
    ASYMMETRIC = "asymmetric"

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __reduce_ex__(self, proto):
        return reduce_enum("mapping_type", self.value)


class ZeroPointDomain(StrEnum):
    """Where the zero point lives: an integer code, a float offset, or nowhere."""

    INT = "int"
    FLOAT = "float"
    NONE = "none"

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __reduce_ex__(self, proto):
        return reduce_enum("zero_point_domain", self.value)


register_kind("mapping_type", MappingType)
register_kind("zero_point_domain", ZeroPointDomain)

_INTEGER_CODE_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32)


def code_range(bits: int, signed: bool) -> tuple[int, int]:
    """The code range of a ``bits``-wide integer: ``[-2^(b-1), 2^(b-1)-1]`` or ``[0, 2^b-1]``."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits: expected an int in 1..8, got {bits!r}")
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


def dtype_code_range(dtype: torch.dtype) -> tuple[int, int]:
    """The full range of an integer code dtype."""
    if dtype not in _INTEGER_CODE_DTYPES:
        raise TypeError(f"target_dtype: expected one of {_INTEGER_CODE_DTYPES}, got {dtype}")
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


def _resolve_range(dtype: torch.dtype, qmin: int | None, qmax: int | None) -> tuple[int, int]:
    lo, hi = dtype_code_range(dtype)
    qmin = lo if qmin is None else int(qmin)
    qmax = hi if qmax is None else int(qmax)
    if not lo <= qmin < qmax <= hi:
        raise ValueError(
            f"quant_min/quant_max: expected {lo} <= quant_min < quant_max <= {hi} for {dtype}, "
            f"got quant_min={qmin}, quant_max={qmax}"
        )
    return qmin, qmax


def _check_block_size(shape: Sequence[int], block_size: Sequence[int], allow_empty: bool = False) -> tuple[int, ...]:
    block_size = tuple(int(b) for b in block_size)
    if len(block_size) != len(shape):
        raise ValueError(
            f"block_size: expected {len(shape)} entries (one per dimension of shape "
            f"{tuple(shape)}), got {block_size}"
        )
    if any(b < 1 for b in block_size):
        raise ValueError(f"block_size: expected every entry >= 1, got {block_size}")
    if not allow_empty and any(s == 0 for s in shape):
        raise ValueError(f"input: expected a non-empty tensor, got shape {tuple(shape)}")
    return block_size


def scale_shape(shape: Sequence[int], block_size: Sequence[int]) -> tuple[int, ...]:
    """Shape of the scale / zero-point grid: ``ceil(shape / block_size)`` per dimension (0 where
    ``shape`` is 0: a shard without rows)."""
    block_size = _check_block_size(shape, block_size, allow_empty=True)
    return tuple(-(-s // b) for s, b in zip(shape, block_size))


def _pad_to_blocks(x: torch.Tensor, block_size: tuple[int, ...]) -> torch.Tensor:
    """Pad each dimension up to a multiple of its block by repeating the last element.

    Repeating an element of the same (partial) block leaves every block's min, max and
    absmax unchanged; the padded outputs of element-wise ops are sliced off by the caller. A
    block longer than its dimension is the whole dimension (never padded up to the block).
    """
    for dim, (s, b) in enumerate(zip(x.shape, block_size)):
        extra = -s % min(b, s)
        if extra:
            edge = x.narrow(dim, s - 1, 1)
            x = torch.cat([x, edge.expand(*[extra if d == dim else -1 for d in range(x.dim())])], dim)
    return x


def _blocked(x: torch.Tensor, block_size: tuple[int, ...]) -> torch.Tensor:
    """View a (padded) tensor as ``[n0, b0, n1, b1, ...]``."""
    shape: list[int] = []
    for s, b in zip(x.shape, block_size):
        b = min(b, s)
        shape += [s // b, b]
    return x.reshape(shape)


def _grid_view(t: torch.Tensor) -> torch.Tensor:
    """View a grid ``[n0, n1, ...]`` as ``[n0, 1, n1, 1, ...]`` to broadcast over blocks."""
    shape: list[int] = []
    for n in t.shape:
        shape += [n, 1]
    return t.reshape(shape)


def expand_grid(t: torch.Tensor, block_size: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """A grid ``ceil(shape / block_size)`` repeated to ``shape``: each block's value on its elements.

    Gathers by block index (``index_select``): inductor (torch 2.13) miscompiles the equivalent
    ``repeat_interleave`` or expand + reshape followed by a slice to a partial last block."""
    for dim, (s, b) in enumerate(zip(shape, block_size)):
        if t.shape[dim] != s:
            t = t.index_select(dim, torch.arange(s, device=t.device) // min(b, s))
    return t


def _blockwise(x: torch.Tensor, block_size: tuple[int, ...], fn, *grids: torch.Tensor | None):
    """Apply ``fn(blocked_x, *blocked_grids)`` element-wise and return a tensor of x's shape.

    With partial blocks, ``fn`` gets x and the grids repeated to x's shape (:func:`expand_grid`)
    instead: the same element-wise values, where padding x to whole blocks and slicing the result
    back is miscompiled by inductor (torch 2.13: garbage in kept elements)."""
    shape = tuple(x.shape)
    if any(s % min(b, s) for s, b in zip(shape, block_size)):
        return fn(x, *[None if g is None else expand_grid(g, block_size, shape) for g in grids])
    out = fn(_blocked(x, block_size), *[None if g is None else _grid_view(g) for g in grids])
    return out.reshape(shape)


def _block_min_max(x: torch.Tensor, block_size: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    xb = _blocked(_pad_to_blocks(x, block_size), block_size)
    dims = tuple(range(1, xb.dim(), 2))
    return torch.amin(xb, dim=dims), torch.amax(xb, dim=dims)


def mid_code(qmin: int, qmax: int) -> int:
    """The code at the middle of ``[qmin, qmax]`` (the symmetric zero point, rounded up)."""
    return (qmax + qmin + 1) // 2


def choose_qparams_affine(
    x: torch.Tensor,
    mapping_type: MappingType | str,
    block_size: Sequence[int],
    target_dtype: torch.dtype,
    quant_min: int | None = None,
    quant_max: int | None = None,
    eps: float | None = None,
    scale_dtype: torch.dtype | None = None,
    zero_point_dtype: torch.dtype | None = None,
    zero_point_domain: ZeroPointDomain | str = ZeroPointDomain.INT,
    preserve_zero: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-block ``(scale, zero_point)`` for ``x``; ``zero_point`` is None for ``ZeroPointDomain.NONE``.

    ``lo = min(min(x), 0)``, ``hi = max(max(x), 0)`` per block when ``preserve_zero`` (raw
    min/max otherwise), then

    * SYMMETRIC: ``s = max(-lo, hi) / ((qmax - qmin) / 2)``, ``z = (qmax + qmin + 1) // 2``
    * SYMMETRIC_NO_CLIPPING_ERR: ``s = max(lo / qmin, hi / qmax)``, same ``z``
    * ASYMMETRIC: ``s = (hi - lo) / (qmax - qmin)``; INT: ``z = clamp(qmin - round(lo / s), qmin, qmax)``,
      FLOAT: ``z = lo + mid * s``

    and ``s = clamp(s, min=eps)`` (before ``z`` is computed). ``eps`` defaults to the machine
    epsilon of ``scale_dtype``; ``scale_dtype`` defaults to ``x.dtype``; ``zero_point_dtype``
    defaults to ``target_dtype`` (INT) or ``scale_dtype`` (FLOAT).
    """
    mapping_type = MappingType(mapping_type)
    zero_point_domain = ZeroPointDomain(zero_point_domain)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    block_size = _check_block_size(x.shape, block_size)
    qmin, qmax = _resolve_range(target_dtype, quant_min, quant_max)
    scale_dtype = x.dtype if scale_dtype is None else scale_dtype
    if not scale_dtype.is_floating_point:
        raise TypeError(f"scale_dtype: expected a floating dtype, got {scale_dtype}")
    eps = torch.finfo(scale_dtype).eps if eps is None else float(eps)
    if not eps > 0:
        raise ValueError(f"eps: expected > 0, got {eps}")
    mid = mid_code(qmin, qmax)
    if zero_point_domain is ZeroPointDomain.FLOAT and mapping_type is not MappingType.ASYMMETRIC:
        raise ValueError(
            f"zero_point_domain: FLOAT needs mapping_type ASYMMETRIC, got {mapping_type.name}"
        )
    if zero_point_domain is ZeroPointDomain.NONE and (mapping_type is MappingType.ASYMMETRIC or mid != 0):
        raise ValueError(
            "zero_point_domain: NONE needs a symmetric mapping over signed codes (zero point 0), "
            f"got {mapping_type.name} with codes [{qmin}, {qmax}]"
        )
    if mapping_type is MappingType.SYMMETRIC_NO_CLIPPING_ERR and not qmin < 0 < qmax:
        raise ValueError(
            f"mapping_type: SYMMETRIC_NO_CLIPPING_ERR needs quant_min < 0 < quant_max, got [{qmin}, {qmax}]"
        )

    lo, hi = _block_min_max(x, block_size)
    lo, hi = lo.to(scale_dtype), hi.to(scale_dtype)
    if preserve_zero:
        lo = torch.clamp(lo, max=0)
        hi = torch.clamp(hi, min=0)
    if mapping_type is MappingType.SYMMETRIC:
        scale = divide(torch.maximum(-lo, hi), (qmax - qmin) / 2)
    elif mapping_type is MappingType.SYMMETRIC_NO_CLIPPING_ERR:
        scale = torch.maximum(divide(lo, qmin), divide(hi, qmax))
    else:
        scale = divide(hi - lo, qmax - qmin)
    scale = torch.clamp(scale, min=eps)

    if zero_point_domain is ZeroPointDomain.NONE:
        return scale, None
    if zero_point_domain is ZeroPointDomain.FLOAT:
        zdtype = scale_dtype if zero_point_dtype is None else zero_point_dtype
        return scale, (lo + scale * mid).to(zdtype)
    zdtype = target_dtype if zero_point_dtype is None else zero_point_dtype
    if mapping_type is MappingType.ASYMMETRIC:
        zero = torch.clamp(qmin - torch.round(lo / scale), qmin, qmax)
    else:
        zero = torch.full_like(scale, mid)
    return scale, zero.to(zdtype)


def _check_grid(name: str, t: torch.Tensor | None, grid: tuple[int, ...], required: bool) -> None:
    if t is None:
        if required:
            raise ValueError(f"{name}: required for this zero_point_domain, got None")
        return
    if tuple(t.shape) != grid and t.numel() != math.prod(grid):
        raise ValueError(f"{name}: expected shape {grid} (ceil(shape / block_size)), got {tuple(t.shape)}")


def quantize_affine(
    x: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    output_dtype: torch.dtype,
    quant_min: int | None = None,
    quant_max: int | None = None,
    zero_point_domain: ZeroPointDomain | str = ZeroPointDomain.INT,
) -> torch.Tensor:
    """Integer codes of ``x`` (dtype ``output_dtype``) for the given per-block scale and zero point."""
    zero_point_domain = ZeroPointDomain(zero_point_domain)
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    block_size = _check_block_size(x.shape, block_size)
    qmin, qmax = _resolve_range(output_dtype, quant_min, quant_max)
    grid = scale_shape(x.shape, block_size)
    _check_grid("scale", scale, grid, True)
    _check_grid("zero_point", zero_point, grid, zero_point_domain is not ZeroPointDomain.NONE)
    scale = scale.reshape(grid)
    zero_point = None if zero_point is None else zero_point.reshape(grid)
    mid = mid_code(qmin, qmax)

    def fn(xb: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        if zero_point_domain is ZeroPointDomain.FLOAT:
            min_val = z - s * mid
            q = torch.round((xb - min_val) / s)
        else:
            q = torch.round(xb * (1.0 / s))
            if zero_point_domain is ZeroPointDomain.INT:
                q = q + z
        return torch.clamp(q, qmin, qmax).to(output_dtype)

    if zero_point_domain is ZeroPointDomain.NONE:
        zero_point = None
    return _blockwise(x, block_size, fn, scale, zero_point)


def dequantize_affine(
    codes: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    quant_min: int | None = None,
    quant_max: int | None = None,
    zero_point_domain: ZeroPointDomain | str = ZeroPointDomain.INT,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Float values of integer ``codes``: ``(q - z) * s``, ``q * s`` or ``(q - mid) * s + z``."""
    zero_point_domain = ZeroPointDomain(zero_point_domain)
    if codes.is_floating_point() or codes.is_complex() or codes.dtype == torch.bool:
        raise TypeError(f"codes: expected an integer tensor, got {codes.dtype}")
    block_size = _check_block_size(codes.shape, block_size)
    qmin, qmax = _resolve_range(codes.dtype, quant_min, quant_max)
    grid = scale_shape(codes.shape, block_size)
    _check_grid("scale", scale, grid, True)
    _check_grid("zero_point", zero_point, grid, zero_point_domain is not ZeroPointDomain.NONE)
    scale = scale.reshape(grid)
    zero_point = None if zero_point is None else zero_point.reshape(grid)
    mid = mid_code(qmin, qmax)

    def fn(qb: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        q = qb.to(torch.int32)
        if zero_point_domain is ZeroPointDomain.FLOAT:
            return ((q - mid) * s + z).to(output_dtype)
        if zero_point_domain is ZeroPointDomain.INT:
            q = q - z.to(torch.int32)
        return (q * s).to(output_dtype)

    if zero_point_domain is ZeroPointDomain.NONE:
        zero_point = None
    return _blockwise(codes, block_size, fn, scale, zero_point)


def fake_quantize_affine(
    x: torch.Tensor,
    block_size: Sequence[int],
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    code_dtype: torch.dtype,
    quant_min: int | None = None,
    quant_max: int | None = None,
    zero_point_domain: ZeroPointDomain | str = ZeroPointDomain.INT,
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype."""
    q = quantize_affine(x, block_size, scale, zero_point, code_dtype, quant_min, quant_max, zero_point_domain)
    return dequantize_affine(q, block_size, scale, zero_point, quant_min, quant_max, zero_point_domain, x.dtype)
