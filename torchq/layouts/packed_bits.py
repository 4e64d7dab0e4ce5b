"""``PackedBitsLayout``: 1-7-bit codes bit-packed along K, portable across devices.

Bytes per ``[N, K]`` weight with ``b``-bit codes: each row holds ``ceil(K / 8) * b`` bytes
(a row is padded with zero codes to a multiple of 8 codes). Codes are stored offset to unsigned
(``u = q - quant_min`` in ``[0, 2^b)``) as one big-endian bit stream per row: code ``j`` occupies
stream bits ``[j*b, (j+1)*b)``, stream bit 0 being the most significant bit of the row's first
byte. For 4-bit codes this is "element 2j in the high nibble, 2j+1 in the low nibble".
``scale`` / ``zero_point`` are stored as in the plain form.

No native sub-byte matmul is registered for this layout: a linear on it dequantizes (visible
as a one-time ``FallbackWarning``). It exists for compact, device-independent storage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..bitpack import pack_bits, unpack_bits
from ..canonical import PlainForm, QuantSpec
from ..primitives import ZeroPointDomain
from .base import Buffer, Fit, Layout, LayoutExample, TensorImpl, plain_buffers

__all__ = ["PackedBitsLayout", "PackedBitsImpl", "pack_bits", "unpack_bits"]


class PackedBitsImpl(TensorImpl):
    tensor_fields = ("packed", "scale", "zero_point")

    def expected_tensors(self) -> dict[str, Buffer | None]:
        spec = self.spec
        if len(self.shape) != 2 or spec.bits > 7:
            raise ValueError(f"PackedBitsImpl: expected 1-7-bit codes of a 2-D weight, got {spec.describe()} of shape {list(self.shape)}")
        n, k = self.shape
        return {"packed": Buffer((n, -(-k // 8) * spec.bits), torch.uint8), **plain_buffers(spec, self.shape)}

    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> PackedBitsImpl:
        spec = plain.spec
        u = plain.codes.to(torch.int16) - spec.quant_min
        packed = pack_bits(u, spec.bits)
        return cls(layout, spec, plain.shape, packed=packed, scale=plain.scale, zero_point=plain.zero_point)

    def to_plain(self) -> PlainForm:
        spec = self.spec
        u = unpack_bits(self.packed, spec.bits, self.shape[1]).to(torch.int16)
        codes = (u + spec.quant_min).to(spec.code_dtype)
        return PlainForm(codes, self.scale, self.zero_point, spec)

    def narrow_view(self, dim: int, start: int, length: int) -> PackedBitsImpl | None:
        spec, (n, k) = self.spec, self.shape
        end = start + length
        if dim == 0:
            sub = PlainForm(torch.empty(n, 1, dtype=spec.code_dtype, device=self.device), self.scale[:, :1],
                            None if self.zero_point is None else self.zero_point[:, :1],
                            dataclasses.replace(spec, block_size=(spec.block_size[0], 1)))
            sub.narrow(0, start, length)  # validates block alignment
            b0 = spec.block_size[0]
            gs, ge = start // b0, -(-end // b0)
            z = None if self.zero_point is None else self.zero_point[gs:ge]
            return type(self)(self.layout, spec, (length, k), packed=self.packed[start:end], scale=self.scale[gs:ge], zero_point=z)
        if start % 8 or (end % 8 and end != k):
            return None
        g = spec.block_size[1]
        if start % g or (end % g and end != k):
            return None
        bits = spec.bits
        gs, ge = start // g, -(-end // g)
        z = None if self.zero_point is None else self.zero_point[:, gs:ge]
        packed = self.packed[:, start // 8 * bits: -(-end // 8) * bits]
        return type(self)(self.layout, spec, (n, length), packed=packed, scale=self.scale[:, gs:ge], zero_point=z)


@dataclass(frozen=True)
class PackedBitsLayout(Layout):
    """Bit-packed 1-7-bit codes (see module doc for the byte order)."""

    name = "packed_bits"
    impl_class = PackedBitsImpl
    holds_codebooks = True

    def fit(self, spec, shape=None, scale_dtype=None, device=None):
        base = super().fit(spec, shape, scale_dtype, device)
        if not base.holds:
            return base
        if spec.bits > 7:
            return Fit(f"packs 1-7-bit codes, format has {spec.bits} bits")
        if shape is not None and len(shape) != 2:
            return Fit(f"needs a 2-D weight, got shape {shape}")
        return base

    @classmethod
    def examples(cls) -> tuple[LayoutExample, ...]:
        z = ZeroPointDomain
        return (
            LayoutExample(cls(), QuantSpec((1, 32), 0, 1, z.INT), (33, 70)),  # 1 bit, K not a multiple of 8
            LayoutExample(cls(), QuantSpec((1, 100), -2, 1, z.NONE), (40, 100), torch.bfloat16),  # 2 bits per channel
            LayoutExample(cls(), QuantSpec((1, 64), 0, 7, z.FLOAT), (17, 200), torch.bfloat16),  # 3 bits, padded K
            LayoutExample(cls(), QuantSpec((2, 32), -16, 15, z.NONE), (24, 96)),  # 5 bits, 2-D blocks
            LayoutExample(cls(), QuantSpec((1, 32), 0, 63, z.INT), (9, 64), torch.float16, torch.int32),  # 6 bits
            LayoutExample(cls(), QuantSpec((1, 128), -64, 63, z.FLOAT), (31, 130), torch.float16),  # 7 bits
            LayoutExample(cls(), QuantSpec((1, 64), 0, 15, z.NONE, codebook="fp4"), (16, 128)),
        )
