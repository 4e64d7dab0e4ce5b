"""Dynamic activation quantization schemes (chosen per call from the activation itself)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .primitives import MappingType, ZeroPointDomain, choose_qparams_affine, dequantize_affine, quantize_affine

__all__ = ["PerTokenInt8", "OutlierInt8", "activation_from_json"]


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
        from .checkpoint.pickling import reduce_object

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
        deq = (codes * (absmax / 127)).to(x.dtype)
        return torch.where(outlier.any(dim=0, keepdim=True), rows, deq).reshape(x.shape)

    def __reduce__(self):
        from .checkpoint.pickling import reduce_object

        return reduce_object("act_quant", self)

    def to_json(self) -> dict:
        return {"type": "outlier_int8", "threshold": self.threshold}

    def describe(self) -> str:
        return f"LLM.int8 activations (outliers >= {self.threshold:g} in float)"


def activation_from_json(d: dict | None) -> PerTokenInt8 | OutlierInt8 | None:
    """Inverse of ``to_json`` of the activation schemes (None stays None)."""
    if d is None:
        return None
    if isinstance(d, dict) and d.get("type") == "outlier_int8":
        if set(d) != {"type", "threshold"}:
            raise ValueError(f"activation quantization JSON: outlier_int8 takes a threshold only, got {sorted(d)}")
        return OutlierInt8(d["threshold"])
    if not isinstance(d, dict) or d.get("type") != "per_token_int8":
        raise ValueError(f"activation quantization JSON: expected {{'type': 'per_token_int8', ...}} or null, got {d!r}")
    extra = set(d) - {"type", "quant_min", "quant_max", "eps"}
    if extra:
        raise ValueError(f"activation quantization JSON: unknown fields {sorted(extra)}")
    qmin, qmax, eps = d.get("quant_min", -127), d.get("quant_max", 127), d.get("eps", 1e-5)
    if not (isinstance(qmin, int) and isinstance(qmax, int) and -128 <= qmin < 0 < qmax <= 127):
        raise ValueError(f"activation quantization JSON: expected an int8 range around 0, got [{qmin!r}, {qmax!r}]")
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps > 0):
        raise ValueError(f"activation quantization JSON: eps must be a positive number, got {eps!r}")
    return PerTokenInt8(qmin, qmax, float(eps))
