"""int4 linear ops: schemas, fakes, argument checks and pure-PyTorch references, with the unpacking
of the byte formats those references read (the packers and the rest of each format stay in its
layout module).

* ``torchq::int4_groupwise_linear(x, packed, scale, shift, zero, shape, group_size, code_base,
  round_mul, round_add, bias) = x @ W.T + bias`` in x's dtype for an
  :class:`~torchq.layouts.Int4NativeLayout` weight: ``packed`` uint8 ``[N, Kp/2]`` (element ``2j``
  of a row in the high nibble of byte ``j``), ``scale`` / ``shift`` / ``zero`` fp32 ``[N, Kp/g]``,
  ``W = R_mul((u + code_base + shift) * scale)`` then ``R_add(W + zero)`` with the roundings
  ``R`` of :data:`ROUND_KIND` (bit for bit ``dequantize_affine``'s value). Reference: that weight
  in x's dtype, ``F.linear``; differentiable in x and bias. Implementations: native CPU
  (:mod:`torchq.backends.native_cpu.lut4`), Triton on CUDA (:mod:`torchq.backends.triton`).
* ``torchq::int4_cpu_mm(x, packed, group_size, scales_and_zeros)``: PyTorch's
  ``aten._weight_int4pack_mm_for_cpu`` (``scales_and_zeros`` cast to x's dtype), ``[M, Np]``.
  Its packing is ISA-blocked and measured per machine (:mod:`torchq.layouts.int4_cpu`), so the
  aten op is the definition and its only implementation.
* ``torchq::int4_tensor_core_mm(x, packed, group_size, scales_and_zeros)``: bf16 ``x [M, Kp]`` @
  the tinygemm tiled weight (:func:`unpack_tiled`), bf16 ``[M, Np]``. Reference:
  :func:`tinygemm_dequantize`, fp32 matmul, one rounding to bf16. CUDA: ``aten._weight_int4pack_mm``
  (:mod:`torchq.backends.aten`).
* ``torchq::int4_xpu_mm(x, packed, group_size, scales, int_zeros=None)``: ``x [M, Kp] @ W.T`` in
  x's dtype for the XPU format (:func:`unpack_xpu`). Reference: :func:`xpu_dequantize`,
  ``F.linear``. XPU: the aten kernels (:mod:`torchq.backends.aten`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .devices import check_op_devices

__all__ = [
    "INT4_GROUPWISE_GROUP_SIZES", "ROUND_KIND", "int4_groupwise_linear", "check_int4_groupwise_linear_args",
    "dequantize_int4_groupwise", "int4_groupwise_reference", "unpack_nibbles", "int4_cpu_mm", "TILE_ROWS", "unpack_tiled",
    "tinygemm_dequantize", "int4_tensor_core_mm", "unpack_xpu", "xpu_dequantize", "int4_xpu_mm",
]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

# -- int4_groupwise_linear ----------------------------------------------------------------------
INT4_GROUPWISE_GROUP_SIZES = (32, 64, 128, 256, 512, 1024)
# Rounding kinds of the weight arithmetic (and of the C kernel): 0 none (fp32), 1 bf16, 2 fp16.
ROUND_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ROUND_DTYPE = {v: k for k, v in ROUND_KIND.items()}


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, B]`` bytes to their uint8 codes ``[N, 2B]`` (element ``2j`` = high nibble of byte ``j``)."""
    n = packed.shape[0]
    return torch.stack([packed >> 4, packed & 0xF], dim=-1).reshape(n, 2 * packed.shape[1])


def check_int4_groupwise_linear_args(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias) -> None:
    """The argument checks of :func:`int4_groupwise_linear` (metadata only)."""
    check_op_devices("int4_groupwise_linear", x, packed=packed, scale=scale, shift=shift, zero=zero, bias=bias)
    if len(shape) != 2:
        raise ValueError(f"shape: expected [N, K], got {list(shape)}")
    n, k = shape
    if group_size not in INT4_GROUPWISE_GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {INT4_GROUPWISE_GROUP_SIZES}, got {group_size}")
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


def dequantize_int4_groupwise(packed, scale, shift, zero, k, group_size, code_base, round_mul, round_add, dtype) -> torch.Tensor:
    """The reference weight ``[N, K]`` of :func:`int4_groupwise_linear` in ``dtype``."""
    v = unpack_nibbles(packed).to(torch.float32) + code_base
    full = lambda t: t.repeat_interleave(group_size, dim=1)  # noqa: E731
    if shift is not None:
        v = v + full(shift)
    v = _rounded(v * full(scale), round_mul)
    if zero is not None:
        v = _rounded(v + full(zero), round_add)
    return v[:, :k].to(dtype)


