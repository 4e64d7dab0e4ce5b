"""int8-weight linear ops: schemas, fakes, argument checks and pure-PyTorch references (the
executable spec). Backends register implementations against these ops: the CPU kernels in
:mod:`torchq.backends.native_cpu.int8`, the CUDA kernel of ``int8_dynamic_linear`` in
:mod:`torchq.backends.triton`.

``torchq::int8_weight_linear`` and ``torchq::int8_dynamic_linear``: linears with int8 weights.

The weight is symmetric per output channel: int8 codes ``[N, K]`` (one byte each, row-major, as
``PlainLayout`` stores them) and one fp32 scale per row, ``W = q * s``.

* ``int8_weight_linear(x, codes, scale, bias) = x @ W.T + bias``. Reference: ``W`` in fp32, cast
  once to x's dtype, ``F.linear``. Native CPU kernel (fused; see :func:`torchq.prefill.use_tiles`): every
  weight the same fp32 ``q * s`` multiplied with x and summed in fp32 (one rounding to x's dtype at
  the end, so bf16 / fp16 results are at least as accurate as the reference's); prefill-sized
  inputs: dequantized tiles + ``torch.mm`` (:mod:`torchq.prefill`).
* ``int8_dynamic_linear(x, codes, scale, quant_min, quant_max, eps, bias)``: each row of x is
  quantized per token (:class:`torchq.activation.PerTokenInt8` with that range and eps), the
  int8 x int8 products accumulate exactly in int32, ``y = (acc * s_x) * s_w`` in fp32, cast to
  x's dtype, then ``+ bias`` in x's dtype. The native kernel (VNNI or AVX2) gives the same bits
  as the reference, whatever the number of rows.
* ``int8_static_linear(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias)``:
  static activations (:class:`torchq.activation.StaticInt8`: one fp32 scale ``s_a`` and int zero
  point ``z`` for every row), ``acc = q_x @ q_w.T`` exactly in int32, then
  ``y = (float(acc - z · rowsum(q_w)) · s_a) · s_w`` in fp32 (the zero point's correction
  ``z · Σ_k q_w[n, k]`` subtracted exactly, in int64: ``Σ_k (q_x - z) q_w``), cast to x's dtype, then ``+ bias`` in
  x's dtype. A row of x holding a NaN gives a NaN output row. The native kernel gives the same bits.
* ``int8_weight_only_mm(x, codes, scale)``: ``x [M, K] @ (codes * scale).T`` through PyTorch's
  ``aten._weight_int8pack_mm`` (its implementation on every device).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ..activation import PerTokenInt8, StaticInt8
from .devices import check_op_devices

__all__ = [
    "int8_weight_linear", "int8_dynamic_linear", "int8_weight_only_mm", "check_int8_weight_args",
    "check_int8_dynamic_linear_args", "int8_weight_reference", "int8_dynamic_reference", "dequantized_int8_weight",
    "int8_static_linear", "check_int8_static_linear_args", "int8_static_reference",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def check_int8_weight_args(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The argument checks of ``int8_weight_linear`` (and the weight part of ``int8_dynamic_linear``)."""
    check_op_devices("int8_weight_linear", x, codes=codes, scale=scale, bias=bias)
    if x.dtype not in _FLOATS:
        raise TypeError(f"x: expected fp32, bf16 or fp16, got {x.dtype}")
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"codes: expected int8 [N, K], got {codes.dtype} {list(codes.shape)}")
    n, k = codes.shape
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dimension K={k}, got shape {list(x.shape)}")
    if scale.numel() != n or not scale.is_floating_point():
        raise ValueError(f"scale: expected {n} floating-point entries (one per row), got {scale.dtype} {list(scale.shape)}")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias: expected {n} entries, got shape {list(bias.shape)}")


