"""``Int4NativeLayout``: groupwise <=4-bit weights packed for torchq's native CPU kernels.

Holds any groupwise affine format of at most 4 bits (tinygemm float zero point, integer zero
point or symmetric) with a power-of-two group size ``g`` from 32 to 1024. The bytes are the same
on every CPU (unlike ``Int4CPULayout``'s ISA-blocked order), and the kernel
``torchq::int4_groupwise_linear`` (:mod:`torchq.ops.int4`, ``csrc/lut4_linear*``) streams them at close to the
memory bandwidth for fp32, bf16 and fp16 activations.

Bytes per ``[N, K]`` weight, with ``Kp = ceil(K / g) * g`` and ``G = Kp / g``:

* ``packed`` uint8 ``[N, Kp / 2]``: unsigned codes ``u = q - quant_min`` (0..15), element ``2j``
  of a row in the high nibble of byte ``j`` (the NF4 / ``PackedBitsLayout`` order); the padding
  columns hold 0 and meet zero activations;
* ``scale`` fp32 ``[N, G]``;
* ``zero`` fp32 ``[N, G]``: the float zero point (ZeroPointDomain.FLOAT only);
* ``shift`` fp32 ``[N, G]``: ``-z`` for an integer zero point ``z`` (ZeroPointDomain.INT only),
  with the original zero points kept in ``int_zero``.

Scales and zeros are held in fp32 (exact for bf16 / fp16 ones) and the original dtypes are
remembered, so converting back to the plain form is lossless. Each weight is
``v = R_mul((u + code_base + shift) * scale)`` then ``R_add(v + zero)``, with the roundings
``R`` to the arithmetic dtype of :func:`torchq.primitives.dequantize_affine`: bit for bit the
reference's dequantized value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import native
from ..backends import triton as triton_backend
from ..backends.native_cpu import library as native_library
from ..backends.native_cpu.lut4 import int4_linear_cpu, int4_native_weight, int8_activation_rejects
from ..canonical import PlainForm, QuantSpec
from ..dispatch import LinearKernel
from ..ops.int4 import INT4_GROUPWISE_GROUP_SIZES as GROUP_SIZES
from ..ops.int4 import ROUND_KIND, int4_groupwise_linear, unpack_nibbles
from ..ops.int8act import int4_groupwise_linear_a8
from ..primitives import ZeroPointDomain
from .base import Buffer, Fit, Layout, LayoutExample, TensorImpl

__all__ = ["Int4NativeLayout", "Int4NativeImpl"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INT_ZERO_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def _pack_nibbles(u: torch.Tensor, kp: int) -> torch.Tensor:
    n, k = u.shape
    if kp != k:
        u = F.pad(u, (0, kp - k))
    return (u[:, 0::2] << 4) | u[:, 1::2]


class Int4NativeImpl(TensorImpl):
    tensor_fields = ("packed", "scale", "zero", "shift", "int_zero")
    attr_fields = ("scale_dtype", "zero_dtype")

    @property
    def group_size(self) -> int:
        return self.spec.block_size[1]

    @property
    def padded_k(self) -> int:
        return self.packed.shape[1] * 2

    @property
    def code_base(self) -> float:
        """What the kernel adds to an unsigned code before scaling (besides ``shift``)."""
        spec = self.spec
        if spec.zero_point_domain is ZeroPointDomain.FLOAT:
            return float(spec.quant_min - spec.mid)
        return float(spec.quant_min)

    @property
    def round_kinds(self) -> tuple[int, int]:
        """Rounding after the multiply (scale dtype) and after the add (promoted with the zero)."""
        add = self.scale_dtype if self.zero is None else torch.promote_types(self.scale_dtype, self.zero_dtype)
        return ROUND_KIND[self.scale_dtype], ROUND_KIND[add]

    def expected_tensors(self) -> dict[str, Buffer | None]:
        spec = self.spec
        reason = self.layout.fit(spec, self.shape, self.scale_dtype, self.device).cannot_hold
        if reason is not None:
            raise ValueError(f"Int4NativeImpl: the layout cannot hold {spec.describe()} of shape {list(self.shape)}: {reason}")
        domain = spec.zero_point_domain
        allowed = {ZeroPointDomain.NONE: (None,), ZeroPointDomain.FLOAT: _FLOATS, ZeroPointDomain.INT: _INT_ZERO_DTYPES}[domain]
        if self.zero_dtype not in allowed:
            raise ValueError(f"Int4NativeImpl: zero_dtype: expected one of {allowed} for zero_point_domain {domain.name}, "
                             f"got {self.zero_dtype!r}")
        n, k = self.shape
        g = self.group_size
        kp = -(-k // g) * g
        grid = Buffer((n, kp // g), torch.float32)
        return {
            "packed": Buffer((n, kp // 2), torch.uint8),
            "scale": grid,
            "zero": grid if domain is ZeroPointDomain.FLOAT else None,
            "shift": grid if domain is ZeroPointDomain.INT else None,
            "int_zero": Buffer((n, kp // g), self.zero_dtype) if domain is ZeroPointDomain.INT else None,
        }

    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> Int4NativeImpl:
        spec = plain.spec
        n, k = plain.shape
        g = spec.block_size[1]
        kp = -(-k // g) * g
        u = (plain.codes.to(torch.int16) - spec.quant_min).to(torch.uint8)
        domain = spec.zero_point_domain
        zp = plain.zero_point
        return cls(
            layout, spec, (n, k),
            packed=_pack_nibbles(u, kp).contiguous(),
            scale=plain.scale.to(torch.float32).contiguous(),
            zero=zp.to(torch.float32).contiguous() if domain is ZeroPointDomain.FLOAT else None,
            shift=(-zp.to(torch.float32)).contiguous() if domain is ZeroPointDomain.INT else None,
            int_zero=zp if domain is ZeroPointDomain.INT else None,
            scale_dtype=plain.scale.dtype,
            zero_dtype=None if zp is None else zp.dtype,
        )

    def to_plain(self) -> PlainForm:
        return self._plain(self.packed, self.scale, self.zero, self.int_zero)

    def plain_rows(self, index: torch.Tensor) -> PlainForm:
        # the gathered rows' tensors straight into the plain form: no impl of index.numel() rows,
        # whose constructor would turn a traced (symbolic) row count into a constant
        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return self._plain(rows(self.packed), rows(self.scale), rows(self.zero), rows(self.int_zero))

    def _plain(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               int_zero: torch.Tensor | None) -> PlainForm:
        """The plain form of rows of this weight, given their packed codes, scales and zeros."""
        spec = self.spec
        u = unpack_nibbles(packed)[:, :self.shape[1]]
        codes = (u.to(torch.int16) + spec.quant_min).to(spec.code_dtype)
        domain = spec.zero_point_domain
        if domain is ZeroPointDomain.FLOAT:
            zp = zero.to(self.zero_dtype)
        elif domain is ZeroPointDomain.INT:
            zp = int_zero
        else:
            zp = None
        return PlainForm(codes, scale.to(self.scale_dtype), zp, spec)

    def narrow_view(self, dim: int, start: int, length: int) -> Int4NativeImpl | None:
        if dim != 0:
            return None
        end = start + length
        fields = {f: (None if getattr(self, f) is None else getattr(self, f)[start:end]) for f in self.tensor_fields}
        return type(self)(self.layout, self.spec, (length, self.shape[1]), **fields,
                          scale_dtype=self.scale_dtype, zero_dtype=self.zero_dtype)


@dataclass(frozen=True)
class Int4NativeLayout(Layout):
    """Groupwise <=4-bit weights in the byte order of torchq's native CPU kernels (portable bytes)."""

    name = "int4_native"
    impl_class = Int4NativeImpl

    @classmethod
    def linear_kernels(cls):
        return KERNELS

    def fit(self, spec, shape=None, scale_dtype=None, device=None):
        base = super().fit(spec, shape, scale_dtype, device)
        if not base.holds:
            return base
        if (shape is not None and len(shape) != 2) or len(spec.block_size) != 2 or spec.block_size[0] != 1:
            return Fit(f"needs groupwise blocks (1, g) on a 2-D weight, got block {spec.block_size}")
        if spec.block_size[1] not in GROUP_SIZES:
            return Fit(f"group size must be one of {GROUP_SIZES}, got {spec.block_size[1]}")
        if spec.quant_max - spec.quant_min > 15:
            return Fit(f"needs at most 16 code values, format is {spec.describe()}")
        if scale_dtype is not None and scale_dtype not in _FLOATS:
            return Fit(f"scale dtype must be fp32/bf16/fp16, got {scale_dtype}")
        if device is None:
            return base
        device = torch.device(device)
        if device.type == "cuda":
            return Fit(not_automatic=triton_backend.unavailable_reason())
        if device.type != "cpu":
            return Fit(not_automatic=f"its kernels run on the CPU (native) and CUDA (Triton), weight is on {device}")
        if not native.available():
            return Fit(not_automatic=f"the native library is not available ({native.status().reason})")
        return base

    @classmethod
    def examples(cls) -> tuple[LayoutExample, ...]:
        z = ZeroPointDomain
        return (
            LayoutExample(cls(), QuantSpec((1, 32), 0, 15, z.INT), (67, 96)),  # odd N
            LayoutExample(cls(), QuantSpec((1, 64), -8, 7, z.NONE), (33, 200), torch.bfloat16),  # padded K
            LayoutExample(cls(), QuantSpec((1, 128), 0, 15, z.FLOAT), (16, 256), torch.float16, torch.bfloat16),
            LayoutExample(cls(), QuantSpec((1, 256), -4, 3, z.NONE), (9, 256)),  # 3 bits
            LayoutExample(cls(), QuantSpec((1, 1024), 0, 15, z.INT), (5, 300), torch.bfloat16, torch.int32),  # K < group
        )