def int4_groupwise_reference(x, packed, scale, shift, zero, n, k, group_size, code_base, round_mul, round_add, bias) -> torch.Tensor:
    """:func:`int4_groupwise_linear`'s meaning on checked arguments."""
    w = dequantize_int4_groupwise(packed, scale, shift, zero, k, group_size, code_base, round_mul, round_add, x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


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
    """``x @ W.T + bias`` in x's dtype for an ``Int4NativeLayout`` weight. The reference:
    dequantize (bit-exact to ``dequantize_affine``), cast once to x's dtype, ``F.linear``."""
    check_int4_groupwise_linear_args(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias)
    return int4_groupwise_reference(x, packed, scale, shift, zero, shape[0], shape[1], group_size, code_base, round_mul, round_add, bias)


@int4_groupwise_linear.register_fake
def _(x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias=None):
    check_op_devices("int4_groupwise_linear", x, packed=packed, scale=scale, shift=shift, zero=zero, bias=bias)
    return x.new_empty((*x.shape[:-1], shape[0]))


def _int4_groupwise_setup(ctx, inputs, output) -> None:
    x, packed, scale, shift, zero, shape, group_size, code_base, round_mul, round_add, bias = inputs
    ctx.save_for_backward(packed, scale, shift, zero)
    ctx.meta = (list(shape), group_size, code_base, round_mul, round_add, x.dtype, bias is not None,
                None if bias is None else bias.dtype)


def _int4_groupwise_backward(ctx, grad):
    packed, scale, shift, zero = ctx.saved_tensors
    shape, group_size, code_base, round_mul, round_add, x_dtype, has_bias, bias_dtype = ctx.meta
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        w = dequantize_int4_groupwise(packed, scale, shift, zero, shape[1], group_size, code_base, round_mul, round_add, grad.dtype)
        grad_x = (grad @ w).to(x_dtype)
    if has_bias and ctx.needs_input_grad[10]:
        grad_bias = grad.reshape(-1, shape[0]).sum(0).to(bias_dtype)
    return grad_x, None, None, None, None, None, None, None, None, None, grad_bias


int4_groupwise_linear.register_autograd(_int4_groupwise_backward, setup_context=_int4_groupwise_setup)


# -- int4_cpu_mm (aten-defined) ---------------------------------------------------------------------
@torch.library.custom_op("torchq::int4_cpu_mm", mutates_args=())
def int4_cpu_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``aten._weight_int4pack_mm_for_cpu`` with ``scales_and_zeros`` cast to x's dtype: ``[M, Np]``
    (the aten op is the definition: its packing differs between CPUs)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, group_size, scales_and_zeros.to(x.dtype))


@int4_cpu_mm.register_fake
def _(x, packed, group_size, scales_and_zeros):
    check_op_devices("int4_cpu_mm", x, packed=packed, scales_and_zeros=scales_and_zeros)
    return x.new_empty(x.shape[0], scales_and_zeros.shape[1])


# -- int4_tensor_core_mm (tinygemm tiled format) ----------------------------------------------------
TILE_ROWS = 8  # rows per tinygemm n-tile


