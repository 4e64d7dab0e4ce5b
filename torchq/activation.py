"""Activation quantization schemes: dynamic ones (chosen per call from the activation itself) and
:class:`StaticInt8` (a fixed scale and zero point calibrated ahead of time, :mod:`torchq.static`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .division import divide
from .float8 import check_granularity, quantize_float8_activations
from .primitives import MappingType, ZeroPointDomain, choose_qparams_affine, dequantize_affine, quantize_affine
from .serialization import reduce_object, register_kind

__all__ = ["PerTokenInt8", "OutlierInt8", "PerBlockInt8", "Float8Activations", "StaticInt8", "activation_from_json"]


@dataclass(frozen=True)
class PerTokenInt8:
    """Symmetric per-token int8: each row of ``[..., K]`` gets ``s = amax(|row|) / 127`` (fp32,
    clamped to ``eps``) and codes ``clamp(round(x * (1/s)), -127, 127)``.

    The reduced range [-127, 127] (rather than [-128, 127]) keeps negation exact and matches the
    LLM.int8 convention; ``eps = 1e-5`` keeps all-zero rows finite.
    """

    quant_min: int = -127
    quant_max: int = 127
    eps: float = 1e-5

    def _block(self, x: torch.Tensor) -> tuple[int, ...]:
        return (1,) * (x.dim() - 1) + (x.shape[-1],)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(int8 codes of x's shape, fp32 scale of shape [..., 1])``; no rows give empty ones."""
        if x.numel() == 0 and x.dim() and x.shape[-1]:
            return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
        block = self._block(x)
        scale, _ = choose_qparams_affine(
            x, MappingType.SYMMETRIC, block, torch.int8, self.quant_min, self.quant_max, self.eps,
            torch.float32, None, ZeroPointDomain.NONE,
        )
        codes = quantize_affine(x, block, scale, None, torch.int8, self.quant_min, self.quant_max, ZeroPointDomain.NONE)
        return codes, scale

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x
        codes, scale = self.quantize(x)
        return dequantize_affine(
            codes, self._block(x), scale, None, self.quant_min, self.quant_max, ZeroPointDomain.NONE, x.dtype
        )

    def __reduce__(self):
        return reduce_object("act_quant", self)

    def to_json(self) -> dict:
        return {"type": "per_token_int8", "quant_min": self.quant_min, "quant_max": self.quant_max, "eps": self.eps}

    def describe(self) -> str:
        return f"dynamic per-token int8 [{self.quant_min},{self.quant_max}]"


