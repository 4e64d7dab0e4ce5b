"""``Int4CPULayout``: PyTorch's CPU int4 packing for ``aten._weight_int4pack_mm_for_cpu``.

Holds any groupwise format of at most 4 bits (tinygemm float zero point, integer zero point or
symmetric) with group size ``g`` in {32, 64, 128, 256} on the CPU. Codes are shifted to
``q' = q + (8 - mid)`` in 0..15 so that the kernel's ``x̂ = (q' - 8) * s + zero`` equals the
format's dequantization, with ``zero = z`` (FLOAT), ``(mid - z) * s`` (INT) or ``0`` (NONE).

Bytes per ``[N, K]`` weight, with ``Np = ceil(N/ROW_BLOCK)*ROW_BLOCK`` (``row_block()``: 64 with AVX-512), ``Kp = ceil(K/g)*g``:

* ``packed``           uint8 ``[Np, Kp/2]``: ``aten._convert_weight_to_int4pack_for_cpu``'s
                       ISA-blocked nibble order (opaque; differs between CPUs, never saved);
* ``scales_and_zeros`` ``[Kp/g, Np, 2]`` (``[..., 0]`` scale, ``[..., 1]`` float zero) in
                       ``promote(scale dtype, zero dtype)``;
* ``int_zero``         the original integer zero points ``[N, Kp/g]`` (INT domain only).

Padding (extra rows, and K up to a multiple of ``g``) is sliced off on output and on unpacking.
Unpacking is exact and traceable: at import the packing op's order on this CPU (blocks of
``ROW_BLOCK`` rows, one nibble permutation per column) is measured with probe codes, and every
pack is checked to unpack to its input bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..canonical import PlainForm, QuantSpec
from ..dispatch import LinearKernel
from ..ops.int4 import int4_cpu_mm
from ..primitives import ZeroPointDomain
from .base import Buffer, Fit, Layout, LayoutExample, TensorImpl, zero_dtype_rejects
from .int4_padded import format_codes, groupwise_int4_rejects, kernel_codes, padded_linear, round_up

__all__ = ["Int4CPULayout", "Int4CPUImpl"]

GROUP_SIZES = (32, 64, 128, 256)
_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def _pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Flat nibbles of a byte tensor: nibble ``2i`` is the low half of byte ``i``."""
    flat = packed.reshape(-1)
    return torch.stack([flat & 0xF, flat >> 4], dim=-1).reshape(-1)


