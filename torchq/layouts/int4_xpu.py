"""``Int4XPULayout``: PyTorch's XPU (Intel GPU) int4 weight-only format.

Groupwise <=4-bit weights with an integer zero point (ZeroPointDomain.INT, ``x̂ = (q - z)·s``,
run by ``aten._weight_int4pack_mm_with_scales_and_zeros``) or a float zero point
(ZeroPointDomain.FLOAT, tinygemm numerics ``x̂ = (q - 8)·s + zero``, run by
``aten._weight_int4pack_mm``), group size ``g`` in {32, 64, 128, 256}, scales in bf16 or fp16
(the XPU kernels read them in the activation dtype). Codes are shifted by ``8 - mid`` into
0..15 (and integer zero points with them), so ``[0, 15]`` and ``[-8, 7]`` ranges both fit.

Bytes per ``[N, K]`` weight, with ``Np = ceil(N/16)·16`` and ``Kp = ceil(K/g)·g``:

* ``packed`` int32 ``[Np, Kp/8]``: nibble ``i`` (bits ``4i..4i+3``) of word ``j`` of row ``n``
  holds code ``q'[n, 8j + i]``; as bytes (little-endian), byte ``b`` of a row is
  ``q'[2b+1] << 4 | q'[2b]``: the reverse of CUDA's nibble order;
* FLOAT: ``scale_and_zero`` ``[Kp/g, Np, 2]`` in the scale dtype (``[..., 0]`` scale, ``[..., 1]`` zero);
* INT: ``scale`` ``[Kp/g, Np]`` in the scale dtype and ``zero`` int8 ``[Kp/g, Np]`` (shifted
  zero points); the original integer dtype is remembered.

Padding holds code 0 with scale 0 (weight 0) and is sliced off. The bytes are device-independent:
the pure-PyTorch packer runs anywhere; on an XPU the result of ``_convert_weight_to_int4pack``
is checked once per process to be the same. The kernels are selected only for tensors on an
XPU device; elsewhere this layout is storage (``torchq::int4_xpu_mm``'s reference computes
what the XPU kernels compute: every weight formed in fp32 and rounded once to the activation
dtype, then the matmul).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..canonical import PlainForm, QuantSpec
from ..dispatch import LinearKernel
from ..ops.int4 import int4_xpu_mm, unpack_xpu
from ..primitives import ZeroPointDomain
from .base import Buffer, Fit, Layout, LayoutExample, TensorImpl, zero_dtype_rejects
from .int4_padded import format_codes, groupwise_int4_rejects, kernel_codes, padded_linear, round_up

__all__ = ["Int4XPULayout", "Int4XPUImpl", "pack_xpu"]

GROUP_SIZES = (32, 64, 128, 256)
SCALE_DTYPES = (torch.bfloat16, torch.float16)
N_ALIGN = 16


def pack_xpu(q: torch.Tensor) -> torch.Tensor:
    """Codes ``[Np, Kp]`` (0..15, ``Kp % 8 == 0``) to int32 words ``[Np, Kp/8]`` (see module doc)."""
    q = q.to(torch.uint8)
    return ((q[:, 1::2] << 4) | q[:, 0::2]).contiguous().view(torch.int32)


def _shift(spec) -> int:
    return 8 - spec.mid


@functools.cache
def _xpu_pack_verified(device_index: int) -> bool:
    device = torch.device("xpu", device_index)
    q = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    got = torch.ops.aten._convert_weight_to_int4pack(((q[:, 1::2] << 4) | q[:, 0::2]).to(device), 8)
    return tuple(got.shape) == (16, 8) and torch.equal(got.cpu(), pack_xpu(q))


def _pack(q8: torch.Tensor) -> torch.Tensor:
    if q8.device.type == "xpu":
        if not _xpu_pack_verified(q8.device.index or 0):
            raise RuntimeError(
                "torchq: aten._convert_weight_to_int4pack on this XPU build does not produce the [N, K/8] order torchq "
                "documents (older torch-xpu-ops); use PlainLayout or PackedBitsLayout"
            )
        return torch.ops.aten._convert_weight_to_int4pack(((q8[:, 1::2] << 4) | q8[:, 0::2]).contiguous(), 8)
    return pack_xpu(q8)


class Int4XPUImpl(TensorImpl):
    tensor_fields = ("packed", "scale_and_zero", "scale", "zero")
    attr_fields = ("zero_dtype",)

    @property
    def group_size(self) -> int:
        return self.spec.block_size[1]

    @property
    def padded_shape(self) -> tuple[int, int]:
        n, k = self.shape
        return round_up(n, N_ALIGN), round_up(k, self.group_size)

    def expected_tensors(self) -> dict[str, Buffer | None]:
        spec = self.spec
        domain = spec.zero_point_domain
        reason = self.layout.fit(spec, self.shape, None, self.device).cannot_hold or zero_dtype_rejects(spec, self.zero_dtype)
        if reason is None and domain is ZeroPointDomain.FLOAT and self.zero_dtype not in SCALE_DTYPES:
            reason = f"zero_dtype: the XPU kernel reads zeros in the bf16/fp16 scale dtype, got {self.zero_dtype}"
        if reason is not None:
            raise ValueError(f"Int4XPUImpl ({spec.describe()}): {reason}")
        np_, kp = self.padded_shape
        grid = (kp // self.group_size, np_)
        float_zero = domain is ZeroPointDomain.FLOAT
        return {
            "packed": Buffer((np_, kp // 8), torch.int32, contiguous=True),
            "scale_and_zero": Buffer((*grid, 2), self.zero_dtype, contiguous=True) if float_zero else None,
            "scale": None if float_zero else Buffer(grid, SCALE_DTYPES, contiguous=True),
            "zero": None if float_zero else Buffer(grid, torch.int8, contiguous=True),
        }

    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> Int4XPUImpl:
        spec = plain.spec
        n, k = plain.shape
        g = spec.block_size[1]
        np_, kp = round_up(n, N_ALIGN), round_up(k, g)
        shift = _shift(spec)
        q8 = kernel_codes(plain, np_, kp, fill=0)
        groups = plain.scale.shape[1]
        scale = torch.zeros(np_, kp // g, dtype=plain.scale.dtype, device=plain.device)
        scale[:n, :groups] = plain.scale
        if spec.zero_point_domain is ZeroPointDomain.FLOAT:
            if plain.zero_point.dtype != plain.scale.dtype:
                raise ValueError(f"zero_point: the XPU kernel reads zeros in the scale dtype {plain.scale.dtype}, got {plain.zero_point.dtype}")
            zero = torch.zeros_like(scale)
            zero[:n, :groups] = plain.zero_point
            sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
            return cls(layout, spec, (n, k), packed=_pack(q8), scale_and_zero=sz, scale=None, zero=None, zero_dtype=zero.dtype)
        zero = torch.zeros(np_, kp // g, dtype=torch.int8, device=plain.device)
        zero[:n, :groups] = (plain.zero_point.to(torch.int16) + shift).to(torch.int8)
        return cls(layout, spec, (n, k), packed=_pack(q8), scale_and_zero=None, scale=scale.t().contiguous(),
                   zero=zero.t().contiguous(), zero_dtype=plain.zero_point.dtype)

    def to_plain(self) -> PlainForm:
        spec = self.spec
        n, k = self.shape
        shift = _shift(spec)
        codes = format_codes(unpack_xpu(self.packed), spec, n, k)
        groups = -(-k // self.group_size)
        if self.scale_and_zero is not None:
            sz = self.scale_and_zero[:groups, :n].transpose(0, 1)
            return PlainForm(codes, sz[..., 0].contiguous(), sz[..., 1].contiguous(), spec)
        scale = self.scale[:groups, :n].t().contiguous()
        zero = (self.zero[:groups, :n].t().to(torch.int16) - shift).to(self.zero_dtype).contiguous()
        return PlainForm(codes, scale, zero, spec)


@dataclass(frozen=True)
class Int4XPULayout(Layout):
    """PyTorch's XPU int4 format, integer or float zero point (see the module doc). The zero-point
    domain is the config's (``Int4WeightOnlyConfig(zero_point_domain=...)``)."""

    name = "int4_xpu"
    impl_class = Int4XPUImpl
    device_specific = True

    @classmethod
    def linear_kernels(cls):
        return KERNELS

    def fit(self, spec, shape=None, scale_dtype=None, device=None):
        base = super().fit(spec, shape, scale_dtype, device)
        if not base.holds:
            return base
        if shape is not None and len(shape) != 2:
            return Fit(f"needs a 2-D weight, got shape {shape}")
        if spec.codebook is None and spec.zero_point_domain not in (ZeroPointDomain.INT, ZeroPointDomain.FLOAT):
            return Fit(f"holds an INT or FLOAT zero point (the XPU kernels are asymmetric), got {spec.zero_point_domain.name}")
        reason = groupwise_int4_rejects(spec, GROUP_SIZES)
        if reason is not None:
            return Fit(reason)
        if scale_dtype is not None and scale_dtype not in SCALE_DTYPES:
            return Fit(f"the XPU kernels read bf16/fp16 scales (the activation dtype), got {scale_dtype}")
        if device is not None and torch.device(device).type != "xpu":
            return Fit(not_automatic=f"XPU kernels, weight is on {device}")
        return base

    @classmethod
    def examples(cls) -> tuple[LayoutExample, ...]:
        z = ZeroPointDomain
        return (
            LayoutExample(cls(), QuantSpec((1, 32), 0, 15, z.INT), (37, 96), torch.bfloat16),  # odd N
            LayoutExample(cls(), QuantSpec((1, 64), 0, 15, z.FLOAT), (16, 200), torch.float16),  # padded K
            LayoutExample(cls(), QuantSpec((1, 128), -8, 7, z.INT), (64, 256), torch.bfloat16, torch.int16),
            LayoutExample(cls(), QuantSpec((1, 256), 0, 15, z.FLOAT), (8, 300), torch.bfloat16),
        )


