"""``PlainLayout``: the canonical plain form stored as it is.

Bytes per ``[N, K]`` weight: ``N*K`` codes of one byte (int8 for signed ranges, uint8 for
unsigned), plus ``scale`` (and ``zero_point``) of shape ``ceil([N, K] / block_size)`` in their
own dtypes. Works on every device. Its kernels, in the order they are tried (CPU unless noted):

* ``int8_weight_only_cpu``: per-channel symmetric int8 weights ([-128, 127], no zero point)
  through ``aten._weight_int8pack_mm``, for fp32/bf16/fp16 inputs (bf16 is ~10x faster on CPU:
  a config with ``compute_dtype=torch.bfloat16`` runs fp32/fp16 inputs in it);
* ``int8_dynamic_cpu``: per-token dynamic int8 activations x per-channel int8 weights through
  ``torch._int_mm`` (int32 accumulation), rescaled in fp32;
* ``int8_static_cpu``: static (calibrated) int8 activations (:class:`~torchq.activation.StaticInt8`)
  x per-channel int8 weights, the same way (the reference of ``torchq::int8_static_linear``).

Ahead of those, when torchq's native library is available (:mod:`torchq.native`):
``int8_weight_only_native`` (``torchq::int8_weight_linear``, every activation dtype) and
``int8_dynamic_native`` (``torchq::int8_dynamic_linear``, bit-equal to ``int8_dynamic_cpu``) and
``int8_static_native`` (``torchq::int8_static_linear``, bit-equal to ``int8_static_cpu``).
On CUDA: ``int8_dynamic_triton`` and ``int8_static_triton`` (the ops' Triton kernels, bit-equal as well). Last,
``llm_int8_cpu`` for LLM.int8 weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import native
from ..activation import OutlierInt8, PerTokenInt8, StaticInt8
from ..backends import triton as triton_backend
from ..backends.native_cpu import library as native_library
from ..backends.native_cpu.int8 import NATIVE_MIN_CODE, dynamic_linear_cpu, static_linear_cpu, weight_linear_cpu
from ..canonical import PlainForm, QuantSpec
from ..dispatch import LinearKernel
from ..division import divide
from ..ops.int8 import int8_dynamic_linear, int8_static_linear, int8_static_reference, int8_weight_linear, int8_weight_only_mm
from ..primitives import ZeroPointDomain
from ..tracing import traced
from .base import Buffer, Layout, LayoutExample, TensorImpl, plain_buffers

__all__ = ["PlainLayout", "PlainImpl"]



class PlainImpl(TensorImpl):
    tensor_fields = ("codes", "scale", "zero_point")

    def expected_tensors(self) -> dict[str, Buffer | None]:
        return {"codes": Buffer(self.shape, self.spec.code_dtype), **plain_buffers(self.spec, self.shape)}

    @classmethod
    def from_plain(cls, plain: PlainForm, layout: Layout) -> PlainImpl:
        return cls(layout, plain.spec, plain.shape, codes=plain.codes, scale=plain.scale, zero_point=plain.zero_point)

    def to_plain(self) -> PlainForm:
        return PlainForm(self.codes, self.scale, self.zero_point, self.spec)

    def narrow_view(self, dim: int, start: int, length: int) -> PlainImpl:
        return self.from_plain(self.to_plain().narrow(dim, start, length), self.layout)


@dataclass(frozen=True)
class PlainLayout(Layout):
    """Unpacked codes, one byte each. Accepts every format on every device (codebook formats too,
    but not double-quantized scales)."""

    name = "plain"
    impl_class = PlainImpl
    holds_codebooks = True

    @classmethod
    def linear_kernels(cls):
        return KERNELS

    @classmethod
    def examples(cls) -> tuple[LayoutExample, ...]:
        z = ZeroPointDomain
        return (
            LayoutExample(cls(), QuantSpec((1, 200), -128, 127, z.NONE), (96, 200)),  # int8 per channel
            LayoutExample(cls(), QuantSpec((1, 200), -127, 127, z.NONE), (33, 200), torch.bfloat16),
            LayoutExample(cls(), QuantSpec((1, 32), 0, 7, z.INT), (65, 96), torch.bfloat16),  # 3-bit groupwise
            LayoutExample(cls(), QuantSpec((1, 64), -8, 7, z.FLOAT), (40, 200), torch.float16),  # padded K
            LayoutExample(cls(), QuantSpec((2, 32), 0, 255, z.INT), (34, 64), zero_dtype=torch.int32),  # 2-D blocks
            LayoutExample(cls(), QuantSpec((1, 64), 0, 15, z.NONE, codebook="nf4"), (17, 200)),  # padded K
        )


def _cpu_plain_int8_check(x: torch.Tensor, w, *, want_act: bool | type, device_type: str = "cpu") -> str | None:
    """Why the int8 kernels cannot take ``w`` (None if they can): ``want_act`` False for weight-only,
    True for per-token dynamic activations, or the activation scheme's class (StaticInt8)."""
    impl = w.tensor_impl
    if x.device.type != device_type:
        return f"{device_type.upper()} kernel, input is on {x.device}"
    spec = impl.spec
    if spec.zero_point_domain is not ZeroPointDomain.NONE or spec.quant_min < -128 or spec.quant_max > 127 or not spec.signed:
        return f"needs symmetric signed int8 codes with no zero point, weight is {spec.describe()}"
    if spec.block_size != (1, impl.shape[1]):
        return f"needs per-channel scales (block 1x{impl.shape[1]}), weight has block {spec.block_size}"
    act = w.act_quant
    if isinstance(want_act, type):
        if not isinstance(act, want_act):
            return f"needs {want_act.__name__} activations, weight has {'none' if act is None else act.describe()}"
        return None
    if want_act and not isinstance(act, PerTokenInt8):
        return "weight-only (no dynamic activation quantization)" if act is None else f"activation scheme {act} unsupported"
    if not want_act and act is not None:
        return f"weight has dynamic activation quantization ({act.describe()})"
    return None


