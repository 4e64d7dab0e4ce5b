"""``Int4CPULayout``: PyTorch's CPU int4 packing for ``aten._weight_int4pack_mm_for_cpu``.

Holds any groupwise format of at most 4 bits (tinygemm float zero point, integer zero point or
symmetric) with group size ``g`` in {32, 64, 128, 256} on the CPU. Codes are shifted to
``q' = q + (8 - mid)`` in 0..15 so that the kernel's ``x̂ = (q' - 8) * s + zero`` equals the
format's dequantization, with ``zero = z`` (FLOAT), ``(mid - z) * s`` (INT) or ``0`` (NONE).

Bytes per ``[N, K]`` weight, with ``Np = ceil(N/16)*16``, ``Kp = ceil(K/g)*g``:

* ``packed``           uint8 ``[Np, Kp/2]``: ``aten._convert_weight_to_int4pack_for_cpu``'s
                       ISA-blocked nibble order (opaque; differs between CPUs, never saved);
* ``scales_and_zeros`` ``[Kp/g, Np, 2]`` (``[..., 0]`` scale, ``[..., 1]`` float zero) in
                       ``promote(scale dtype, zero dtype)``;
* ``int_zero``         the original integer zero points ``[N, Kp/g]`` (INT domain only).

Padding (extra rows, and K up to a multiple of ``g``) is sliced off on output and on unpacking.
Unpacking is exact: the nibble permutation of the packing op is measured by packing probe
codes (``log16(Np*Kp)`` calls), so it holds on any CPU whatever order the op uses.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..canonical import PlainForm
from ..dispatch import register_linear_kernel
from ..primitives import ZeroPointDomain
from .base import Layout, TensorImpl

__all__ = ["Int4CPULayout", "Int4CPUImpl"]

GROUP_SIZES = (32, 64, 128, 256)
_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def _pack(q: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    flat = packed.reshape(-1)
    return torch.stack([flat & 0xF, flat >> 4], dim=-1).reshape(-1)


@functools.lru_cache(maxsize=2)
def _nibble_sources(n: int, k: int) -> torch.Tensor:
    """``src[j]``: flat index ``row * k + col`` of the code that packing puts at nibble ``j``
    (nibble ``2i`` is the low half of byte ``i``). Measured with base-16 digit probes."""
    total = n * k
    index = torch.arange(total, dtype=torch.int64)
    src = torch.zeros(total, dtype=torch.int64)
    for p in range(max(1, math.ceil(math.log2(total) / 4))):
        digit = ((index >> (4 * p)) & 0xF).reshape(n, k)
        src |= _nibbles(_pack(digit)).to(torch.int64) << (4 * p)
    if not torch.equal(torch.bincount(src, minlength=total), torch.ones(total, dtype=torch.int64)):
        raise RuntimeError("_convert_weight_to_int4pack_for_cpu is not a nibble permutation on this build; cannot unpack")
    return src


def _unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    out = torch.empty(n * k, dtype=torch.uint8)
    out[_nibble_sources(n, k)] = _nibbles(packed.cpu())
    return out.reshape(n, k)


class Int4CPUImpl(TensorImpl):
    tensor_fields = ("packed", "scales_and_zeros", "int_zero")
    attr_fields = ("scale_dtype", "zero_dtype")

    @property
    def group_size(self) -> int:
        return self.spec.block_size[1]

    @property
    def padded_shape(self) -> tuple[int, int]:
        n, k = self.shape
        g = self.group_size
        return -(-n // 16) * 16, -(-k // g) * g

    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> Int4CPUImpl:
        spec = plain.spec
        n, k = plain.shape
        g = spec.block_size[1]
        np_, kp = -(-n // 16) * 16, -(-k // g) * g
        shift = 8 - spec.mid
        q = torch.full((np_, kp), 8, dtype=torch.int32, device=plain.device)
        q[:n, :k] = plain.codes.to(torch.int32) + shift
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
        return cls(
            layout, spec, (n, k),
            packed=_pack(q),
            scales_and_zeros=sz.transpose(0, 1).contiguous(),
            int_zero=plain.zero_point if domain is ZeroPointDomain.INT else None,
            scale_dtype=scale.dtype,
            zero_dtype=None if plain.zero_point is None else plain.zero_point.dtype,
        )

    def to_plain(self) -> PlainForm:
        spec = self.spec
        n, k = self.shape
        np_, kp = self.padded_shape
        q = _unpack(self.packed, np_, kp)[:n, :k].to(torch.int16) - (8 - spec.mid)
        codes = q.to(spec.code_dtype).to(self.packed.device)
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
    auto_priority = 20
    device_specific = True

    def rejects(self, spec, shape, scale_dtype, device):
        if torch.device(device).type != "cpu":
            return f"CPU-only layout, weight is on {device}"
        if len(shape) != 2 or spec.block_size[0] != 1:
            return f"needs groupwise blocks (1, g) on a 2-D weight, got block {spec.block_size}"
        if spec.block_size[1] not in GROUP_SIZES:
            return f"group size must be one of {GROUP_SIZES}, got {spec.block_size[1]}"
        shift = 8 - spec.mid
        if spec.quant_min + shift < 0 or spec.quant_max + shift > 15:
            return f"needs at most 4-bit codes centred for the kernel, format is {spec.describe()}"
        if not scale_dtype.is_floating_point or scale_dtype not in _FLOAT_INPUTS:
            return f"scale dtype must be fp32/bf16/fp16, got {scale_dtype}"
        return None


def _check(x: torch.Tensor, w, bias) -> str | None:
    impl = w.tensor_impl
    if not isinstance(impl.layout, Int4CPULayout):
        return f"needs Int4CPULayout, weight has {impl.layout!r}"
    if x.device.type != "cpu":
        return f"CPU kernel, input is on {x.device}"
    if x.dtype not in _FLOAT_INPUTS:
        return f"input dtype {x.dtype} not in fp32/bf16/fp16"
    if w.act_quant is not None:
        return f"weight-only kernel, weight has {w.act_quant.describe()}"
    return None


def _int4_cpu_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: Int4CPUImpl = w.tensor_impl
    n, k = impl.shape
    np_, kp = impl.padded_shape
    x2 = x.reshape(-1, k)
    if kp != k:
        x2 = F.pad(x2, (0, kp - k))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x2.contiguous(), w.packed, impl.group_size, w.scales_and_zeros.to(x.dtype)
    )
    if np_ != n:
        y = y[:, :n]
    y = y.reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)


register_linear_kernel(
    "int4_cpu",
    _check,
    _int4_cpu_linear,
    description="aten._weight_int4pack_mm_for_cpu: groupwise <=4-bit weight, float input",
    priority=0,
)
