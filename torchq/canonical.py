"""The canonical plain form every layout converts to and from without loss.

A quantized 2-D weight ``[N, K]`` is fully described by:

* ``codes``      integer tensor ``[N, K]``: int8 for signed code ranges, uint8 for unsigned ones
                 (one byte per code whatever the bit width);
* ``scale``      float tensor ``ceil([N, K] / block_size)``;
* ``zero_point`` tensor of the same shape (integer for ``ZeroPointDomain.INT``, float for
                 ``FLOAT``) or None for ``NONE``;
* ``spec``       a :class:`QuantSpec`: block size, code range and zero-point domain.

Codebook formats hold indices into a fixed table as codes and no zero point: ``nf4`` / ``fp4``
(nibbles 0..15, bitsandbytes' tables) and ``e4m3fn`` (bytes 0..255: each code is a
``float8_e4m3fn`` value's own byte, the table the 254 finite values; the NaN bytes 0x7F and 0xFF
are refused; see :mod:`torchq.float8`).

``PlainForm.dequantize`` is the reference meaning of every layout.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .bitpack import pack_bits, unpack_bits
from .blockwise.codebooks import QUANT_TYPES as NIBBLE_CODEBOOKS
from .blockwise.codebooks import codebook as codebook_values
from .float8 import FLOAT8_DTYPE
from .primitives import ZeroPointDomain, dequantize_affine, expand_grid, scale_shape
from .serialization import CheckpointError, reduce_object, register_kind
from .tracing import traced

__all__ = ["QuantSpec", "PlainForm", "NestedScale", "code_dtype_for", "encode_codes", "decode_codes", "has_data", "CODEBOOKS",
           "FLOAT8_CODEBOOK", "nan_float8_codes"]

FLOAT8_CODEBOOK = "e4m3fn"  # codes are float8_e4m3fn bytes
CODEBOOKS = (*NIBBLE_CODEBOOKS, FLOAT8_CODEBOOK)


def nan_float8_codes(codes: torch.Tensor) -> torch.Tensor:
    """Where ``float8_e4m3fn`` byte codes (uint8) are NaN (0x7F, 0xFF)."""
    return (codes & 0x7F) == 0x7F


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
    codebook: str | None = None
    double_quant: bool = False

    def __reduce__(self):
        return reduce_object("spec", self)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", tuple(int(b) for b in self.block_size))
        object.__setattr__(self, "zero_point_domain", ZeroPointDomain(self.zero_point_domain))
        code_dtype_for(self.quant_min, self.quant_max)
        if self.quant_min >= self.quant_max:
            raise ValueError(f"quant_min/quant_max: expected quant_min < quant_max, got {self.quant_min}, {self.quant_max}")
        if self.codebook is not None:
            if self.codebook not in CODEBOOKS:
                raise ValueError(f"codebook: expected one of {sorted(CODEBOOKS)} or None, got {self.codebook!r}")
            if self.codebook == FLOAT8_CODEBOOK:
                if (self.quant_min, self.quant_max, self.zero_point_domain) != (0, 255, ZeroPointDomain.NONE) or self.double_quant:
                    raise ValueError(
                        f"codebook {self.codebook!r}: codes are float8_e4m3fn bytes [0, 255] with no zero point and plain "
                        f"fp32 scales; got [{self.quant_min}, {self.quant_max}] zero={self.zero_point_domain.value} "
                        f"double_quant={self.double_quant}"
                    )
            elif (self.quant_min, self.quant_max, self.zero_point_domain) != (0, 15, ZeroPointDomain.NONE):
                raise ValueError(
                    f"codebook {self.codebook!r}: codes are nibbles [0, 15] with no zero point; got "
                    f"[{self.quant_min}, {self.quant_max}] zero={self.zero_point_domain.value}"
                )
        elif self.double_quant:
            raise ValueError("double_quant: only codebook formats (nf4, fp4) double-quantize their scales")
        if not isinstance(self.double_quant, bool):
            raise TypeError(f"double_quant: expected a bool, got {self.double_quant!r}")
        if self.zero_point_domain is ZeroPointDomain.NONE and self.mid != 0 and self.codebook is None:
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
        if self.codebook is not None:
            return f"{self.codebook} block {dims}" + (" double-quantized scales" if self.double_quant else "")
        return f"{self.bits}-bit [{self.quant_min},{self.quant_max}] block {dims} zero={self.zero_point_domain.value}"

    def to_json(self) -> dict:
        out = {
            "block_size": list(self.block_size),
            "quant_min": self.quant_min,
            "quant_max": self.quant_max,
            "zero_point_domain": self.zero_point_domain.value,
        }
        if self.codebook is not None:  # affine specs keep their original four fields
            out["codebook"] = self.codebook
            out["double_quant"] = self.double_quant
        return out

    @classmethod
    def from_json(cls, d: dict) -> QuantSpec:
        """Inverse of ``to_json``; strict: exact fields, integers that are ints, a known domain."""
        base = {"block_size", "quant_min", "quant_max", "zero_point_domain"}
        if not isinstance(d, dict) or set(d) not in (base, base | {"codebook", "double_quant"}):
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(
                f"spec JSON: expected fields block_size, quant_min, quant_max, zero_point_domain (and codebook, "
                f"double_quant for codebook formats); got {got}"
            )

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
        codebook, double_quant = d.get("codebook"), d.get("double_quant", False)
        if "codebook" in d and (not isinstance(codebook, str) or not isinstance(double_quant, bool)):
            raise ValueError(f"spec JSON: codebook must be a string and double_quant a bool, got {codebook!r}, {double_quant!r}")
        return cls(tuple(block), d["quant_min"], d["quant_max"], ZeroPointDomain(d["zero_point_domain"]), codebook, double_quant)


register_kind("spec", QuantSpec.from_json)


@dataclass(frozen=True, eq=False)
class NestedScale:
    """Double-quantized fp32 scales (bitsandbytes' nested statistics): over the row-major
    flattened scale grid, ``scale = DYNAMIC[codes] * absmax[i // 256] + offset`` with the signed
    8-bit dynamic map (see :mod:`torchq.blockwise.nested`).

    Bytes: ``codes`` uint8 in the grid's shape, ``absmax`` fp32 ``[ceil(G / 256)]``, ``offset``
    one fp32 (0-d)."""

    codes: torch.Tensor
    absmax: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def quantize(cls, scale: torch.Tensor) -> NestedScale:
        from .blockwise.nested import double_quantize

        codes, absmax, offset = double_quantize(scale.reshape(-1).to(torch.float32))
        return cls(codes.reshape(scale.shape), absmax, offset)

    def dequantize(self) -> torch.Tensor:
        from .blockwise.nested import double_dequantize

        return double_dequantize(self.codes.reshape(-1), self.absmax, self.offset).reshape(self.codes.shape)

    def dequantize_rows(self, index: torch.Tensor) -> torch.Tensor:
        """``dequantize()[index]`` of a ``[N, G]`` grid (``index``: 1-D rows in ``[0, N)``), bit for
        bit, computing only those rows (an embedding lookup then costs its rows, not the grid)."""
        from .blockwise.codebooks import dynamic_map
        from .blockwise.nested import NESTED_BLOCKSIZE

        g = self.codes.shape[-1]
        flat = index.to(torch.long).unsqueeze(1) * g + torch.arange(g, device=index.device)
        values = dynamic_map().to(self.codes.device)[self.codes.reshape(-1)[flat].long()]
        return values * self.absmax[flat // NESTED_BLOCKSIZE] + self.offset  # two roundings, as dequantize()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "absmax": self.absmax, "offset": self.offset}

    def map(self, fn) -> NestedScale:
        return NestedScale(fn(self.codes), fn(self.absmax), fn(self.offset))


# the codebooks' fp32 values as Python floats (exact), for tensors built where they are used
_CODEBOOK_VALUES = {name: tuple(codebook_values(name).tolist()) for name in NIBBLE_CODEBOOKS}
_CODEBOOK_VALUES[FLOAT8_CODEBOOK] = tuple(torch.arange(256, dtype=torch.uint8).view(FLOAT8_DTYPE).to(torch.float32).tolist())

# dtypes a floating zero point may have (float64 has no kernel: every forward would fail)
_ZERO_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, eq=False)
class PlainForm:
    """Unpacked codes + scale + zero point + spec: the lossless interchange form of all layouts.

    Codebook formats (``spec.codebook``: nf4 / fp4) hold nibble indices as codes, the fp32 block
    absmax as ``scale`` and no zero point; with ``spec.double_quant`` the scales are also held
    double-quantized in ``nested`` (``scale`` is then exactly ``nested.dequantize()``)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    spec: QuantSpec
    nested: NestedScale | None = None

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def example(cls, spec: QuantSpec, shape: tuple[int, int], scale_dtype: torch.dtype = torch.float32, *,
                zero_dtype: torch.dtype | None = None, seed: int = 0) -> PlainForm:
        """A random valid plain form of ``spec`` and ``shape``, for tests of layouts (deterministic in
        ``seed``): codes uniform over ``[quant_min, quant_max]`` (nibbles 0..15 for codebook formats),
        positive scales of ``scale_dtype`` around 0.01 and zero points of ``spec``'s domain: integers
        inside the code range in ``zero_dtype`` (default the code dtype) for INT, floats of about one
        scale step times the range in ``zero_dtype`` (default ``scale_dtype``) for FLOAT. Codebook
        formats take fp32 absmax (``scale_dtype`` must be fp32), double-quantized with
        :meth:`NestedScale.quantize` when ``spec.double_quant``."""
        if len(shape) != 2:
            raise ValueError(f"shape: expected [N, K], got {tuple(shape)}")
        if zero_dtype is not None and spec.zero_point_domain is ZeroPointDomain.NONE:
            raise ValueError(f"zero_dtype: {spec.describe()} has no zero point, got {zero_dtype}")
        gen = torch.Generator().manual_seed(seed)
        grid = scale_shape(shape, spec.block_size)
        codes = torch.randint(spec.quant_min, spec.quant_max + 1, tuple(shape), generator=gen).to(spec.code_dtype)
        if spec.codebook == FLOAT8_CODEBOOK:
            codes = torch.where(nan_float8_codes(codes), codes - 1, codes)  # 0x7E / 0xFE: ±448
        magnitude = torch.rand(grid, generator=gen) * 0.02 + 0.002
        if spec.codebook is not None:
            if scale_dtype != torch.float32:
                raise ValueError(f"scale_dtype: codebook formats keep fp32 absmax, got {scale_dtype}")
            absmax = magnitude * 50  # absmax of a block of weights ~ 0.1..1
            nested = NestedScale.quantize(absmax) if spec.double_quant else None
            return cls(codes, absmax if nested is None else nested.dequantize(), None, spec, nested)
        domain = spec.zero_point_domain
        if domain is ZeroPointDomain.INT:
            zero = torch.randint(spec.quant_min, spec.quant_max + 1, grid, generator=gen).to(zero_dtype or spec.code_dtype)
        elif domain is ZeroPointDomain.FLOAT:
            steps = spec.quant_max - spec.quant_min
            zero = ((torch.rand(grid, generator=gen) - 0.5) * magnitude * steps).to(zero_dtype or scale_dtype)
        else:
            zero = None
        return cls(codes, magnitude.to(scale_dtype), zero, spec)

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
            if want_float and self.zero_point.dtype not in _ZERO_FLOATS:
                # the kernels reproduce (q - z) * s in fp32/bf16/fp16 arithmetic only
                raise TypeError(
                    f"zero_point: expected fp32, bf16 or fp16 for zero_point_domain FLOAT, got {self.zero_point.dtype} "
                    f"(quantize with zero_point_dtype=torch.float32)"
                )
        for name in ("scale", "zero_point"):
            t = getattr(self, name)
            if t is not None and t.device != self.codes.device:
                raise ValueError(f"{name}: expected device {self.codes.device} (the codes' device), got {t.device}")
        if spec.codebook is not None and self.scale.dtype != torch.float32:
            raise TypeError(f"scale: codebook formats keep fp32 absmax, got {self.scale.dtype}")
        if spec.codebook == FLOAT8_CODEBOOK and has_data(self.codes) and not traced(self.codes):
            nan = nan_float8_codes(self.codes)
            if bool(nan.any()):
                raise ValueError(f"codes: {int(nan.sum())} float8_e4m3fn code(s) are NaN (bytes 0x7F / 0xFF)")
        if spec.double_quant != (self.nested is not None):
            raise ValueError(f"nested: expected {'a NestedScale' if spec.double_quant else 'None'} for {spec.describe()}")
        if self.nested is not None:
            nq = self.nested
            want_absmax = (-(-self.scale.numel() // 256),)
            if nq.codes.dtype != torch.uint8 or tuple(nq.codes.shape) != grid:
                raise ValueError(f"nested.codes: expected uint8 of shape {grid}, got {nq.codes.dtype} {tuple(nq.codes.shape)}")
            if nq.absmax.dtype != torch.float32 or tuple(nq.absmax.shape) != want_absmax:
                raise ValueError(f"nested.absmax: expected fp32 of shape {want_absmax}, got {nq.absmax.dtype} {tuple(nq.absmax.shape)}")
            if nq.offset.dtype != torch.float32 or nq.offset.dim() != 0:
                raise ValueError(f"nested.offset: expected a 0-d fp32 tensor, got {nq.offset.dtype} {tuple(nq.offset.shape)}")
            if any(t.device != self.codes.device for t in nq.tensors().values()):
                raise ValueError(f"nested: expected device {self.codes.device} (the codes' device)")
            concrete = self.codes.device.type != "meta" and not traced(self.codes)
            if concrete and not torch.equal(nq.dequantize(), self.scale):
                raise ValueError("scale: differs from the reconstruction of its double-quantized form")

    def tensors(self) -> dict[str, torch.Tensor | None]:
        return {"codes": self.codes, "scale": self.scale, "zero_point": self.zero_point}

    def map(self, fn) -> PlainForm:
        """Apply ``fn`` to every tensor (e.g. ``.to(device)``, ``.clone()``)."""
        z = None if self.zero_point is None else fn(self.zero_point)
        nested = None if self.nested is None else self.nested.map(fn)
        return PlainForm(fn(self.codes), fn(self.scale), z, self.spec, nested)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        s = self.spec
        if s.codebook is not None:  # code value * absmax in fp32, one cast
            # a new tensor of constants (not the module's tensor): under fake tensor modes (torch.compile) it is fake too
            values = torch.tensor(_CODEBOOK_VALUES[s.codebook], device=self.codes.device)[self.codes.long()]
            return (values * expand_grid(self.scale, s.block_size, self.codes.shape)).to(dtype)
        return dequantize_affine(
            self.codes, s.block_size, self.scale, self.zero_point, s.quant_min, s.quant_max, s.zero_point_domain, dtype
        )

    def equal(self, other: PlainForm) -> bool:
        """Bit equality of tensors (dtypes included) and spec."""
        if self.spec != other.spec:
            return False
        pairs = list(zip(self.tensors().values(), other.tensors().values()))
        if self.nested is not None and other.nested is not None:
            pairs += list(zip(self.nested.tensors().values(), other.nested.tensors().values()))
        for a, b in pairs:
            if (a is None) != (b is None):
                return False
            if a is not None and (a.dtype != b.dtype or not torch.equal(a, b)):
                return False
        return True

    def narrow(self, dim: int, start: int, length: int) -> PlainForm:
        """Rows or columns ``[start, start+length)``; block boundaries must be respected.

        Exception: along dim 1, a block that spans the whole row (one scale per row or per tensor:
        int8, float8, per-channel intx, a group as wide as the row) may be cut anywhere. The slice
        keeps the row's scale and zero point with its columns of the codes, and its block becomes
        the slice's width (``max(length, 1)``), so every value is unchanged. (Rows keep the rule: a
        block spanning rows stays whole, as the row shards of FSDP2 need one block row per row.)"""
        size = self.codes.shape[dim]
        b = self.spec.block_size[dim]
        if start < 0 or length < 0 or start + length > size:
            raise IndexError(f"narrow: range [{start}, {start + length}) out of bounds for dim {dim} of size {size}")
        end = start + length
        if self.nested is not None and (start, end) == (0, size):
            return self
        spans = dim == 1 and b >= size and (start, end) != (0, size)
        if not spans and (start % b or (end % b and end != size)):
            raise ValueError(
                f"narrow: dim {dim} has quantization blocks of {b} ({self.spec.describe()}); start and end must be "
                f"multiples of {b} (or end == {size}), got [{start}, {end}): a block's scale cannot be cut. Split dim "
                f"{dim} at multiples of {b} (for tensor parallelism or FSDP2: a world size for which ceil({size} / "
                f"world) is a multiple of {b}), or quantize with a group size that divides each rank's share"
            )
        spec = dataclasses.replace(self.spec, double_quant=False) if self.nested is not None else self.spec
        if spans:  # one block across the row: every column keeps the row's scale
            gs, ge = 0, (1 if length else 0)
            spec = dataclasses.replace(spec, block_size=(spec.block_size[0], max(length, 1)))
        else:
            gs, ge = start // b, -(-end // b)

        def cut(t, lo, hi):
            return t.narrow(dim, lo, hi - lo)

        z = None if self.zero_point is None else cut(self.zero_point, gs, ge)
        # A slice of double-quantized scales is no longer whole 256-blocks of the grid: it keeps the
        # (identical) reconstructed fp32 scales as plain scales.
        return PlainForm(cut(self.codes, start, end), cut(self.scale, gs, ge), z, spec)

    def rows(self, index: torch.Tensor) -> PlainForm:
        """Gather rows (dim 0) by an index tensor; each row keeps its own block of scales."""
        b = self.spec.block_size[0]
        gi = torch.div(index, b, rounding_mode="floor")
        z = None if self.zero_point is None else self.zero_point[gi]
        spec = dataclasses.replace(self.spec, block_size=(1,) + self.spec.block_size[1:], double_quant=False)
        return PlainForm(self.codes[index], self.scale[gi], z, spec)


# -- codes as checkpoints and row shards store them ------------------------------------------------------
def has_data(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values to check (not a meta or fake tensor)."""
    return t.device.type != "meta" and not isinstance(t, torch._subclasses.FakeTensor)


def encode_codes(codes: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, str]:
    """``(stored codes, encoding)`` of plain ``[N, K]`` codes: ``bitstream`` (uint8
    ``[N, ceil(K/8)*b]`` of ``q - quant_min``) for ``b <= 7`` bits, else ``bytes`` (the codes)."""
    if spec.bits <= 7:  # uint8 wrap-around: q - quant_min
        return pack_bits(codes.view(torch.uint8) - spec.quant_min % 256, spec.bits), "bitstream"
    return codes, "bytes"


def decode_codes(stored: torch.Tensor, spec: QuantSpec, k: int, encoding: str, where: str) -> torch.Tensor:
    """Plain ``[N, k]`` codes from :func:`encode_codes`' form (or ``float8``: float8_e4m3fn codes of
    the ``e4m3fn`` codebook, as checkpoints store them); a :class:`CheckpointError` naming ``where``
    for a code outside the spec's range (checked where the tensor holds data)."""
    if encoding == "float8":
        if spec.codebook != FLOAT8_CODEBOOK or stored.dtype != FLOAT8_DTYPE:
            raise CheckpointError(f"{where}: float8 codes are float8_e4m3fn codes of the {FLOAT8_CODEBOOK} codebook, "
                                  f"got {stored.dtype} for {spec.describe()}")
        stored, encoding = stored.view(torch.uint8), "bytes"
    real = has_data(stored)
    if encoding == "bitstream":
        u = unpack_bits(stored, spec.bits, k)
        if real and spec.quant_max - spec.quant_min + 1 < 2**spec.bits and bool((u > spec.quant_max - spec.quant_min).any()):
            raise CheckpointError(f"{where}: codes outside [{spec.quant_min}, {spec.quant_max}]")
        codes = u.contiguous()
        codes += spec.quant_min % 256  # uint8 wrap-around: two's complement of the int8 code
        return codes.view(torch.int8) if spec.code_dtype == torch.int8 else codes
    if real and bool(((stored < spec.quant_min) | (stored > spec.quant_max)).any()):
        raise CheckpointError(f"{where}: codes outside [{spec.quant_min}, {spec.quant_max}]")
    if real and spec.codebook == FLOAT8_CODEBOOK and bool(nan_float8_codes(stored).any()):
        raise CheckpointError(f"{where}: float8_e4m3fn codes that are NaN (bytes 0x7F / 0xFF)")
    return stored