def dequantized_int8_weight(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(q * s)`` in fp32, cast once to ``dtype``."""
    return (codes.to(torch.int32) * scale.reshape(-1, 1).to(torch.float32)).to(dtype)


def int8_weight_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, (q * s).to(x.dtype), bias)`` on checked arguments."""
    return F.linear(x, dequantized_int8_weight(codes, scale, x.dtype), None if bias is None else bias.to(x.dtype))


@torch.library.custom_op("torchq::int8_weight_linear", mutates_args=())
def int8_weight_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: ``F.linear(x, (q * s).to(x.dtype), bias)``."""
    check_int8_weight_args(x, codes, scale, bias)
    return int8_weight_reference(x, codes, scale, bias)


@int8_weight_linear.register_fake
def _(x, codes, scale, bias=None):
    check_op_devices("int8_weight_linear", x, codes=codes, scale=scale, bias=bias)
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def check_int8_dynamic_linear_args(x, codes, scale, quant_min, quant_max, eps, bias) -> None:
    """The argument checks of ``int8_dynamic_linear``."""
    check_op_devices("int8_dynamic_linear", x, codes=codes, scale=scale, bias=bias)
    check_int8_weight_args(x, codes, scale, bias)
    if not (-128 <= quant_min < 0 < quant_max <= 127 and quant_min + quant_max in (0, -1)):
        raise ValueError(f"quant_min, quant_max: expected a symmetric int8 range ([-q, q] or [-q-1, q]), got [{quant_min}, {quant_max}]")
    if not eps > 0:
        raise ValueError(f"eps: expected > 0, got {eps}")


def int8_dynamic_reference(x, codes, scale, quant_min, quant_max, eps, bias) -> torch.Tensor:
    """``int8_dynamic_linear``'s meaning on checked arguments."""
    n, k = codes.shape
    xq, xs = PerTokenInt8(quant_min, quant_max, eps).quantize(x.reshape(-1, k))
    acc = torch.ops.torchq.int8_linear_matmul(xq, codes)
    y = ((acc.to(torch.float32) * xs) * scale.reshape(1, n).to(torch.float32)).to(x.dtype)
    y = y if bias is None else y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


@torch.library.custom_op("torchq::int8_dynamic_linear", mutates_args=())
def int8_dynamic_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, quant_min: int, quant_max: int, eps: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: per-token int8 quantization of x, ``torchq::int8_linear_matmul``, fp32 rescale."""
    check_int8_dynamic_linear_args(x, codes, scale, quant_min, quant_max, eps, bias)
    return int8_dynamic_reference(x, codes, scale, quant_min, quant_max, eps, bias)


@int8_dynamic_linear.register_fake
def _(x, codes, scale, quant_min, quant_max, eps, bias=None):
    check_op_devices("int8_dynamic_linear", x, codes=codes, scale=scale, bias=bias)
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def check_int8_static_linear_args(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias) -> StaticInt8:
    """The argument checks of ``int8_static_linear``; returns the activation scheme they describe."""
    check_op_devices("int8_static_linear", x, codes=codes, scale=scale, bias=bias)
    check_int8_weight_args(x, codes, scale, bias)
    return StaticInt8(act_scale, act_zero_point, quant_min, quant_max)


def int8_static_reference(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias) -> torch.Tensor:
    """``int8_static_linear``'s meaning on checked arguments."""
    n, k = codes.shape
    xq, xs = StaticInt8(act_scale, act_zero_point, quant_min, quant_max).quantize(x.reshape(-1, k))
    acc = torch.ops.torchq.int8_linear_matmul(xq, codes)
    if act_zero_point:
        acc = acc - act_zero_point * codes.sum(dim=1, dtype=torch.int64).reshape(1, n)  # exact: int64
    y = ((acc.to(torch.float32) * xs) * scale.reshape(1, n).to(torch.float32)).to(x.dtype)
    y = y if bias is None else y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


@torch.library.custom_op("torchq::int8_static_linear", mutates_args=())
def int8_static_linear(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, act_scale: float, act_zero_point: int, quant_min: int,
    quant_max: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: static int8 quantization of x, ``torchq::int8_linear_matmul``, the zero point's
    correction in int32, fp32 rescale."""
    check_int8_static_linear_args(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias)
    return int8_static_reference(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias)


@int8_static_linear.register_fake
def _(x, codes, scale, act_scale, act_zero_point, quant_min, quant_max, bias=None):
    check_op_devices("int8_static_linear", x, codes=codes, scale=scale, bias=bias)
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


_WARNED_UNALIGNED: set[tuple[int, ...]] = set()


def _warn_unaligned(codes: torch.Tensor) -> None:
    key = tuple(codes.shape)
    if key not in _WARNED_UNALIGNED:
        _WARNED_UNALIGNED.add(key)
        warnings.warn(
            f"torchq::int8_weight_only_mm: int8 codes of shape {list(key)} do not start on a 16-byte boundary, which "
            f"crashes PyTorch's bf16 int8 kernel; copying them on every call (store an aligned copy, e.g. "
            f"weight.clone(), to avoid it)",
            RuntimeWarning, stacklevel=3,
        )


@torch.library.custom_op("torchq::int8_weight_only_mm", mutates_args=())
def int8_weight_only_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (codes [N, K] * scale [N]).T`` via ``aten._weight_int8pack_mm`` (scale cast to x's dtype).

    PyTorch 2.13's bf16 path of that op crashes (segfault) when K is not a multiple of 16, so
    such shapes compute in fp32 and cast back; it also crashes for M > 1 when the codes do not
    start on a 16-byte boundary (a row slice of a view, say), so such codes are copied to an
    aligned buffer first, with a one-time warning since that copy costs a pass over the weight."""
    codes = codes.contiguous()  # the aten op requires it (a column slice, say)
    if x.dtype == torch.bfloat16 and codes.data_ptr() % 16:
        _warn_unaligned(codes)
        codes = codes.clone()
    if x.dtype == torch.bfloat16 and x.data_ptr() % 16:
        x = x.clone()
    if x.dtype == torch.bfloat16 and x.shape[1] % 16:
        return torch.ops.aten._weight_int8pack_mm(x.float().contiguous(), codes, scale.reshape(-1).float()).to(x.dtype)
    return torch.ops.aten._weight_int8pack_mm(x.contiguous(), codes, scale.reshape(-1).to(x.dtype))


@int8_weight_only_mm.register_fake
def _(x, codes, scale):
    check_op_devices("int8_weight_only_mm", x, codes=codes, scale=scale)
    return x.new_empty(x.shape[0], codes.shape[0])