@dataclass(frozen=True)
class OutlierInt8:
    """LLM.int8 activations (``torch.ops.torchq.int8_vectorwise_quant``): elements with
    ``|x| >= threshold`` are outliers; their columns are computed in floating point and zeroed
    in the int8 codes; the other values are quantized per row, ``round(x * (127 / absmax))``
    with the row absmax taken over non-outliers."""

    threshold: float = 6.0

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, (int, float)) and not isinstance(self.threshold, bool) and self.threshold > 0):
            raise ValueError(f"threshold: expected a positive number, got {self.threshold!r}")
        object.__setattr__(self, "threshold", float(self.threshold))

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x as LLM.int8 sees it, in x's dtype (the reference path, e.g. for float64 inputs):
        every column holding an outlier keeps its float values; the rest are quantized per row
        with the row absmax over non-outliers, exactly as ``int8_vectorwise_quant`` does (fp32)."""
        if x.numel() == 0:
            return x
        rows = x.reshape(-1, x.shape[-1])
        x32 = rows.to(torch.float32)
        outlier = rows.abs() >= self.threshold
        kept = x32.masked_fill(outlier, 0.0)
        absmax = kept.abs().amax(dim=1, keepdim=True)
        codes = torch.round(kept * torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax)))
        deq = (codes * divide(absmax, 127)).to(x.dtype)
        return torch.where(outlier.any(dim=0, keepdim=True), rows, deq).reshape(x.shape)

    def __reduce__(self):
        return reduce_object("act_quant", self)

    def to_json(self) -> dict:
        return {"type": "outlier_int8", "threshold": self.threshold}

    def describe(self) -> str:
        return f"LLM.int8 activations (outliers >= {self.threshold:g} in float)"


@dataclass(frozen=True)
class PerBlockInt8:
    """Symmetric int8 activations per block of ``block_size`` consecutive elements of a row (the
    Q8_0 scheme of llama.cpp): ``a = amax(|block|) / 127`` in fp32 and codes
    ``q = rint(x / a)`` in [-127, 127] (ties to even), so that ``x ≈ a · q``.

    * an all-zero block has ``a = 0`` and codes 0;
    * a block holding inf or NaN has ``a = NaN`` and codes 0: the block dequantizes to NaN (the
      output rows it feeds are NaN, as a float layer's would be for NaN; inf becomes NaN);
    * the last block of a row whose length is not a multiple of ``block_size`` is zero-padded.

    Bytes per row of K: ``ceil(K / block_size)`` blocks of ``block_size`` int8 codes and one fp32
    scale."""

    block_size: int = 32

    def __post_init__(self) -> None:
        if self.block_size != 32 or isinstance(self.block_size, bool):
            raise ValueError(f"block_size: expected 32, got {self.block_size!r}")

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes int8 [..., Kp], scales fp32 [..., Kp / block_size])`` with ``Kp`` = K rounded
        up to the block size (padding codes 0)."""
        k = x.shape[-1]
        b = self.block_size
        kp = -(-k // b) * b
        x32 = x.to(torch.float32)
        if kp != k:
            x32 = torch.nn.functional.pad(x32, (0, kp - k))
        blocks = x32.reshape(*x.shape[:-1], kp // b, b)
        finite = torch.isfinite(blocks).all(dim=-1, keepdim=True)
        amax = torch.where(finite, blocks, 0.0).abs().amax(dim=-1, keepdim=True)
        scale = divide(amax, 127)
        codes = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1.0)), 0.0).clamp(-127, 127)
        codes = torch.where(finite, codes, 0.0).to(torch.int8).reshape(*x.shape[:-1], kp)
        scale = torch.where(finite, scale, float("nan")).squeeze(-1)
        return codes, scale

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``a · q`` per element, in x's dtype (the reference path)."""
        if x.numel() == 0:
            return x
        codes, scale = self.quantize(x)
        b = self.block_size
        deq = codes.reshape(*codes.shape[:-1], -1, b).to(torch.float32) * scale.unsqueeze(-1)
        return deq.reshape(codes.shape)[..., : x.shape[-1]].to(x.dtype)

    def __reduce__(self):
        return reduce_object("act_quant", self)

    def to_json(self) -> dict:
        return {"type": "per_block_int8", "block_size": self.block_size}

    def describe(self) -> str:
        return f"dynamic int8 activations per {self.block_size}-block"


@dataclass(frozen=True)
class Float8Activations:
    """Dynamic float8_e4m3fn activations with fp32 scales, per row (token) or per tensor
    (:func:`torchq.float8.quantize_float8_activations`: ``scale = max(amax / 448, 2^-126)``, codes
    rounded to nearest even and saturated; a block with NaN or inf gets scale NaN).

    Bytes per row of K: K float8_e4m3fn codes and one fp32 scale (per row), or one fp32 scale for
    the whole input (per tensor)."""

    granularity: str = "row"

    def __post_init__(self) -> None:
        check_granularity(self.granularity)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(float8_e4m3fn codes of x's shape, fp32 scales [..., 1] or [1, ..., 1])``."""
        return quantize_float8_activations(x, self.granularity)

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``codes · scale`` in fp32, in x's dtype."""
        if x.numel() == 0:
            return x
        codes, scale = self.quantize(x)
        return (codes.to(torch.float32) * scale).to(x.dtype)

    def __reduce__(self):
        return reduce_object("act_quant", self)

    def to_json(self) -> dict:
        return {"type": "float8_dynamic", "granularity": self.granularity}

    def describe(self) -> str:
        return f"dynamic float8_e4m3fn activations per {self.granularity}"


def _fp32_exact(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32, device="cpu"))


