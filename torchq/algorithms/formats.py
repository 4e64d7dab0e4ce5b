"""Group formats: what an algorithm that picks codes column by column (GPTQ) needs to know of a
config's format, without naming the config.

A format quantizes ``[N, K]`` weights in groups of ``group_size`` consecutive columns of a row,
each group with one scale (and zero point). It offers, in the format's own arithmetic (the
roundings and dtypes of :func:`torchq.primitives.quantize_affine` / ``dequantize_affine``, or
the codebook lookup of the blockwise formats):

* ``qparams(w)``: scales (and zero points) of the groups of ``w`` ``[N, m * g]`` -> ``[N, m]``;
* ``quantize(cols, scale, zero)`` / ``dequantize(codes, scale, zero)``: codes of ``cols``
  ``[N, c]`` (columns starting at a group boundary, or a single column) with the parameters of
  their groups ``[N, ceil(c / g)]`` (the last group may be partial), and back to fp32;
* ``static_qparams(weight)``: the parameters of every group of a whole weight, with the state
  :meth:`GroupFormat.plain` needs (double-quantized scales);
* ``plain(codes, scale, zero, state)``: the canonical :class:`~torchq.canonical.PlainForm`.

Configs build their format (``QuantConfig.group_format(weight)``); the config then wraps the
plain form into its layout as round-to-nearest would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..blockwise.codebooks import codebook as codebook_values
from ..canonical import NestedScale, PlainForm, QuantSpec
from ..primitives import MappingType, ZeroPointDomain, choose_qparams_affine, dequantize_affine, expand_grid, quantize_affine

__all__ = ["GroupFormat", "AffineGroupFormat", "CodebookGroupFormat", "proxy_error"]


class GroupFormat:
    """Base of the group formats (see the module docstring)."""

    group_size: int
    #: scales are fixed by the whole original weight before any code is chosen (True for formats
    #: whose scales are themselves quantized over the whole grid: double-quantized NF4)
    static_scales: bool = False

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def quantize(self, cols: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def static_qparams(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, object]:
        """``(scale, zero, state)`` of every group of the whole ``weight``; ``state`` goes back to
        :meth:`plain` (the double-quantized form of the scales, where the format has one)."""
        scale, zero = self.qparams(weight)
        return scale, zero, None

    def plain(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, state: object = None) -> PlainForm:
        raise NotImplementedError

    def round_to_nearest(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, object]:
        """``(codes, scale, zero, state)`` of round-to-nearest on the whole ``weight``."""
        scale, zero, state = self.static_qparams(weight)
        return self.quantize(weight, scale, zero), scale, zero, state


@dataclass(frozen=True)
class AffineGroupFormat(GroupFormat):
    """An affine format: ``torchq.primitives`` arithmetic with groups ``(1, group_size)``."""

    group_size: int
    mapping_type: MappingType
    quant_min: int
    quant_max: int
    eps: float
    scale_dtype: torch.dtype
    zero_point_dtype: torch.dtype | None
    zero_point_domain: ZeroPointDomain
    preserve_zero: bool

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.quant_min < 0 else torch.uint8

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return choose_qparams_affine(w, self.mapping_type, (1, self.group_size), self.code_dtype, self.quant_min, self.quant_max,
                                     self.eps, self.scale_dtype, self.zero_point_dtype, self.zero_point_domain,
                                     self.preserve_zero)

    def quantize(self, cols: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        return quantize_affine(cols, (1, self.group_size), scale, zero, self.code_dtype, self.quant_min, self.quant_max,
                               self.zero_point_domain)

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        return dequantize_affine(codes, (1, self.group_size), scale, zero, self.quant_min, self.quant_max, self.zero_point_domain,
                                 torch.float32)

    def plain(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, state: object = None) -> PlainForm:
        spec = QuantSpec((1, self.group_size), self.quant_min, self.quant_max, self.zero_point_domain)
        return PlainForm(codes, scale, zero if self.zero_point_domain is not ZeroPointDomain.NONE else None, spec)


def _sorted_codebook(quant_type: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The codebook's distinct values in increasing order and, for each, its lowest nibble (uint8)."""
    book = codebook_values(quant_type)
    values = torch.unique(book)  # sorted; FP4's -0.0 and 0.0 are one value
    first = torch.tensor([int((book == v).nonzero()[0]) for v in values], dtype=torch.uint8)
    return values.to(device), first.to(device)


@dataclass(frozen=True)
class CodebookGroupFormat(GroupFormat):
    """NF4 / FP4: fp32 absmax per block of ``group_size``, codes index the 16-value codebook;
    ``double_quant``: the absmax grid is double-quantized (so scales are static: taken from the
    whole original weight, then double-quantized, before any code is chosen)."""

    group_size: int
    quant_type: str
    double_quant: bool

    @property
    def static_scales(self) -> bool:  # type: ignore[override]
        return self.double_quant

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The blocks' fp32 absmax (not yet double-quantized: see :meth:`static_qparams`)."""
        n, k = w.shape
        g = min(self.group_size, k)
        if k % g:
            raise ValueError(f"w: {k} columns are not whole blocks of {g}")
        return w.float().reshape(n, k // g, g).abs().amax(dim=2), None

    def static_qparams(self, weight: torch.Tensor) -> tuple[torch.Tensor, None, NestedScale | None]:
        absmax, _ = self.qparams(weight)
        if not self.double_quant:
            return absmax, None, None
        nested = NestedScale.quantize(absmax)
        return nested.dequantize(), None, nested

    def quantize(self, cols: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        s = expand_grid(scale, (1, self.group_size), cols.shape)
        v = cols.float() / torch.where(s == 0, torch.ones_like(s), s)
        # the nearest value by its place among the sorted distinct values' midpoints: O(N K) memory
        # (a [N, K, 16] distance tensor was 1.8 GB for SmolLM2's lm_head); ties go to the lower value
        values, first = _sorted_codebook(self.quant_type, cols.device)
        mids = (values[1:] + values[:-1]) / 2
        return first[torch.bucketize(v, mids, right=False)]

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
        book = codebook_values(self.quant_type).to(codes.device)
        s = expand_grid(scale, (1, self.group_size), codes.shape)
        return book[codes.long()] * s

    def plain(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, state: object = None) -> PlainForm:
        nested = None
        if self.double_quant:  # the nested form the codes were chosen against (static_qparams), else made here
            nested = state if isinstance(state, NestedScale) else NestedScale.quantize(scale)
            scale = nested.dequantize()
        spec = QuantSpec((1, self.group_size), 0, 15, ZeroPointDomain.NONE, codebook=self.quant_type,
                         double_quant=self.double_quant)
        return PlainForm(codes, scale, None, spec, nested)


def proxy_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """``tr((W - A) H (W - A)^T)``: the output error of ``approx`` on inputs whose second moment is ``H``."""
    d = (weight.to(hessian.dtype) - approx.to(hessian.dtype))
    return float(((d @ hessian) * d).sum())
