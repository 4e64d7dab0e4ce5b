"""The canonical plain form every layout converts to and from without loss.

A quantized 2-D weight ``[N, K]`` is fully described by:

* ``codes``      integer tensor ``[N, K]``: int8 for signed code ranges, uint8 for unsigned ones
                 (one byte per code whatever the bit width);
* ``scale``      float tensor ``ceil([N, K] / block_size)``;
* ``zero_point`` tensor of the same shape (integer for ``ZeroPointDomain.INT``, float for
                 ``FLOAT``) or None for ``NONE``;
* ``spec``       a :class:`QuantSpec`: block size, code range and zero-point domain.

``PlainForm.dequantize`` is the reference meaning of every layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .primitives import ZeroPointDomain, dequantize_affine, scale_shape

__all__ = ["QuantSpec", "PlainForm", "code_dtype_for"]


def code_dtype_for(quant_min: int, quant_max: int) -> torch.dtype:
    """int8 for signed ranges within [-128, 127], uint8 for unsigned ranges within [0, 255]."""
    if -128 <= quant_min and quant_max <= 127 and quant_min < 0:
        return torch.int8
    if 0 <= quant_min and quant_max <= 255:
        return torch.uint8
    raise ValueError(f"code range: expected 8-bit signed or unsigned, got [{quant_min}, {quant_max}]")


@dataclass(frozen=True)
class QuantSpec:
    """Everything about a quantized weight except its tensors (hashable, JSON-friendly)."""

    block_size: tuple[int, ...]
    quant_min: int
    quant_max: int
    zero_point_domain: ZeroPointDomain

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", tuple(int(b) for b in self.block_size))
        object.__setattr__(self, "zero_point_domain", ZeroPointDomain(self.zero_point_domain))
        code_dtype_for(self.quant_min, self.quant_max)
        if self.quant_min >= self.quant_max:
            raise ValueError(f"quant_min/quant_max: expected quant_min < quant_max, got {self.quant_min}, {self.quant_max}")
        if self.zero_point_domain is ZeroPointDomain.NONE and self.mid != 0:
            raise ValueError(
                f"zero_point_domain: NONE means a zero point of 0, which needs a signed code range centred on 0; "
                f"got [{self.quant_min}, {self.quant_max}]"
            )

    @property
    def bits(self) -> int:
        """Bits needed per code: ``ceil(log2(quant_max - quant_min + 1))``."""
        return max(1, math.ceil(math.log2(self.quant_max - self.quant_min + 1)))

    @property
    def signed(self) -> bool:
        return self.quant_min < 0

    @property
    def code_dtype(self) -> torch.dtype:
        return code_dtype_for(self.quant_min, self.quant_max)

    @property
    def mid(self) -> int:
        return (self.quant_max + self.quant_min + 1) // 2

    def describe(self) -> str:
        dims = "x".join(str(b) for b in self.block_size)
        return f"{self.bits}-bit [{self.quant_min},{self.quant_max}] block {dims} zero={self.zero_point_domain.value}"

    def to_json(self) -> dict:
        return {
            "block_size": list(self.block_size),
            "quant_min": self.quant_min,
            "quant_max": self.quant_max,
            "zero_point_domain": self.zero_point_domain.value,
        }

    @classmethod
    def from_json(cls, d: dict) -> QuantSpec:
        """Inverse of ``to_json``; strict: exact fields, integers that are ints, a known domain."""
        if not isinstance(d, dict) or set(d) != {"block_size", "quant_min", "quant_max", "zero_point_domain"}:
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"spec JSON: expected fields block_size, quant_min, quant_max, zero_point_domain; got {got}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        block = d["block_size"]
        if not isinstance(block, list) or not block or not all(is_int(b) and b > 0 for b in block):
            raise ValueError(f"spec JSON: block_size must be a list of positive ints, got {block!r}")
        for k in ("quant_min", "quant_max"):
            if not is_int(d[k]):
                raise ValueError(f"spec JSON: {k} must be an int, got {d[k]!r}")
        if not isinstance(d["zero_point_domain"], str):
            raise ValueError(f"spec JSON: zero_point_domain must be a string, got {d['zero_point_domain']!r}")
        return cls(tuple(block), d["quant_min"], d["quant_max"], ZeroPointDomain(d["zero_point_domain"]))


@dataclass(frozen=True, eq=False)
class PlainForm:
    """Unpacked codes + scale + zero point + spec: the lossless interchange form of all layouts."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    spec: QuantSpec

    def __post_init__(self) -> None:
        self.validate()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def validate(self) -> None:
        """Raise ValueError/TypeError when tensors disagree with each other or with the spec."""
        spec = self.spec
        if self.codes.dtype != spec.code_dtype:
            raise TypeError(f"codes: expected dtype {spec.code_dtype} for range [{spec.quant_min}, {spec.quant_max}], got {self.codes.dtype}")
        grid = scale_shape(self.codes.shape, spec.block_size)
        if tuple(self.scale.shape) != grid:
            raise ValueError(f"scale: expected shape {grid}, got {tuple(self.scale.shape)}")
        if not self.scale.is_floating_point():
            raise TypeError(f"scale: expected a floating dtype, got {self.scale.dtype}")
        if spec.zero_point_domain is ZeroPointDomain.NONE:
            if self.zero_point is not None:
                raise ValueError("zero_point: expected None for zero_point_domain NONE")
        else:
            if self.zero_point is None:
                raise ValueError(f"zero_point: required for zero_point_domain {spec.zero_point_domain.name}")
            if tuple(self.zero_point.shape) != grid:
                raise ValueError(f"zero_point: expected shape {grid}, got {tuple(self.zero_point.shape)}")
            want_float = spec.zero_point_domain is ZeroPointDomain.FLOAT
            if self.zero_point.is_floating_point() != want_float:
                raise TypeError(
                    f"zero_point: expected a {'floating' if want_float else 'integer'} dtype for "
                    f"zero_point_domain {spec.zero_point_domain.name}, got {self.zero_point.dtype}"
                )
        for name in ("scale", "zero_point"):
            t = getattr(self, name)
            if t is not None and t.device != self.codes.device:
                raise ValueError(f"{name}: expected device {self.codes.device} (the codes' device), got {t.device}")

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {"codes": self.codes, "scale": self.scale, "zero_point": self.zero_point}

    def map(self, fn) -> PlainForm:
        """Apply ``fn`` to every tensor (e.g. ``.to(device)``, ``.clone()``)."""
        z = None if self.zero_point is None else fn(self.zero_point)
        return PlainForm(fn(self.codes), fn(self.scale), z, self.spec)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        s = self.spec
        return dequantize_affine(
            self.codes, s.block_size, self.scale, self.zero_point, s.quant_min, s.quant_max, s.zero_point_domain, dtype
        )

    def equal(self, other: PlainForm) -> bool:
        """Bit equality of tensors (dtypes included) and spec."""
        if self.spec != other.spec:
            return False
        for a, b in zip(self.tensors().values(), other.tensors().values()):
            if (a is None) != (b is None):
                return False
            if a is not None and (a.dtype != b.dtype or not torch.equal(a, b)):
                return False
        return True

    def narrow(self, dim: int, start: int, length: int) -> PlainForm:
        """Rows or columns ``[start, start+length)``; block boundaries must be respected."""
        size = self.codes.shape[dim]
        b = self.spec.block_size[dim]
        if start < 0 or length < 0 or start + length > size:
            raise IndexError(f"narrow: range [{start}, {start + length}) out of bounds for dim {dim} of size {size}")
        end = start + length
        if start % b or (end % b and end != size):
            raise ValueError(
                f"narrow: dim {dim} has quantization blocks of {b}; start and end must be multiples of {b} "
                f"(or end == {size}), got [{start}, {end})"
            )
        gs, ge = start // b, -(-end // b)

        def cut(t, lo, hi):
            return t.narrow(dim, lo, hi - lo)

        z = None if self.zero_point is None else cut(self.zero_point, gs, ge)
        return PlainForm(cut(self.codes, start, end), cut(self.scale, gs, ge), z, self.spec)

    def rows(self, index: torch.Tensor) -> PlainForm:
        """Gather rows (dim 0) by an index tensor; each row keeps its own block of scales."""
        b = self.spec.block_size[0]
        gi = torch.div(index, b, rounding_mode="floor")
        z = None if self.zero_point is None else self.zero_point[gi]
        spec = QuantSpec((1,) + self.spec.block_size[1:], self.spec.quant_min, self.spec.quant_max, self.spec.zero_point_domain)
        return PlainForm(self.codes[index], self.scale[gi], z, spec)
