"""AWQ: activation-aware weight quantization (Lin et al., 2023), per linear layer.

Input features that carry large activations matter more. AWQ multiplies each input column ``j``
of the weight by ``s_j`` before rounding and divides the input by ``s_j`` at run time, so salient
columns are rounded on a finer relative grid:

    ``y = W x = (W diag(s)) (x / s)  ~  Q(W diag(s)) (x / s)``

with ``s = m^alpha`` (``m``: the mean ``|x|`` per input feature on calibration data, normalised
so that ``sqrt(max(s) min(s)) = 1``) and ``alpha`` searched on a grid of ``grid`` values in
``[0, 1)`` for the least output error on the calibration inputs. Then, per output row and group,
the weight range is clipped by a factor searched on ``clip_ratios`` (AWQ's clip search: a group's
range shrunk by ``r`` rounds its bulk more finely at the cost of its extremes), each group scored
on its own inputs (the diagonal block of the Hessian).

The error measure is the output error on the calibration inputs, ``tr(dW H dW^T)`` with
``H = X X^T / T`` (the Hessian :func:`torchq.calibrate` gathers). ``alpha = 0`` with no clipping is
round-to-nearest, which is always a candidate: the result is never worse than it by that measure.

The result is the codes in the config's format plus ``input_scale = 1 / s`` (fp32 ``[K]``), which
:func:`torchq.calibrate` folds into the previous operation where the model allows (a norm's
weight, the rows of the previous linear) or keeps on the quantized weight
(:attr:`~torchq.AffineQuantizedTensor.input_scale`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .formats import GroupFormat, proxy_error

__all__ = ["AWQ_DEFAULTS", "AWQResult", "awq_quantize"]

AWQ_DEFAULTS = {"grid": 20, "clip": True}
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 .. 0.5


@dataclass
class AWQResult:
    """Codes ``[N, K]`` of ``W diag(1 / input_scale)``, their group parameters and the format's
    state, ``input_scale`` (None when ``alpha`` is 0: no scaling), the chosen ``alpha``, and the
    proxy errors relative to ``tr(W H W^T)`` of the result and of round-to-nearest."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    state: object
    input_scale: torch.Tensor | None
    alpha: float
    error: float
    rtn_error: float
    used: str


def _group_errors(diff: torch.Tensor, hessian: torch.Tensor, g: int) -> torch.Tensor:
    """``[N, G]``: each row's and group's ``d_g H_gg d_g^T`` (the group's error on its own inputs)."""
    n, k = diff.shape
    out = []
    for c0 in range(0, k, g):
        d = diff[:, c0:c0 + g]
        out.append(((d @ hessian[c0:c0 + g, c0:c0 + g]) * d).sum(dim=1))
    return torch.stack(out, dim=1)


def _clipped(fmt: GroupFormat, w: torch.Tensor, ratio: torch.Tensor | float) -> tuple:
    """Group parameters of ``w`` with each group's range shrunk by ``ratio`` (a float, or ``[N, G]``),
    and the codes of ``w`` with them."""
    g = fmt.group_size
    if isinstance(ratio, torch.Tensor):
        r = ratio.repeat_interleave(g, dim=1)[:, :w.shape[1]]
    else:
        r = ratio
    scale, zero, state = fmt.static_qparams(w * r)
    return fmt.quantize(w, scale, zero), scale, zero, state


