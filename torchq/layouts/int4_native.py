"""``Int4NativeLayout``: groupwise <=4-bit weights packed for torchq's native CPU kernels.

Holds any groupwise affine format of at most 4 bits (tinygemm float zero point, integer zero
point or symmetric) with a power-of-two group size ``g`` from 32 to 1024. The bytes are the same
on every CPU (unlike ``Int4CPULayout``'s ISA-blocked order), and the kernel
``torchq::int4_groupwise_linear`` (``csrc/lut4_linear*``) streams them at close to the
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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import native, triton_kernels
from ..canonical import PlainForm, QuantSpec
from ..dispatch import LinearKernel, check_op_devices
from ..prefill import tile_dtype, tiled_linear, use_tiles
from ..primitives import ZeroPointDomain
from .base import Buffer, Fit, Layout, LayoutExample, TensorImpl

__all__ = ["Int4NativeLayout", "Int4NativeImpl", "int4_groupwise_linear"]

GROUP_SIZES = (32, 64, 128, 256, 512, 1024)
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_INT_ZERO_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
# Rounding kinds of the C kernel: 0 none (fp32 arithmetic), 1 bf16, 2 fp16.
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ROUND_DTYPE = {v: k for k, v in _ROUND.items()}


def _pack_nibbles(u: torch.Tensor, kp: int) -> torch.Tensor:
    n, k = u.shape
    if kp != k:
        u = F.pad(u, (0, kp - k))
    return (u[:, 0::2] << 4) | u[:, 1::2]


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    n = packed.shape[0]
    return torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(n, -1)


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
        return _ROUND[self.scale_dtype], _ROUND[add]

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
        spec = self.spec
        n, k = self.shape
        u = _unpack_nibbles(self.packed)[:, :k]
        codes = (u.to(torch.int16) + spec.quant_min).to(spec.code_dtype)
        domain = spec.zero_point_domain
        if domain is ZeroPointDomain.FLOAT:
            zero = self.zero.to(self.zero_dtype)
        elif domain is ZeroPointDomain.INT:
            zero = self.int_zero
        else:
            zero = None
        return PlainForm(codes, self.scale.to(self.scale_dtype), zero, spec)

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
            return Fit(not_automatic=triton_kernels.unavailable_reason())
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


def check_int4_groupwise_linear_args(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias) -> None:
    if len(shape) != 2:
        raise ValueError(f"shape: expected [N, K], got {list(shape)}")
    n, k = shape
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {GROUP_SIZES}, got {group_size}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"x: expected fp32, bf16 or fp16, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dimension K={k}, got shape {list(x.shape)}")
    kp = -(-k // group_size) * group_size
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (n, kp // 2):
        raise ValueError(f"packed: expected uint8 [{n}, {kp // 2}], got {packed.dtype} {list(packed.shape)}")
    grid = (n, kp // group_size)
    for name, t in (("scale", scale), ("shift", shift), ("zero", zero)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != grid):
            raise ValueError(f"{name}: expected fp32 {list(grid)}, got {t.dtype} {list(t.shape)}")
    if shift is not None and zero is not None:
        raise ValueError("shift, zero: an integer zero point (shift) and a float one (zero) exclude each other")
    for name, v in (("round_mul", round_mul), ("round_add", round_add)):
        if v not in _ROUND_DTYPE:
            raise ValueError(f"{name}: expected 0 (fp32), 1 (bf16) or 2 (fp16), got {v}")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias: expected {n} entries, got shape {list(bias.shape)}")


def _rounded(t: torch.Tensor, kind: int) -> torch.Tensor:
    return t if kind == 0 else t.to(_ROUND_DTYPE[kind]).to(torch.float32)


def dequantize_int4_native(packed, scale, shift, zero, k, group_size, code_base, round_mul, round_add, dtype) -> torch.Tensor:
    """The reference weight ``[N, K]`` in ``dtype`` (pure PyTorch; see the module doc)."""
    v = _unpack_nibbles(packed).to(torch.float32) + code_base
    full = lambda t: t.repeat_interleave(group_size, dim=1)  # noqa: E731
    if shift is not None:
        v = v + full(shift)
    v = _rounded(v * full(scale), round_mul)
    if zero is not None:
        v = _rounded(v + full(zero), round_add)
    return v[:, :k].to(dtype)


@torch.library.custom_op("torchq::int4_groupwise_linear", mutates_args=())
def int4_groupwise_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor | None,
    zero: torch.Tensor | None,
    shape: Sequence[int],
    group_size: int,
    code_base: float,
    round_mul: int,
    round_add: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` in x's dtype for an :class:`Int4NativeLayout` weight. The reference:
    dequantize (bit-exact to ``dequantize_affine``), cast once to x's dtype, ``F.linear``."""
    check_int4_groupwise_linear_args(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias)
    w = dequantize_int4_native(packed, scale, shift, zero, shape[1], group_size, code_base, round_mul, round_add, x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


@int4_groupwise_linear.register_fake
def _(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias=None):
    check_op_devices("int4_groupwise_linear", x, packed=packed, scale=scale, shift=shift, zero=zero, bias=bias)
    return x.new_empty((*x.shape[:-1], shape[0]))


_CODEBOOKS: dict[float, torch.Tensor] = {}


def _codebook(code_base: float) -> torch.Tensor:
    if code_base not in _CODEBOOKS:
        _CODEBOOKS[code_base] = torch.arange(16, dtype=torch.float32) + code_base
    return _CODEBOOKS[code_base]


@torch.library.register_kernel("torchq::int4_groupwise_linear", "cpu")
def int4_groupwise_linear_cpu(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias=None):
    """Native: fused dequantize + dot in fp32 (weights exactly the reference's values, one
    rounding to x's dtype at the end), or dequantized tiles + torch.mm (:func:`torchq.prefill.use_tiles`)."""
    check_int4_groupwise_linear_args(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias)
    return _linear_cpu(x, packed, scale, shift, zero, shape[0], shape[1], group_size, code_base, round_mul, round_add, bias)


def _native_weight(packed, scale, shift, zero, n, k, group_size, code_base, round_mul, round_add) -> native.NativeWeight:
    """An ``[n, k]`` weight for the native kernel, every buffer checked to hold what the kernel
    reads (contiguous CPU tensors)."""
    op = "int4_groupwise_linear"
    if group_size not in GROUP_SIZES:
        raise ValueError(f"torchq {op}: group_size: expected one of {GROUP_SIZES}, got {group_size}")
    return native.lut4_weight(op, n, k, group_size, packed, _codebook(code_base), scales=scale, shifts=shift, zeros=zero,
                              round_mul=round_mul, round_add=round_add)


def _linear_cpu(x, packed, scale, shift, zero, n, k, group_size, code_base, round_mul, round_add, bias) -> torch.Tensor:
    """The CPU kernel on checked arguments."""
    lib = native.library()
    if lib is None or x.numel() == 0:
        if lib is None:
            native.warn_reference("int4_groupwise_linear")
        w = dequantize_int4_native(packed, scale, shift, zero, k, group_size, code_base, round_mul, round_add, x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    packed, scale = packed.contiguous(), scale.contiguous()  # no copies for the layout's own tensors
    shift = None if shift is None else shift.contiguous()
    zero = None if zero is None else zero.contiguous()
    weight = _native_weight(packed, scale, shift, zero, n, k, group_size, code_base, round_mul, round_add)
    m = x.numel() // k
    if not use_tiles(m, x.dtype):
        return native.run_linear(weight, x, bias)
    kp = weight.row_length

    def dequant_rows(n0: int, n1: int, w: torch.Tensor) -> None:
        # padded rows: dequantize into a [rows, Kp] buffer, keep the first K columns
        full = w if kp == k else torch.empty(n1 - n0, kp, dtype=w.dtype)
        native.dequantize_rows(weight, n0, n1, full)
        if full is not w:
            w.copy_(full[:, :k])

    b = native.checked_bias(bias, n, "int4_groupwise_linear")
    out = tiled_linear(x.reshape(m, k), n, k, dequant_rows, tile_dtype(x.dtype), b)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def _setup(ctx, inputs, output) -> None:
    x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias = inputs
    ctx.save_for_backward(packed, scale, shift, zero)
    ctx.meta = (list(shape), group_size, code_base, round_mul, round_add, x.dtype, bias is not None,
                None if bias is None else bias.dtype)


def _backward(ctx, grad):
    packed, scale, shift, zero = ctx.saved_tensors
    shape, group_size, code_base, round_mul, round_add, x_dtype, has_bias, bias_dtype = ctx.meta
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = dequantize_int4_native(packed, scale, shift, zero, shape[1], group_size, code_base, round_mul, round_add, grad.dtype)
        grad_x = (grad @ w).to(x_dtype)
    if has_bias and ctx.needs_input_grad[10]:
        grad_bias = grad.reshape(-1, shape[0]).sum(0).to(bias_dtype)
    return grad_x, None, None, None, None, None, None, None, None, None, grad_bias


torch.library.register_autograd("torchq::int4_groupwise_linear", _backward, setup_context=_setup)


def _check_linear(x: torch.Tensor, w, bias) -> str | None:
    if w.act_quant is not None:
        return f"weight-only kernel, weight has {w.act_quant.describe()}"
    if x.device.type != "cpu":
        return triton_kernels.cuda_rejects(x)
    return None


def _cached_native_weight(impl: Int4NativeImpl) -> native.NativeWeight | None:
    """:func:`_native_weight` of a layout's tensors, or None unless all are contiguous (it is
    cached for the impl's lifetime by :func:`torchq.native.weight_args`)."""
    if not all(t is None or t.is_contiguous() for t in (impl.packed, impl.scale, impl.shift, impl.zero)):
        return None
    return _native_weight(impl.packed, impl.scale, impl.shift, impl.zero, *impl.shape, impl.group_size, impl.code_base,
                          *impl.round_kinds)


def _int4_native_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: Int4NativeImpl = w.tensor_impl
    n, k = impl.shape
    if native.eager_cpu(x):  # arguments come from a validated layout: the op's checks are skipped
        weight = native.decode_weight(impl, x, _cached_native_weight)
        if weight is not None:  # decode-sized: the least Python per call
            return native.run_linear(weight, x, bias)
        impl.validate()  # cheap next to a prefill; the decode path's pointers were checked when cached
        return _linear_cpu(x, impl.packed, impl.scale, impl.shift, impl.zero, n, k, impl.group_size, impl.code_base,
                           *impl.round_kinds, bias)
    return int4_groupwise_linear(x, impl.packed, impl.scale, impl.shift, impl.zero, [n, k], impl.group_size, impl.code_base,
                                 *impl.round_kinds, bias)


KERNELS = (
    LinearKernel(
        "int4_native",
        _check_linear,
        _int4_native_linear,
        description="torchq::int4_groupwise_linear: native fused dequantize + dot (CPU), Triton dequantize-GEMM / "
        "split-K GEMV (CUDA)",
    ),
)