@dataclass(frozen=True)
class StaticInt8:
    """Static (calibrated) int8 activations, one scale and zero point for the whole input: codes
    ``q = clamp(rint(x · (1/s)) + z, quant_min, quant_max)`` with ``x`` widened to fp32, ``1/s``
    the fp32 reciprocal and ties to even, so that ``x ≈ s · (q - z)``.

    * ``scale``: a positive, finite fp32 value (the float given is rounded to fp32 once, here);
    * ``zero_point``: an int in ``[quant_min, quant_max]`` (0: symmetric);
    * ``±inf`` saturates to the range's end; a row holding a NaN gets scale NaN (its codes are
      then meaningless and its outputs NaN, as a float layer's would be).

    Bytes per row of K: K int8 codes; the scale and zero point are the weight's, not the call's
    (saved in checkpoints with the weight's activation scheme)."""

    scale: float
    zero_point: int = 0
    quant_min: int = -127
    quant_max: int = 127

    def __post_init__(self) -> None:
        for name in ("zero_point", "quant_min", "quant_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
        if not -128 <= self.quant_min < self.quant_max <= 127:
            raise ValueError(f"quant_min, quant_max: expected an int8 range, got [{self.quant_min}, {self.quant_max}]")
        if not self.quant_min <= self.zero_point <= self.quant_max:
            raise ValueError(f"zero_point: expected an int in [{self.quant_min}, {self.quant_max}], got {self.zero_point}")
        s = self.scale
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise TypeError(f"scale: expected a positive float, got {type(s).__name__} {s!r}")
        try:
            s32 = _fp32_exact(float(s))
        except OverflowError:
            s32 = math.inf
        if not (math.isfinite(s32) and 2.0**-126 <= s32 <= 2.0**126):
            raise ValueError(f"scale: expected an fp32 value in [2^-126, 2^126] (so that 1/scale is a normal fp32), got {s!r}")
        object.__setattr__(self, "scale", s32)

    @classmethod
    def from_range(cls, lo: float, hi: float, *, symmetric: bool = False, quant_min: int = -127,
                   quant_max: int = 127) -> StaticInt8:
        """The scheme whose grid covers ``[lo, hi]`` (widened to hold 0). Asymmetric:
        ``s = (hi - lo) / (quant_max - quant_min)``, ``z = quant_min - rint(lo / s)`` (clamped to the
        range); symmetric: ``s = max(|lo|, |hi|) / ((quant_max - quant_min) // 2)``, ``z = 0``. A
        non-finite or reversed range is refused; an all-zero range gets the smallest scale."""
        lo, hi = float(lo), float(hi)
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
            raise ValueError(f"lo, hi: expected a finite range, got [{lo!r}, {hi!r}]")
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        if symmetric:
            s = max(-lo, hi) / ((quant_max - quant_min) // 2)
            return cls(max(s, 2.0**-126), 0, quant_min, quant_max)
        s = max((hi - lo) / (quant_max - quant_min), 2.0**-126)
        s = _fp32_exact(s)
        z = quant_min - round(lo / s)
        return cls(s, int(min(max(z, quant_min), quant_max)), quant_min, quant_max)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(int8 codes of x's shape, fp32 scale [..., 1])``: the scale is ``scale`` for every row
        but NaN for rows holding a NaN (whose codes are then ``zero_point``)."""
        if x.dim() == 0:
            raise ValueError("x: expected at least one dimension")
        x32 = x.to(torch.float32)
        inv = 1.0 / torch.tensor(self.scale, dtype=torch.float32, device=x.device)
        z = self.zero_point
        q = torch.round(x32 * inv).clamp(self.quant_min - z, self.quant_max - z) + z
        nan = torch.isnan(x32)
        codes = torch.where(nan, float(z), q).to(torch.int8)
        row_nan = nan.any(dim=-1, keepdim=True)
        scale = torch.where(row_nan, float("nan"), torch.full_like(row_nan, self.scale, dtype=torch.float32))
        return codes, scale

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """``s · (q - z)`` in fp32, in x's dtype (NaN rows stay NaN)."""
        if x.numel() == 0:
            return x
        codes, scale = self.quantize(x)
        return ((codes.to(torch.float32) - self.zero_point) * scale).to(x.dtype)

    def __reduce__(self):
        return reduce_object("act_quant", self)

    def to_json(self) -> dict:
        return {"type": "static_int8", "scale": self.scale, "zero_point": self.zero_point,
                "quant_min": self.quant_min, "quant_max": self.quant_max}

    def describe(self) -> str:
        return (f"static int8 activations (scale {self.scale:.6g}, zero point {self.zero_point}, "
                f"[{self.quant_min},{self.quant_max}])")


def activation_from_json(d: dict | None) -> PerTokenInt8 | OutlierInt8 | PerBlockInt8 | Float8Activations | StaticInt8 | None:
    """Inverse of ``to_json`` of the activation schemes (None stays None)."""
    if d is None:
        return None
    if isinstance(d, dict) and d.get("type") == "static_int8":
        fields = {"scale", "zero_point", "quant_min", "quant_max"}
        if set(d) - {"type"} != fields:
            raise ValueError(f"activation quantization JSON: static_int8 takes {sorted(fields)}, got {sorted(set(d) - {'type'})}")
        if isinstance(d["scale"], bool) or not isinstance(d["scale"], (int, float)):
            raise ValueError(f"activation quantization JSON: static_int8 scale must be a number, got {d['scale']!r}")
        try:
            return StaticInt8(float(d["scale"]), d["zero_point"], d["quant_min"], d["quant_max"])
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"activation quantization JSON: static_int8: {e}") from None
    if isinstance(d, dict) and d.get("type") == "float8_dynamic":
        if set(d) != {"type", "granularity"}:
            raise ValueError(f"activation quantization JSON: float8_dynamic takes a granularity only, got {sorted(d)}")
        return Float8Activations(d["granularity"])
    if isinstance(d, dict) and d.get("type") == "per_block_int8":
        if set(d) != {"type", "block_size"}:
            raise ValueError(f"activation quantization JSON: per_block_int8 takes a block_size only, got {sorted(d)}")
        return PerBlockInt8(d["block_size"])
    if isinstance(d, dict) and d.get("type") == "outlier_int8":
        if set(d) != {"type", "threshold"}:
            raise ValueError(f"activation quantization JSON: outlier_int8 takes a threshold only, got {sorted(d)}")
        return OutlierInt8(d["threshold"])
    if not isinstance(d, dict) or d.get("type") != "per_token_int8":
        raise ValueError(f"activation quantization JSON: expected {{'type': 'per_token_int8' | 'outlier_int8' | 'per_block_int8' | 'float8_dynamic' | 'static_int8', ...}} "
                         f"or null, got {d!r}")
    extra = set(d) - {"type", "quant_min", "quant_max", "eps"}
    if extra:
        raise ValueError(f"activation quantization JSON: unknown fields {sorted(extra)}")
    qmin, qmax, eps = d.get("quant_min", -127), d.get("quant_max", 127), d.get("eps", 1e-5)
    if not (isinstance(qmin, int) and isinstance(qmax, int) and -128 <= qmin < 0 < qmax <= 127):
        raise ValueError(f"activation quantization JSON: expected an int8 range around 0, got [{qmin!r}, {qmax!r}]")
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0):
        raise ValueError(f"activation quantization JSON: eps must be a positive number, got {eps!r}")
    return PerTokenInt8(qmin, qmax, float(eps))


register_kind("act_quant", activation_from_json)
