"""``Int8VnniLayout``: per-channel int8 weights in the operand order of VNNI and AMX.

Holds symmetric per-channel int8 weights (codes in [-128, 127], no zero point, one scale per
row), the format of ``int8_weight_only`` / ``int8_dynamic_activation_int8_weight`` /
static int8. Bytes per ``[N, K]`` weight, with ``Kp = ceil(K / 64) * 64``:

* ``panels`` int8 ``[ceil(N / 16) * 16 * Kp]``: per 16 rows and 4 positions the 16 rows' 4 codes,
  code ``(n, k)`` at ``(n // 16) * 16 * Kp + (k // 4) * 64 + (n % 16) * 4 + k % 4``, zero past N
  and K (:mod:`torchq.ops.int8_panels`);
* ``code_sums`` int32 ``[N]``: each row's sum of codes (from the codes when packed);
* ``scale`` fp32 ``[N]``, the scale's own dtype and shape remembered (lossless back to plain).

The same bytes on every CPU. torchq's native int8-activation kernels read them as stored: on AMX
CPUs from 8 rows the AMX GEMM with the panels as its B tiles (activation codes as A tiles in place:
nothing packed per call); on AVX-512 VNNI otherwise a register-tiled kernel with no horizontal
sums and no per-call row sums; bf16 weight-only calls on AVX512_BF16 CPUs without AMX, the bf16
dot-product GEMM (its pair vectors converted from the panels as stored; from 1 row, where plain
codes take it from 10: there the same bits, below it a sum order of its own within the same
bound); elsewhere (AVX2, scalar, other weight-only calls: those kernels sum in row-major order)
the row-major kernels on chunks of rows unpacked into L2-sized scratch, with the plain layout's
bits.

Name it (``layout=Int8VnniLayout()`` in a config, ``weight.to_layout``); torchq's vLLM plugin takes
it for int8-activation weights (dynamic, static) on CPUs whose native int8 kernels use VNNI (``fit`` allows automatic placement
only there). The general automatic choice does not list it yet: a fit sees the format, not the
activation scheme, and LLM.int8 weights (whose kernel it lacks) share the format. A checkpoint
saved in it loads into ``plain`` on CPUs without VNNI (the layout is device-specific in that sense).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .. import native
from ..activation import PerTokenInt8, StaticInt8
from ..backends.native_cpu import library as native_library
from ..backends.native_cpu.int8 import NATIVE_MIN_CODE
from ..backends.native_cpu.int8_panels import (
    panel_dynamic_linear_cpu,
    panel_static_linear_cpu,
    panel_weight,
    panel_weight_linear_cpu,
)
from ..canonical import PlainForm, QuantSpec
from ..dispatch import LinearKernel
from ..ops.int8_panels import (
    int8_panel_dynamic_linear,
    int8_panel_static_linear,
    int8_panel_weight_linear,
    pack_panels,
    panel_numel,
    unpack_panels,
)
from ..primitives import ZeroPointDomain
from .base import Buffer, Fit, Layout, LayoutExample, TensorImpl

__all__ = ["Int8VnniLayout", "Int8VnniImpl", "PanelUnpackWarning"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class Int8VnniImpl(TensorImpl):
    tensor_fields = ("panels", "code_sums", "scale")
    attr_fields = ("scale_dtype", "scale_shape")

    def expected_tensors(self) -> dict[str, Buffer | None]:
        reason = self.layout.fit(self.spec, self.shape, self.scale_dtype).cannot_hold
        if reason is not None:
            raise ValueError(f"Int8VnniImpl: the layout cannot hold {self.spec.describe()} of shape {list(self.shape)}: {reason}")
        n, k = self.shape
        if self.scale_shape not in ((n, 1), (n,)):
            raise ValueError(f"Int8VnniImpl: scale_shape: expected ({n}, 1) or ({n},), got {self.scale_shape!r}")
        return {
            "panels": Buffer((panel_numel(n, k),), torch.int8),
            "code_sums": Buffer((n,), torch.int32),
            "scale": Buffer((n,), torch.float32),
        }

    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> Int8VnniImpl:
        n, k = plain.shape
        reason = layout.fit(plain.spec, plain.shape, plain.scale.dtype).cannot_hold
        if reason is not None:
            raise ValueError(f"Int8VnniLayout: cannot hold {plain.spec.describe()} of shape {list(plain.shape)}: {reason}")
        panels, sums = pack_panels(plain.codes.to(torch.int8))
        return cls(layout, plain.spec, (n, k), panels=panels, code_sums=sums,
                   scale=plain.scale.reshape(n).to(torch.float32).contiguous(), scale_dtype=plain.scale.dtype,
                   scale_shape=tuple(plain.scale.shape))

    def to_plain(self) -> PlainForm:
        n, k = self.shape
        return self._plain(unpack_panels(self.panels, n, k), self.scale)

    def plain_rows(self, index: torch.Tensor) -> PlainForm:
        # only the rows asked for (an embedding lookup on a tied weight): row n is lane n % 16 of
        # panel n // 16, 4 codes per 64-byte step
        n, k = self.shape
        kp = panel_numel(16, k) // 16
        by_panel = self.panels.view(-1, kp // 4, 16, 4)
        codes = by_panel[index // 16, :, index % 16, :].reshape(*index.shape, kp)[..., :k]
        return self._plain(codes, self.scale[index])

    def _plain(self, codes: torch.Tensor, scale: torch.Tensor) -> PlainForm:
        shape = (codes.shape[0], 1) if len(self.scale_shape) == 2 else (codes.shape[0],)
        return PlainForm(codes.to(self.spec.code_dtype), scale.to(self.scale_dtype).reshape(shape), None, self.spec)

    def narrow_view(self, dim: int, start: int, length: int) -> Int8VnniImpl | None:
        n, k = self.shape
        if dim != 0 or start % 16 or (length % 16 and start + length != n):
            return None  # a slice that does not start and end on whole panels: through the plain form
        kp = panel_numel(16, k) // 16
        panels = self.panels[start * kp:(start + -(-length // 16) * 16) * kp]
        return type(self)(self.layout, self.spec, (length, k), panels=panels, code_sums=self.code_sums[start:start + length],
                          scale=self.scale[start:start + length], scale_dtype=self.scale_dtype,
                          scale_shape=(length, 1) if len(self.scale_shape) == 2 else (length,))


def _vnni_active() -> bool:
    return "avx512_vnni" in native.status().features


@dataclass(frozen=True)
class Int8VnniLayout(Layout):
    """Per-channel int8 weights in VNNI / AMX operand order (portable bytes; CPU kernels)."""

    name = "int8_vnni"
    impl_class = Int8VnniImpl
    # The bytes are the same on every CPU, but only torchq's CPU kernels read them, and they pay only
    # with VNNI: a move to another device, or a "saved"-policy load on a CPU without VNNI, repacks
    # through the plain form into that device's choice.
    device_specific = True

    @classmethod
    def linear_kernels(cls):
        return KERNELS

    def fit(self, spec, shape=None, scale_dtype=None, device=None):
        base = super().fit(spec, shape, scale_dtype, device)
        if not base.holds:
            return base
        if (shape is not None and len(shape) != 2) or len(spec.block_size) != 2:
            return Fit(f"needs a 2-D weight, got block {spec.block_size}")
        if shape is not None and spec.block_size != (1, shape[1]):
            return Fit(f"needs per-channel scales (block 1x{shape[1]}), got block {spec.block_size}")
        if spec.block_size[0] != 1:
            return Fit(f"needs per-channel scales (blocks of one row), got block {spec.block_size}")
        if spec.zero_point_domain is not ZeroPointDomain.NONE or not spec.signed or spec.quant_min < -128 or spec.quant_max > 127:
            return Fit(f"needs symmetric signed int8 codes with no zero point, format is {spec.describe()}")
        if scale_dtype is not None and scale_dtype not in _FLOATS:
            return Fit(f"scale dtype must be fp32/bf16/fp16, got {scale_dtype}")
        if device is None:
            return base
        device = torch.device(device)
        if device.type != "cpu":
            return Fit(not_automatic=f"its kernels run on the CPU, weight is on {device}")
        if not native.available():
            return Fit(not_automatic=f"the native library is not available ({native.status().reason})")
        if not _vnni_active():
            return Fit(not_automatic=f"its decode kernel needs AVX-512 VNNI (native kernels: {native.status().isa}, "
                                     f"features {list(native.status().features)}); the plain layout's need no unpacking")
        return base

    @classmethod
    def examples(cls) -> tuple[LayoutExample, ...]:
        z = ZeroPointDomain
        return (
            LayoutExample(cls(), QuantSpec((1, 200), -128, 127, z.NONE), (96, 200)),
            LayoutExample(cls(), QuantSpec((1, 70), -127, 127, z.NONE), (33, 70), torch.bfloat16),  # partial panel, padded K
            LayoutExample(cls(), QuantSpec((1, 5), -128, 127, z.NONE), (17, 5), torch.float16),
        )


class PanelUnpackWarning(UserWarning):
    """An ``int8_vnni`` weight runs where torchq's int8 kernels lack VNNI: its rows are unpacked
    per call (about half the plain layout's speed at one row on AVX2)."""


_WARNED_UNPACKED: set[str | None] = set()


def _warn_unpacked(w) -> None:
    label = getattr(w, "label", None)
    if label in _WARNED_UNPACKED or _vnni_active() or not native.available():
        return
    _WARNED_UNPACKED.add(label)
    where = f"layer {label!r}" if label else "a layer"
    warnings.warn(f"torchq: {where} holds its int8 weight in the int8_vnni layout, but this CPU's native int8 kernels "
                  f"run without AVX-512 VNNI ({native.status().isa}): each call unpacks the rows (about 2x slower at one row "
                  f"than the plain layout). Repack it (weight.to_layout(PlainLayout())) or leave the layout to automatic choice.",
                  PanelUnpackWarning, stacklevel=4)


def _check(x: torch.Tensor, w, bias, want_act) -> str | None:
    if x.device.type != "cpu":
        return f"CPU kernel, input is on {x.device}"
    _warn_unpacked(w)
    act = w.act_quant
    if want_act is None:
        if act is not None:
            return f"weight-only kernel, weight has {act.describe()}"
        return None
    if not isinstance(act, want_act):
        return f"needs {want_act.__name__} activations, weight has {'none' if act is None else act.describe()}"
    return None


def _native_weight(impl: Int8VnniImpl) -> native_library.NativeWeight | None:
    """The impl's tensors as a native weight (cached per impl by the caller); None without the library."""
    if native_library.library() is None or not all(t.is_contiguous() for t in (impl.panels, impl.code_sums, impl.scale)):
        return None  # (the eager paths run on contiguous copies)
    n, k = impl.shape
    return panel_weight("int8_panel_weight_linear", impl.panels, impl.code_sums, impl.scale, n, k)


def _tensors(impl: Int8VnniImpl) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The impl's tensors for an eager native call: contiguous (copies where they are not)."""
    return impl.panels.contiguous(), impl.code_sums.contiguous(), impl.scale.contiguous()


def _dynamic_args(w) -> tuple[int, int, float]:
    a = w.act_quant
    return a.quant_min, a.quant_max, a.eps


def _static_args(w) -> tuple[float, int, int, int]:
    a = w.act_quant
    return a.scale, a.zero_point, a.quant_min, a.quant_max


def _native_range(w) -> bool:
    return native_library.library() is not None and w.act_quant.quant_min >= NATIVE_MIN_CODE


def _weight_only(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: Int8VnniImpl = w.tensor_impl
    out = native_library.decode_linear(impl, x, bias, _native_weight)
    if out is not None:  # decode-sized, eager CPU: the least Python per call
        return out
    if not native_library.eager_cpu(x):
        return int8_panel_weight_linear(x, impl.panels, impl.code_sums, impl.scale, bias)
    impl.validate()
    return panel_weight_linear_cpu(x, *_tensors(impl), *impl.shape, bias)


def _dynamic(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: Int8VnniImpl = w.tensor_impl
    args = _dynamic_args(w)
    if _native_range(w):
        out = native_library.decode_linear(impl, x, bias, _native_weight, args)
        if out is not None:
            return out
    if not native_library.eager_cpu(x):
        return int8_panel_dynamic_linear(x, impl.panels, impl.code_sums, impl.scale, *args, bias)
    impl.validate()
    return panel_dynamic_linear_cpu(x, *_tensors(impl), *args, bias)


def _static(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl: Int8VnniImpl = w.tensor_impl
    args = _static_args(w)
    if _native_range(w):
        out = native_library.decode_linear(impl, x, bias, _native_weight, static=args)
        if out is not None:
            return out
    if not native_library.eager_cpu(x):
        return int8_panel_static_linear(x, impl.panels, impl.code_sums, impl.scale, *args, bias)
    impl.validate()
    return panel_static_linear_cpu(x, *_tensors(impl), *args, bias)


def _bind(x, w, kind):
    if kind != "weight" and not _native_range(w):
        return None
    if kind == "dynamic":
        return native_library.bind_linear(w.tensor_impl, x, _native_weight, _dynamic_args(w))
    if kind == "static":
        return native_library.bind_linear(w.tensor_impl, x, _native_weight, static=_static_args(w))
    return native_library.bind_linear(w.tensor_impl, x, _native_weight)


KERNELS = (
    LinearKernel(
        "int8_vnni_weight_only_native",
        lambda x, w, b: _check(x, w, b, None),
        _weight_only,
        description="torchq::int8_panel_weight_linear: native fused dequantize + dot over the panels (fp32/bf16/fp16 input; "
        "bf16 AMX from 32 rows)",
        bind=lambda x, w, b: _bind(x, w, "weight"),
    ),
    LinearKernel(
        "int8_vnni_dynamic_native",
        lambda x, w, b: _check(x, w, b, PerTokenInt8),
        _dynamic,
        description="torchq::int8_panel_dynamic_linear: per-token int8 activations x the panels (VNNI register tiles to "
        "7 rows, AMX B tiles from 8, row kernels on unpacked chunks elsewhere), fp32 rescale",
        bind=lambda x, w, b: _bind(x, w, "dynamic"),
    ),
    LinearKernel(
        "int8_vnni_static_native",
        lambda x, w, b: _check(x, w, b, StaticInt8),
        _static,
        description="torchq::int8_panel_static_linear: static (calibrated) int8 activations x the panels, fp32 rescale",
        bind=lambda x, w, b: _bind(x, w, "static"),
    ),
)
