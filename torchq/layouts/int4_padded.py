"""Shared pieces of the layouts that hand groupwise int4 weights to a device kernel with padded
shapes (``Int4CPULayout``, ``TensorCoreTiledLayout``, ``Int4XPULayout``): their kernels take codes
``q' = q + (8 - mid)`` in 0..15 on a ``[Np, Kp]`` grid and return ``[M, Np]`` for ``[M, Kp]``
inputs. No layout is defined here."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..canonical import PlainForm, QuantSpec

__all__ = ["round_up", "groupwise_int4_rejects", "kernel_codes", "format_codes", "padded_linear"]


def round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def groupwise_int4_rejects(spec: QuantSpec, group_sizes: tuple[int, ...]) -> str | None:
    """Why ``spec`` is not a groupwise affine format of at most 4 bits whose codes shift into
    0..15 around the kernel's 8, with a group size in ``group_sizes`` (None if it is)."""
    if spec.codebook is not None or len(spec.block_size) != 2 or spec.block_size[0] != 1:
        return f"needs a groupwise affine format with blocks (1, g), got {spec.describe()}"
    if spec.block_size[1] not in group_sizes:
        return f"group size must be one of {group_sizes}, got {spec.block_size[1]}"
    shift = 8 - spec.mid
    if spec.quant_min + shift < 0 or spec.quant_max + shift > 15:
        return f"needs at most 4-bit codes centred for the kernel, format is {spec.describe()}"
    return None


def kernel_codes(plain: PlainForm, np_: int, kp: int, fill: int) -> torch.Tensor:
    """uint8 ``[Np, Kp]``: the codes shifted by ``8 - mid`` (exact through uint8 wrap-around),
    padding holding ``fill``."""
    n, k = plain.shape
    q8 = torch.full((np_, kp), fill, dtype=torch.uint8, device=plain.device)
    q8[:n, :k] = plain.codes.view(torch.uint8) + (8 - plain.spec.mid) % 256
    return q8


def format_codes(q8: torch.Tensor, spec: QuantSpec, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`kernel_codes`: the format's codes ``[n, k]`` in its code dtype."""
    codes = q8[:n, :k] - (8 - spec.mid) % 256
    return codes.view(spec.code_dtype) if spec.code_dtype == torch.int8 else codes.contiguous()


def padded_linear(x: torch.Tensor, bias: torch.Tensor | None, n: int, k: int, np_: int, kp: int,
                  mm: Callable[[torch.Tensor], torch.Tensor], compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` through ``mm`` (``[M, Kp] -> [M, Np]``): K padded with zeros,
    padding rows sliced off, computed in ``compute_dtype`` (default x's) and returned in x's dtype."""
    x2 = x.reshape(-1, k)
    if compute_dtype is not None:
        x2 = x2.to(compute_dtype)
    if kp != k:
        x2 = F.pad(x2, (0, kp - k))
    y = mm(x2)
    if np_ != n:
        y = y[:, :n]
    y = y.to(x.dtype).reshape(*x.shape[:-1], n)
    return y if bias is None else y + bias.to(y.dtype)