def _check(x: torch.Tensor, w, bias) -> str | None:
    impl = w.tensor_impl
    if x.device.type != "xpu":
        return f"XPU kernel, input is on {x.device}"
    scale_dtype = (impl.scale if impl.scale is not None else impl.scale_and_zero).dtype
    if x.dtype != scale_dtype:
        return f"the XPU kernels take activations in the scale dtype {scale_dtype}, input is {x.dtype}"
    if w.act_quant is not None:
        return f"weight-only kernel, weight has {w.act_quant.describe()}"
    if impl.scale is not None and not hasattr(torch.ops.aten, "_weight_int4pack_mm_with_scales_and_zeros"):
        return "this torch has no aten._weight_int4pack_mm_with_scales_and_zeros (integer zero points need torch >= 2.8)"
    return None


def _linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: Int4XPUImpl = w.tensor_impl
    scales = (w.scale, w.zero) if impl.scale is not None else (w.scale_and_zero,)
    mm = lambda x2: int4_xpu_mm(x2, w.packed, impl.group_size, *scales)  # noqa: E731
    return padded_linear(x, bias, *impl.shape, *impl.padded_shape, mm)


KERNELS = (
    LinearKernel(
        "int4_xpu",
        _check,
        _linear,
        description="aten._weight_int4pack_mm (float zero) / _weight_int4pack_mm_with_scales_and_zeros (int zero) on XPU",
    ),
)