def _check_linear(x: torch.Tensor, w, bias) -> str | None:
    if w.act_quant is not None:
        return f"weight-only kernel, weight has {w.act_quant.describe()}"
    if x.device.type != "cpu":
        return triton_backend.cuda_rejects(x)
    return None


def _cached_native_weight(impl: Int4NativeImpl) -> native_library.NativeWeight | None:
    """:func:`~torchq.backends.native_cpu.lut4.int4_native_weight` of a layout's tensors, or None unless all are contiguous (it is
    cached for the impl's lifetime by :func:`torchq.backends.native_cpu.library.weight_args`)."""
    if not all(t is None or t.is_contiguous() for t in (impl.packed, impl.scale, impl.shift, impl.zero)):
        return None
    return int4_native_weight(impl.packed, impl.scale, impl.shift, impl.zero, *impl.shape, impl.group_size, impl.code_base,
                          *impl.round_kinds)


def _int4_native_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: Int4NativeImpl = w.tensor_impl
    out = native_library.decode_linear(impl, x, bias, _cached_native_weight)
    if out is not None:  # decode-sized, eager CPU: the least Python per call
        return out
    n, k = impl.shape
    if native_library.eager_cpu(x):  # arguments come from a validated layout: the op's checks are skipped
        impl.validate()  # cheap next to a prefill; the decode path's pointers were checked when cached
        return int4_linear_cpu(x, impl.packed, impl.scale, impl.shift, impl.zero, n, k, impl.group_size, impl.code_base,
                           *impl.round_kinds, bias)
    op = triton_backend.int4_groupwise_linear_cuda if triton_backend.eager_cuda(x) else int4_groupwise_linear
    return op(x, impl.packed, impl.scale, impl.shift, impl.zero, [n, k], impl.group_size, impl.code_base, *impl.round_kinds, bias)


