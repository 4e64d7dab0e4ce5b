"""float8 e4m3fn codes with fp32 scales: the FP8 weights and activations, bit for bit everywhere.

Bytes: codes ``torch.float8_e4m3fn``, one byte each (OCP FP8 E4M3 "fn": sign, 4 exponent bits with
bias 7, 3 mantissa bits; no infinities, ``S.1111.111`` is NaN; largest finite 448, smallest
subnormal 2^-9); scales fp32, one per block: ``[N, 1]`` per row, ``[1, 1]`` per tensor.

The rules (the reference; every device computes them with the same correctly rounded fp32 ops):

* ``amax`` = ``max |v|`` over the block, in fp32 (exact for fp32, bf16 and fp16 inputs);
* ``scale = amax / 448`` in fp32, raised to ``MIN_SCALE`` (2^-126) where smaller: a block of zeros
  gets 2^-126 and codes 0, and a tiny block never divides by a subnormal or zero;
* ``codes = float8_e4m3fn(clamp(v / scale, -448, 448))``: the fp32 quotient (correctly rounded)
  rounded to nearest even, saturating at ±448 (so no code is NaN);
* a block holding NaN or ±inf: a weight is refused (:func:`quantize_float8` raises naming the
  first such row); an activation (:func:`quantize_float8_activations`) gets scale NaN and codes 0,
  so the outputs it feeds are NaN, as a float layer's would be.

``v ≈ codes · scale``, relative error at most 2^-4 for normal codes (|v / scale| >= 2^-6).
"""

from __future__ import annotations

import torch

from .division import divide

__all__ = ["E4M3_MAX", "MIN_SCALE", "FLOAT8_DTYPE", "GRANULARITIES", "float8_scale", "quantize_float8",
           "quantize_float8_activations", "dequantize_float8", "check_granularity"]

FLOAT8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_SCALE = 2.0**-126
GRANULARITIES = ("row", "tensor")


def check_granularity(granularity: object, name: str = "granularity") -> str:
    if granularity not in GRANULARITIES or not isinstance(granularity, str):
        raise ValueError(f"{name}: expected 'row' or 'tensor', got {granularity!r}")
    return granularity


def _amax(v32: torch.Tensor, granularity: str) -> torch.Tensor:
    """``max |v|`` per row (``[..., 1]``) or over the whole tensor (``[1] * dim``), fp32."""
    a = v32.abs()
    if granularity == "row":
        return a.amax(dim=-1, keepdim=True) if v32.shape[-1] else a.new_zeros((*v32.shape[:-1], 1))
    return (a.amax() if v32.numel() else a.new_zeros(())).reshape((1,) * v32.dim())


def float8_scale(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax / 448, 2^-126)`` in fp32 (NaN stays NaN)."""
    scale = divide(amax.to(torch.float32), E4M3_MAX)
    return torch.where(scale < MIN_SCALE, MIN_SCALE, scale)


def _codes(v32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (v32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FLOAT8_DTYPE)


def quantize_float8(w: torch.Tensor, granularity: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes float8_e4m3fn [N, K], scale fp32 [N, 1] or [1, 1])`` of a 2-D float weight. Raises
    ValueError naming the first row with NaN or ±inf."""
    check_granularity(granularity)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        got = f"{w.dtype} {list(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"w: expected a 2-D fp32, bf16 or fp16 tensor, got {got}")
    w32 = w.to(torch.float32)
    bad = ~torch.isfinite(w32).all(dim=1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"w: row {row} holds NaN or inf; a float8 scale cannot represent it (fix or exclude the layer)")
    scale = float8_scale(_amax(w32, granularity))
    return _codes(w32, scale), scale


def quantize_float8_activations(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes float8_e4m3fn of x's shape, scale fp32 [..., 1] per row or [1, ..., 1] per
    tensor)``; a block with NaN or ±inf gets scale NaN and codes 0."""
    x32 = x.to(torch.float32)
    finite = torch.isfinite(x32)
    finite = finite.all(dim=-1, keepdim=True) if granularity == "row" else finite.all().reshape((1,) * x.dim())
    scale = float8_scale(_amax(torch.where(finite, x32, 0.0), granularity))
    codes = _codes(torch.where(finite, x32, 0.0), scale)
    return codes, torch.where(finite, scale, float("nan"))


def dequantize_float8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes · scale`` in fp32 (one rounding), cast to ``dtype``."""
    return (codes.to(torch.float32) * scale.to(torch.float32)).to(dtype)