def clip_ratios(weight: torch.Tensor, hessian: torch.Tensor, fmt: GroupFormat) -> torch.Tensor:
    """Per row and group (``[N, G]``), the factor in :data:`CLIP_RATIOS` by which shrinking the group's
    range gives the least error on the group's own inputs (``d H_gg d^T``)."""
    n, k = weight.shape
    best_ratio = torch.ones(n, -(-k // fmt.group_size), device=weight.device)
    best_err = torch.full_like(best_ratio, float("inf"))
    for r in CLIP_RATIOS:
        codes, scale, zero, _ = _clipped(fmt, weight, r)
        e = _group_errors(weight - fmt.dequantize(codes, scale, zero), hessian, fmt.group_size)
        better = e < best_err
        best_ratio = torch.where(better, r, best_ratio)
        best_err = torch.where(better, e, best_err)
    return best_ratio


def clipped_qparams(weight: torch.Tensor, hessian: torch.Tensor, fmt: GroupFormat) -> tuple:
    """``(scale, zero, state)`` of every group of ``weight`` with its range shrunk by :func:`clip_ratios`."""
    w = weight.detach().float()
    ratio = clip_ratios(w, hessian.detach().float(), fmt)
    g = fmt.group_size
    return fmt.static_qparams(w * ratio.repeat_interleave(g, dim=1)[:, :w.shape[1]])


def _search_alpha(weight: torch.Tensor, w: torch.Tensor, mean_abs: torch.Tensor, fmt: GroupFormat, grid: int,
                  error: Callable, best: tuple) -> tuple:
    """``(error, alpha, s, codes)`` of the best of ``best`` and ``s = m^alpha`` for alpha on the grid
    (round to nearest of ``W diag(s)``, scored by ``error(codes, scale, zero, s)``)."""
    m = mean_abs.detach().float().clamp_min(1e-8)
    for i in range(1, grid):
        alpha = i / grid
        s = m.pow(alpha)
        s = (s / (s.max() * s.min()).sqrt()).clamp_min(1e-4)
        q = fmt.round_to_nearest((w * s).to(weight.dtype) if weight.dtype != torch.float32 else w * s)
        err = error(*q[:3], s)
        if err < best[0]:
            best = (err, alpha, s, q)
    return best


def awq_scales(weight: torch.Tensor, hessian: torch.Tensor, mean_abs: torch.Tensor, fmt: GroupFormat, grid: int = 20):
    """AWQ's per-input-feature factor ``s`` ([K], fp32) chosen by round-to-nearest's output error, and its alpha;
    None where no alpha beats plain round to nearest."""
    w = weight.detach().float()
    h = hessian.detach().float()

    def error(codes, scale, zero, s) -> float:
        approx = fmt.dequantize(codes, scale, zero)
        return proxy_error(w, approx if s is None else approx / s, h)

    rtn = fmt.round_to_nearest(weight.detach())
    _err, alpha, s, _q = _search_alpha(weight, w, mean_abs, fmt, grid, error, (error(*rtn[:3], None), 0.0, None, rtn))
    return s, alpha


def awq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    mean_abs: torch.Tensor,
    fmt: GroupFormat,
    *,
    grid: int = AWQ_DEFAULTS["grid"],
    clip: bool = AWQ_DEFAULTS["clip"],
) -> AWQResult:
    """AWQ for a 2-D ``weight`` ``[N, K]`` given the inputs' second moment ``hessian`` ``[K, K]`` and
    mean magnitude ``mean_abs`` ``[K]``, in format ``fmt``. See the module docstring."""
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D [out_features, in_features] tensor, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"hessian: expected shape ({k}, {k}), got {tuple(hessian.shape)}")
    if tuple(mean_abs.shape) != (k,):
        raise ValueError(f"mean_abs: expected shape ({k},), got {tuple(mean_abs.shape)}")
    if not (isinstance(grid, int) and grid >= 1):
        raise ValueError(f"grid: expected a positive int, got {grid!r}")
    if not bool(torch.isfinite(hessian).all() and torch.isfinite(mean_abs).all()):
        raise ValueError("hessian, mean_abs: contain NaN/inf (calibration inputs not finite)")
    w = weight.detach().float()
    h = hessian.detach().float()
    total = proxy_error(w, torch.zeros_like(w), h) or 1.0

    def error(codes, scale, zero, s) -> float:
        approx = fmt.dequantize(codes, scale, zero)
        return proxy_error(w, approx if s is None else approx / s, h) / total

    rtn = fmt.round_to_nearest(weight.detach())
    rtn_err = error(*rtn[:3], None)
    err, alpha, s, q = _search_alpha(weight, w, mean_abs, fmt, grid, error, (rtn_err, 0.0, None, rtn))
    if clip:
        ws = w if s is None else w * s
        hs = h if s is None else h / s[:, None] / s[None, :]  # the error of W s on inputs x / s
        best_ratio = clip_ratios(ws, hs, fmt)
        if bool((best_ratio < 1).any()):
            q2 = _clipped(fmt, ws, best_ratio)
            err2 = error(*q2[:3], s)
            if err2 < err:
                err, q = err2, q2
    if s is None and q is rtn:
        return AWQResult(*rtn, None, 0.0, rtn_err, rtn_err, "rtn")
    return AWQResult(q[0], q[1], q[2], q[3], None if s is None else (1.0 / s).float(), alpha, err, rtn_err, "awq")