def _check_int8_activations(x: torch.Tensor, w, bias) -> str | None:
    reason = int8_activation_rejects(x, w.act_quant, triton_backend.cuda_rejects)
    if reason is not None:
        return reason
    if w.tensor_impl.round_kinds != (0, 0):
        return f"needs fp32 scales and zeros, weight has scale dtype {w.tensor_impl.scale_dtype}"
    return None


def _int8_activation_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: Int4NativeImpl = w.tensor_impl
    n, k = impl.shape
    if native_library.eager_cpu(x) and x.numel() and native_library.library() is not None:
        weight = native_library.weight_args(impl, _cached_native_weight)
        if weight is not None:  # the layout's own tensors, checked when cached
            return native_library.run_linear(weight.int8_activations(), x, bias)
    op = triton_backend.int4_groupwise_linear_a8_cuda if triton_backend.eager_cuda(x) else int4_groupwise_linear_a8
    return op(x, impl.packed, impl.scale, impl.shift, impl.zero, [n, k], impl.group_size, impl.code_base, bias)


KERNELS = (
    LinearKernel(
        "int4_native",
        _check_linear,
        _int4_native_linear,
        description="torchq::int4_groupwise_linear: native fused dequantize + dot (CPU), Triton dequantize-GEMM / "
        "split-K GEMV (CUDA)",
        bind=lambda x, w, b: native_library.bind_linear(w.tensor_impl, x, _cached_native_weight),
    ),
    LinearKernel(
        "int4_int8_activations",
        _check_int8_activations,
        _int8_activation_linear,
        description="torchq::int4_groupwise_linear_a8: activations quantized per 32-block to int8, integer dot products "
        "(native CPU: vpmaddubsw; from 5 rows vpdpbusd on AVX-512 VNNI CPUs); CUDA: Triton int8 tensor cores above 4 rows, the 4-bit GEMV on the "
        "block-dequantized activations up to 4",
        bind=lambda x, w, b: native_library.bind_linear(w.tensor_impl, x, _cached_native_weight, int8_activations=True),
    ),
)