def unpack_tiled(packed: torch.Tensor, np_: int, kp: int) -> torch.Tensor:
    """uint8 codes ``[Np, Kp]`` of tinygemm's tiled int32 words ``[Np/8, Kp/(16·t), 32, t/2]``
    (:mod:`torchq.layouts.tensor_core_tiled` describes the order; traceable, any device)."""
    t = packed.shape[-1] * 2
    if packed.numel() == 0:
        return torch.zeros(np_, kp, dtype=torch.uint8, device=packed.device)
    shifts = 4 * torch.arange(8, dtype=torch.int32, device=packed.device)
    nib = ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)  # [nt, kt, 32, t/2, 8]
    nib = nib.reshape(np_ // TILE_ROWS, kp // (16 * t), TILE_ROWS, 4, t // 2, 2, 2, 2)  # nt, kt, row, c, j, e, tile, half
    return nib.permute(0, 2, 1, 4, 6, 7, 3, 5).reshape(np_, kp)


def tinygemm_dequantize(packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, shape: tuple[int, int]) -> torch.Tensor:
    """bf16 ``[N, K]`` weights exactly as ``_weight_int4pack_mm`` forms them: one bf16 FMA
    ``(q' - 8)·s + zero`` (a single rounding, unlike the plain form's multiply then add).

    The exact value is formed in fp64 (the product is exact; the sum is exact unless the zero is
    below ~2^-40 of the product) and rounded once to bf16: to fp32 rounding to odd, then to bf16
    (PyTorch's fp64 -> bf16 cast goes through a rounding to fp32 first, which can land on a bf16 tie
    the exact value is not on)."""
    n, k = shape
    np_, kp = scales_and_zeros.shape[1], scales_and_zeros.shape[0] * group_size
    q = unpack_tiled(packed, np_, kp).to(torch.float64) - 8
    sz = scales_and_zeros.to(torch.float64).repeat_interleave(group_size, dim=0)  # [Kp, Np, 2]
    w = q * sz[..., 0].t() + sz[..., 1].t()
    return round_once_to_bf16(w)[:n, :k]


def round_once_to_bf16(w: torch.Tensor) -> torch.Tensor:
    """fp64 ``w`` rounded to nearest even bf16 in one step (fp32 rounded to odd in between: it
    keeps the information a tie needs; values beyond fp32's range as PyTorch casts them)."""
    f = w.to(torch.float32)
    bits = f.view(torch.int32)
    err = w - f.to(torch.float64)
    toward = torch.where((err > 0) == (f > 0), 1, -1).to(torch.int32)
    odd = torch.where((err != 0) & ((bits & 1) == 0) & torch.isfinite(f), bits + toward, bits)
    tiniest = torch.where(err > 0, 1, -(2**31) + 1).to(torch.int32)  # +-2^-149: below fp32's range, toward the value
    odd = torch.where((f == 0) & (err != 0), tiniest, odd)
    return odd.view(torch.float32).to(torch.bfloat16)


@torch.library.custom_op("torchq::int4_tensor_core_mm", mutates_args=())
def int4_tensor_core_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """``x`` bf16 ``[M, Kp]`` @ the tiled weight: bf16 ``[M, Np]``. Reference (any device):
    :func:`tinygemm_dequantize`, fp32 matmul, one rounding to bf16 (the kernel's arithmetic up to
    the order of its fp32 sums). CUDA: ``aten._weight_int4pack_mm``."""
    np_, kp = scales_and_zeros.shape[1], scales_and_zeros.shape[0] * group_size
    w = tinygemm_dequantize(packed, scales_and_zeros, group_size, (np_, kp))
    return (x.to(torch.float32) @ w.to(torch.float32).t()).to(torch.bfloat16)


@int4_tensor_core_mm.register_fake
def _(x, packed, group_size, scales_and_zeros):
    check_op_devices("int4_tensor_core_mm", x, packed=packed, scales_and_zeros=scales_and_zeros)
    return x.new_empty(x.shape[0], scales_and_zeros.shape[1], dtype=torch.bfloat16)


# -- int4_xpu_mm (XPU format) -----------------------------------------------------------------------
def unpack_xpu(packed: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[Np, Kp]`` of the XPU int32 words ``[Np, Kp/8]`` (nibble ``i`` of word ``j``
    holds code ``8j + i``; :mod:`torchq.layouts.int4_xpu`)."""
    b = packed.contiguous().view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], 2 * b.shape[1])  # 0 rows too


def xpu_dequantize(packed: torch.Tensor, group_size: int, scales: torch.Tensor, int_zeros: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """``[Np, Kp]`` weights as the XPU kernels form them: in fp32, one rounding to ``dtype``.
    ``int_zeros`` None: ``scales`` is ``scale_and_zero`` and ``w = (q - 8)·s + zero``; else
    ``w = (q - z)·s`` with ``scales`` and ``int_zeros`` ``[Kp/g, Np]``."""
    q = unpack_xpu(packed).to(torch.float32)
    full = lambda t: t.to(torch.float32).repeat_interleave(group_size, dim=0).t()  # noqa: E731  [Np, Kp]
    if int_zeros is None:
        return ((q - 8) * full(scales[..., 0]) + full(scales[..., 1])).to(dtype)
    return ((q - full(int_zeros)) * full(scales)).to(dtype)


@torch.library.custom_op("torchq::int4_xpu_mm", mutates_args=())
def int4_xpu_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales: torch.Tensor,
                int_zeros: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, Kp] @ W.T``: ``[M, Np]`` in x's dtype (see :func:`xpu_dequantize` for ``scales`` /
    ``int_zeros``). Reference: :func:`xpu_dequantize` then ``F.linear``. XPU: the aten kernels."""
    return F.linear(x, xpu_dequantize(packed, group_size, scales, int_zeros, x.dtype))


@int4_xpu_mm.register_fake
def _(x, packed, group_size, scales, int_zeros=None):
    check_op_devices("int4_xpu_mm", x, packed=packed, scales=scales, int_zeros=int_zeros)
    return x.new_empty(x.shape[0], packed.shape[0])