def _add_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


def _int8_weight_only(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = w.tensor_impl.shape
    y = int8_weight_only_mm(x.reshape(-1, k), w.codes, w.scale)
    return _add_bias(y.reshape(*x.shape[:-1], n), bias)


def _int8_dynamic(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = w.tensor_impl.shape
    xq, xs = w.act_quant.quantize(x.reshape(-1, k))
    acc = torch.ops.torchq.int8_linear_matmul(xq, w.codes)  # torch._int_mm, exact also for K == 1
    y = (acc.to(torch.float32) * xs) * w.scale.reshape(1, n).to(torch.float32)
    return _add_bias(y.to(x.dtype).reshape(*x.shape[:-1], n), bias)


def _check_native(x: torch.Tensor, w, bias, *, want_act: bool) -> str | None:
    reason = _cpu_plain_int8_check(x, w, want_act=want_act)
    if reason is not None:
        return reason
    if not native.available():
        return f"native library not available ({native.status().reason})"
    if want_act and w.act_quant.quant_min < NATIVE_MIN_CODE:
        return f"activation codes [{w.act_quant.quant_min}, {w.act_quant.quant_max}]: the native kernel takes [-127, 127]"
    return None


def _in_place_int8_weight(impl) -> native_library.NativeWeight | None:
    """Codes and fp32 scales of a plain int8 weight as a native weight (cached per impl), or
    None when they cannot be used in place."""
    codes, scale = impl.codes, impl.scale
    if not (codes.is_contiguous() and scale.is_contiguous() and scale.dtype == torch.float32):
        return None
    n, k = impl.shape
    return native_library.int8_weight("int8_weight_linear", codes, scale, n, k)


def _int8_weight_only_native(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl = w.tensor_impl
    out = native_library.decode_linear(impl, x, bias, _in_place_int8_weight)
    if out is not None:  # decode-sized, eager CPU: the least Python per call
        return out
    if not native_library.eager_cpu(x):
        return int8_weight_linear(x, impl.codes, impl.scale, bias)
    # eager CPU: a validated layout's tensors, the op's checks are skipped
    impl.validate()  # cheap next to a prefill; the decode path's pointers were checked when cached
    return weight_linear_cpu(x, impl.codes, impl.scale, bias)


def _int8_dynamic_native(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    act = w.act_quant
    impl = w.tensor_impl
    # the condition guarantees activation codes the kernel takes
    out = native_library.decode_linear(impl, x, bias, _in_place_int8_weight, (act.quant_min, act.quant_max, act.eps))
    if out is not None:
        return out
    if not native_library.eager_cpu(x):
        return int8_dynamic_linear(x, impl.codes, impl.scale, act.quant_min, act.quant_max, act.eps, bias)
    impl.validate()
    return dynamic_linear_cpu(x, impl.codes, impl.scale, act.quant_min, act.quant_max, act.eps, bias)


def _static_args(w) -> tuple[float, int, int, int]:
    a = w.act_quant
    return a.scale, a.zero_point, a.quant_min, a.quant_max


def _int8_static(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl = w.tensor_impl
    return int8_static_reference(x, impl.codes, impl.scale, *_static_args(w), bias)


def _check_static_native(x: torch.Tensor, w, bias) -> str | None:
    reason = _cpu_plain_int8_check(x, w, want_act=StaticInt8)
    if reason is not None:
        return reason
    if not native.available():
        return f"native library not available ({native.status().reason})"
    if w.act_quant.quant_min < NATIVE_MIN_CODE:
        return f"activation codes [{w.act_quant.quant_min}, {w.act_quant.quant_max}]: the native kernel takes [-127, 127]"
    return None


def _int8_static_native(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl = w.tensor_impl
    args = _static_args(w)
    out = native_library.decode_linear(impl, x, bias, _in_place_int8_weight, static=args)
    if out is not None:
        return out
    if not native_library.eager_cpu(x):
        return int8_static_linear(x, impl.codes, impl.scale, *args, bias)
    impl.validate()
    return static_linear_cpu(x, impl.codes, impl.scale, *args, bias)


def _check_triton_static(x: torch.Tensor, w, bias) -> str | None:
    return _cpu_plain_int8_check(x, w, want_act=StaticInt8, device_type="cuda") or triton_backend.cuda_rejects(x)


def _int8_static_op(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl = w.tensor_impl
    op = triton_backend.int8_static_linear_cuda if triton_backend.eager_cuda(x) else int8_static_linear
    return op(x, impl.codes, impl.scale, *_static_args(w), bias)


def _check_triton_dynamic(x: torch.Tensor, w, bias) -> str | None:
    return _cpu_plain_int8_check(x, w, want_act=True, device_type="cuda") or triton_backend.cuda_rejects(x)


def _check_triton_weight_only(x: torch.Tensor, w, bias) -> str | None:
    return _cpu_plain_int8_check(x, w, want_act=False, device_type="cuda") or triton_backend.cuda_rejects(x)


def _int8_weight_only_op(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    impl = w.tensor_impl
    op = triton_backend.int8_weight_linear_cuda if triton_backend.eager_cuda(x) else int8_weight_linear
    return op(x, impl.codes, impl.scale, bias)


def _int8_dynamic_op(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    act = w.act_quant
    impl = w.tensor_impl
    op = triton_backend.int8_dynamic_linear_cuda if triton_backend.eager_cuda(x) else int8_dynamic_linear
    return op(x, impl.codes, impl.scale, act.quant_min, act.quant_max, act.eps, bias)


def _check_llm_int8(x: torch.Tensor, w, bias) -> str | None:
    if not isinstance(w.act_quant, OutlierInt8):
        return "weight is not LLM.int8 (no outlier activation scheme)"
    impl = w.tensor_impl
    spec = impl.spec
    if (spec.quant_min, spec.quant_max) != (-127, 127) or spec.zero_point_domain is not ZeroPointDomain.NONE:
        return f"needs symmetric int8 [-127, 127] codes with no zero point, weight is {spec.describe()}"
    if spec.block_size != (1, impl.shape[1]):
        return f"needs per-channel scales (block 1x{impl.shape[1]}), weight has block {spec.block_size}"
    return None


def _llm_int8(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """``torchq::int8_vectorwise_quant`` semantics: int8 x int8 -> int32 for the non-outlier
    columns, rescaled by row absmax / 127 and the weight scales in fp32; the outlier columns in
    fp32 against the dequantized weight columns.

    The outlier columns are found here as a fixed-size mask (their number is data-dependent,
    which a compiled graph cannot carry): outliers are zeroed before the op (so the row absmax
    skips them) and their columns zeroed in the codes, exactly as the op's threshold does."""
    n, k = w.tensor_impl.shape
    x2 = x.reshape(-1, k)
    outlier = x2.abs() >= w.act_quant.threshold
    col_mask = outlier.any(dim=0)
    codes, row_absmax, _ = torch.ops.torchq.int8_vectorwise_quant(torch.where(outlier, 0.0, x2), 0.0)
    codes = codes.masked_fill(col_mask, 0)
    acc = torch.ops.torchq.int8_linear_matmul(codes, w.codes)
    scale = w.scale.reshape(1, n).to(torch.float32)
    y = acc.to(torch.float32) * divide(row_absmax, 127).reshape(-1, 1) * scale
    if traced(x2):  # dense fp32 matmul of the masked input (no data-dependent gather)
        xo = torch.where(col_mask, x2.to(torch.float32), 0.0)
        y = y + xo @ (w.codes.to(torch.float32) * scale.reshape(n, 1)).t()
    else:  # gather the outlier columns (0 columns add 0)
        cols = col_mask.nonzero().reshape(-1)
        w_cols = w.codes.index_select(1, cols).to(torch.float32) * scale.reshape(n, 1)
        y = y + x2.index_select(1, cols).to(torch.float32) @ w_cols.t()
    return _add_bias(y.to(x.dtype).reshape(*x.shape[:-1], n), bias)


KERNELS = (
    LinearKernel(
        "int8_weight_only_native",
        lambda x, w, b: _check_native(x, w, b, want_act=False),
        _int8_weight_only_native,
        description="torchq::int8_weight_linear: native fused dequantize + dot (fp32/bf16/fp16 input)",
        bind=lambda x, w, b: native_library.bind_linear(w.tensor_impl, x, _in_place_int8_weight),
    ),
    LinearKernel(
        "int8_dynamic_native",
        lambda x, w, b: _check_native(x, w, b, want_act=True),
        _int8_dynamic_native,
        description="torchq::int8_dynamic_linear: native per-token int8 quantization + int8 dot (VNNI/AVX2), fp32 rescale",
        bind=lambda x, w, b: native_library.bind_linear(w.tensor_impl, x, _in_place_int8_weight,
                                                        (w.act_quant.quant_min, w.act_quant.quant_max, w.act_quant.eps)),
    ),
    LinearKernel(
        "int8_static_native",
        _check_static_native,
        _int8_static_native,
        description="torchq::int8_static_linear: native static int8 quantization (calibrated scale and zero point) + int8 dot "
        "(VNNI/AVX2), fp32 rescale",
        bind=lambda x, w, b: native_library.bind_linear(w.tensor_impl, x, _in_place_int8_weight, static=_static_args(w)),
    ),
    # aten._weight_int8pack_mm is ~10x slower for fp32/fp16 inputs than for bf16 (13.2 ms vs
    # 1.25 ms at M=1, K=N=4096): configs with compute_dtype=torch.bfloat16 run those inputs in bf16.
    LinearKernel(
        "int8_weight_only_cpu",
        lambda x, w, b: _cpu_plain_int8_check(x, w, want_act=False),
        _int8_weight_only,
        description="aten._weight_int8pack_mm: int8 per-channel weight, float input",
    ),
    LinearKernel(
        "int8_dynamic_cpu",
        lambda x, w, b: _cpu_plain_int8_check(x, w, want_act=True),
        _int8_dynamic,
        description="per-token int8 input x int8 weight via torch._int_mm, fp32 rescale",
    ),
    LinearKernel(
        "int8_static_cpu",
        lambda x, w, b: _cpu_plain_int8_check(x, w, want_act=StaticInt8),
        _int8_static,
        description="static int8 input (calibrated scale and zero point) x int8 weight via torch._int_mm, fp32 rescale",
    ),
    LinearKernel(
        "int8_weight_only_triton",
        _check_triton_weight_only,
        _int8_weight_only_op,
        description="torchq::int8_weight_linear on CUDA: Triton streaming GEMV (M <= 4), int8-weight tensor-core GEMM "
        "(M <= 64), dequantize + cuBLAS above",
    ),
    LinearKernel(
        "int8_dynamic_triton",
        _check_triton_dynamic,
        _int8_dynamic_op,
        description="torchq::int8_dynamic_linear on CUDA: Triton per-token int8 quantization + int8 tensor-core GEMM, "
        "scales fused (bit-equal to the reference)",
    ),
    LinearKernel(
        "int8_static_triton",
        _check_triton_static,
        _int8_static_op,
        description="torchq::int8_static_linear on CUDA: Triton static int8 quantization + int8 tensor-core GEMM, zero-point "
        "correction and scales fused (bit-equal to the reference)",
    ),
    LinearKernel(
        "llm_int8_cpu",
        _check_llm_int8,
        _llm_int8,
        description="LLM.int8: outlier columns in fp32, the rest int8 x int8 via torchq::int8_linear_matmul",
    ),
)