def _measure_row_blocks() -> tuple[int, tuple[int, ...]]:
    """Measure the packing op's order on this CPU: it packs full blocks of ``BN`` rows, column
    by column, as ``BN`` nibbles holding rows ``perm[0..BN)`` of the block. Returns
    ``(BN, argsort(perm))``. Found with base-16 digit probes on a small shape, and checked."""
    n, k = 256, 64
    index = torch.arange(n * k, dtype=torch.int64)
    src = torch.zeros(n * k, dtype=torch.int64)
    for p in range(math.ceil(math.log2(n * k) / 4)):
        src |= _nibbles(_pack(((index >> (4 * p)) & 0xF).reshape(n, k))).to(torch.int64) << (4 * p)
    rows, cols = src // k, src % k
    for bn in (16, 32, 64, 128, 256):
        j = index
        block, col = j // (k * bn), (j % (k * bn)) // bn
        perm = (rows % bn).reshape(-1, bn)
        if (torch.equal(cols, col) and torch.equal(rows // bn, block) and torch.equal(perm, perm[:1].expand_as(perm))
                and sorted(perm[0].tolist()) == list(range(bn))):
            return bn, tuple(torch.argsort(perm[0]).tolist())
    raise RuntimeError("torchq: _convert_weight_to_int4pack_for_cpu uses an order torchq cannot unpack on this build")


# The packing order, measured on first use (not at import: a build whose order torchq cannot
# unpack only makes this layout unavailable, with the reason): [(ROW_BLOCK, inverse permutation,
# halves)] or [the error message]. "halves" is the common order (AVX2 / AVX-512 builds): byte j
# of a column block holds row j in its low nibble and row j + ROW_BLOCK/2 in its high nibble,
# so unpacking needs no gather.
_ORDER: list = []


def _row_order() -> tuple[int, tuple[int, ...], bool]:
    """``(ROW_BLOCK, inverse permutation, halves)`` of this build's packing (RuntimeError if
    torchq cannot unpack it)."""
    if not _ORDER:
        try:
            bn, inverse = _measure_row_blocks()
            _ORDER.append((bn, inverse, inverse == tuple(range(0, bn, 2)) + tuple(range(1, bn, 2))))
        except RuntimeError as e:
            _ORDER.append(str(e))
    if isinstance(_ORDER[0], str):
        raise RuntimeError(_ORDER[0])
    return _ORDER[0]


def packing_unavailable() -> str | None:
    """None when this build's int4 CPU packing is one torchq unpacks, else why not."""
    try:
        _row_order()
    except RuntimeError as e:
        return str(e)
    return None


def row_block() -> int:
    """Rows per packed block (64 with AVX-512): ``Np`` is ``N`` rounded up to it."""
    return _row_order()[0]


def _pack_checked(q8: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes ``[Np, Kp]`` (0..15) and check the result unpacks to them bit for bit.

    Blocks of ``ROW_BLOCK`` rows pack independently, so this works on chunks of rows: the int32
    copy the op needs and the check's temporaries stay a few MB instead of 6x the weight."""
    np_, kp = q8.shape
    packed = torch.empty(np_, kp // 2, dtype=torch.uint8, device=q8.device)
    chunk_rows = 16 * row_block()
    for r0 in range(0, np_, chunk_rows):
        rows = q8[r0:r0 + chunk_rows]
        chunk = _pack(rows)
        if chunk.shape != (rows.shape[0], kp // 2) or not torch.equal(_unpack(chunk, rows.shape[0], kp), rows):
            raise RuntimeError("torchq: int4 CPU packing did not round-trip exactly on this CPU; use PlainLayout or PackedBitsLayout")
        packed[r0:r0 + rows.shape[0]] = chunk
    return packed


def _unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """uint8 codes ``[n, k]`` from packed bytes (``n`` a multiple of ``ROW_BLOCK``); traceable."""
    bn, inverse, halves = _row_order()
    if halves:
        b = packed.reshape(n // bn, k, bn // 2)
        return torch.cat([b & 0xF, b >> 4], dim=2).transpose(1, 2).reshape(n, k)
    nib = _nibbles(packed).reshape(n // bn, k, bn)
    inv = torch.tensor(inverse, dtype=torch.int64, device=packed.device)
    return nib.index_select(2, inv).transpose(1, 2).reshape(n, k)


class Int4CPUImpl(TensorImpl):
    tensor_fields = ("packed", "scales_and_zeros", "int_zero")
    attr_fields = ("scale_dtype", "zero_dtype")

    @property
    def group_size(self) -> int:
        return self.spec.block_size[1]

    @property
    def padded_shape(self) -> tuple[int, int]:
        n, k = self.shape
        return round_up(n, row_block()), round_up(k, self.group_size)

    def expected_tensors(self) -> dict[str, Buffer | None]:
        spec = self.spec
        reason = groupwise_int4_rejects(spec, GROUP_SIZES) or zero_dtype_rejects(spec, self.zero_dtype)
        if reason is None and self.scale_dtype not in _FLOAT_INPUTS:
            reason = f"scale_dtype: expected fp32/bf16/fp16, got {self.scale_dtype!r}"
        if reason is not None:
            raise ValueError(f"Int4CPUImpl ({spec.describe()}): {reason}")
        n, k = self.shape
        np_, kp = self.padded_shape
        g = self.group_size
        domain = spec.zero_point_domain
        sz_dtype = torch.promote_types(self.scale_dtype, self.zero_dtype) if domain is ZeroPointDomain.FLOAT else self.scale_dtype
        return {
            "packed": Buffer((np_, kp // 2), torch.uint8, contiguous=True),
            "scales_and_zeros": Buffer((kp // g, np_, 2), sz_dtype, contiguous=True),
            "int_zero": Buffer((n, kp // g), self.zero_dtype) if domain is ZeroPointDomain.INT else None,
        }

    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> Int4CPUImpl:
        spec = plain.spec
        n, k = plain.shape
        np_, kp = round_up(n, row_block()), round_up(k, spec.block_size[1])
        q8 = kernel_codes(plain, np_, kp, fill=8)
        scale = plain.scale
        domain = spec.zero_point_domain
        if domain is ZeroPointDomain.FLOAT:
            zero_f = plain.zero_point
        elif domain is ZeroPointDomain.INT:
            zero_f = (spec.mid - plain.zero_point.to(torch.int32)) * scale
        else:
            zero_f = torch.zeros_like(scale)
        sz_dtype = torch.promote_types(scale.dtype, zero_f.dtype)
        sz = torch.zeros(np_, scale.shape[1], 2, dtype=sz_dtype, device=plain.device)
        sz[:n, :, 0] = scale
        sz[:n, :, 1] = zero_f
        packed = _pack_checked(q8)
        return cls(
            layout, spec, (n, k),
            packed=packed,
            scales_and_zeros=sz.transpose(0, 1).contiguous(),
            int_zero=plain.zero_point if domain is ZeroPointDomain.INT else None,
            scale_dtype=scale.dtype,
            zero_dtype=None if plain.zero_point is None else plain.zero_point.dtype,
        )

    def to_plain(self) -> PlainForm:
        spec = self.spec
        n, k = self.shape
        np_, kp = self.padded_shape
        codes = format_codes(_unpack(self.packed, np_, kp), spec, n, k)
        sz = self.scales_and_zeros[:, :n].transpose(0, 1)
        scale = sz[..., 0].to(self.scale_dtype).contiguous()
        domain = spec.zero_point_domain
        if domain is ZeroPointDomain.FLOAT:
            zero = sz[..., 1].to(self.zero_dtype).contiguous()
        elif domain is ZeroPointDomain.INT:
            zero = self.int_zero
        else:
            zero = None
        return PlainForm(codes, scale, zero, spec)


@dataclass(frozen=True)
class Int4CPULayout(Layout):
    """PyTorch's CPU int4 packing (``_convert_weight_to_int4pack_for_cpu``)."""

    name = "int4_cpu"
    impl_class = Int4CPUImpl
    device_specific = True

    @classmethod
    def linear_kernels(cls):
        return KERNELS

    def fit(self, spec, shape=None, scale_dtype=None, device=None):
        base = super().fit(spec, shape, scale_dtype, device)
        if not base.holds:
            return base
        if device is not None and torch.device(device).type != "cpu":
            return Fit(f"CPU-only layout, weight is on {device}")
        reason = packing_unavailable()
        if reason is not None:
            return Fit(reason)
        if shape is not None and len(shape) != 2:
            return Fit(f"needs a 2-D weight, got shape {shape}")
        reason = groupwise_int4_rejects(spec, GROUP_SIZES)
        if reason is not None:
            return Fit(reason)
        if scale_dtype is not None and scale_dtype not in _FLOAT_INPUTS:
            return Fit(f"scale dtype must be fp32/bf16/fp16, got {scale_dtype}")
        return base

    @classmethod
    def examples(cls) -> tuple[LayoutExample, ...]:
        z = ZeroPointDomain
        return (
            LayoutExample(cls(), QuantSpec((1, 32), 0, 15, z.INT), (67, 96)),  # odd N, padded to the row block
            LayoutExample(cls(), QuantSpec((1, 64), -8, 7, z.NONE), (33, 200), torch.bfloat16),  # padded K
            LayoutExample(cls(), QuantSpec((1, 128), 0, 15, z.FLOAT), (16, 256), torch.float16, torch.bfloat16),
            LayoutExample(cls(), QuantSpec((1, 256), -8, 7, z.INT), (8, 300), torch.bfloat16, torch.int32),
            LayoutExample(cls(), QuantSpec((1, 32), 0, 7, z.INT), (20, 64)),  # 3 bits
        )


def _check(x: torch.Tensor, w, bias) -> str | None:
    if x.device.type != "cpu":
        return f"CPU kernel, input is on {x.device}"
    if w.act_quant is not None:
        return f"weight-only kernel, weight has {w.act_quant.describe()}"
    return None


def _int4_cpu_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: Int4CPUImpl = w.tensor_impl
    mm = lambda x2: int4_cpu_mm(x2, w.packed, impl.group_size, w.scales_and_zeros)  # noqa: E731
    return padded_linear(x, bias, *impl.shape, *impl.padded_shape, mm)


# PyTorch's int4 CPU kernel is 10-100x slower for fp32/fp16 inputs than for bf16 ones (18.5 ms
# vs 1.3 ms at M=1, K=N=4096): configs with compute_dtype=torch.bfloat16 run those inputs in bf16.
KERNELS = (
    LinearKernel(
        "int4_cpu",
        _check,
        _int4_cpu_linear,
        description="aten._weight_int4pack_mm_for_cpu: groupwise <=4-bit weight, float input",
    ),
)
