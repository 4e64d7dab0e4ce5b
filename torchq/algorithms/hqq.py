"""HQQ: half-quadratic optimisation of an affine format's zero points, no calibration data.

For a weight ``W`` split into groups with a fixed scale ``s`` per group (round-to-nearest's),
HQQ (Badri & Shaji, 2023) looks for the zero point ``z`` minimising the sparsity-promoting
``sum |W - (q - z) s|^p`` (``p < 1``: a few large errors cost less than many small ones), with
``q = clamp(round(W / s + z), qmin, qmax)``. It splits the error out as an auxiliary ``E`` and
alternates in closed form (half-quadratic splitting):

* ``E = shrink_p(W - (q - z) s)``: the generalised soft threshold
  ``sign(x) * max(|x| - |x|^(p-1) / beta, 0)``;
* ``z = mean over the group of (q - (W - E) / s)``;

with ``beta`` growing by ``kappa`` per iteration. The iterations start, as the reference HQQ
does at 4 bits, from round-to-nearest's zero point moved onto the code grid (``z`` rounded to an
integer: 0.0 is then exactly representable; ``round_start=False`` starts from round-to-nearest's
own). Every candidate zero point is evaluated in fp32 and each group keeps its best iterate; that
one is then checked once in the format's own arithmetic (:func:`torchq.primitives.quantize_affine` /
:func:`~torchq.primitives.dequantize_affine`, zero points in the format's dtype, or rounded to
integers for an integer zero point) against the start, per group: a group's error is never worse
than its start's, and the result is deterministic (no randomness, a fixed number of iterations).
Iterates are ranked by squared error (``select_norm``; HQQ's own ``p`` drives the updates only).

Measured (``benchmarks/bench_accuracy.py``): the rounded start is what makes HQQ pay. MiniLM's
embedding cosine at int4 g32/g64/g128 goes 0.9724/0.9619/0.9494 -> 0.9754/0.9639/0.9529 (equal
to the ``hqq`` package's), SmolLM2's g128 perplexity 49.7 -> 43.0. Ranking the two starts by weight
error instead picks against the model's loss, so the rounded one is simply the default.

Formats: asymmetric ones, with a float zero point (``ZeroPointDomain.FLOAT``: tinygemm's
``(q - mid) s + z_f``, where ``z_f = (mid - z) s``) or an integer one (``INT``: ``(q - z) s``,
``z`` rounded and clamped to the code range at each step). Symmetric formats have no zero point
to optimise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..primitives import ZeroPointDomain, dequantize_affine, mid_code, quantize_affine

__all__ = ["HQQ_DEFAULTS", "hqq_zero_points", "lp_error"]

HQQ_DEFAULTS = {"iters": 20, "lp_norm": 0.7, "beta": 10.0, "kappa": 1.01}


def lp_error(weight: torch.Tensor, approx: torch.Tensor, group_size: int, p: float) -> torch.Tensor:
    """``sum |weight - approx|^p`` per group of ``group_size`` consecutive elements of each row
    (fp32, shape ``[rows * cols / group_size]``)."""
    diff = (weight.float() - approx.float()).abs().reshape(-1, group_size)
    return diff.pow(p).sum(dim=1)


def hqq_zero_points(
    weight: torch.Tensor,
    block_size: Sequence[int],
    quant_min: int,
    quant_max: int,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    zero_point_domain: ZeroPointDomain,
    *,
    iters: int = HQQ_DEFAULTS["iters"],
    lp_norm: float = HQQ_DEFAULTS["lp_norm"],
    beta: float = HQQ_DEFAULTS["beta"],
    kappa: float = HQQ_DEFAULTS["kappa"],
    select_norm: float = 2.0,
    round_start: bool = True,
) -> torch.Tensor:
    """HQQ's zero points for a 2-D ``weight`` in groups ``block_size = (1, g)``, given the
    round-to-nearest ``scale`` and ``zero_point`` of that format (shape ``[rows, ceil(cols / g)]``:
    a partial last group of ``cols % g`` columns is optimised on its own columns; the scale is
    kept). Returns zero points of ``zero_point``'s dtype and shape: per group HQQ's best
    iterate by ``sum |W - dequantized|^select_norm`` (default 2: squared error), kept only where it
    beats the start's by the same measure in the format's own arithmetic. ``round_start``: start
    from round-to-nearest's zero point rounded onto the code grid (default) instead of its own."""
    domain = ZeroPointDomain(zero_point_domain)
    if domain is ZeroPointDomain.NONE:
        raise ValueError("zero_point_domain: HQQ optimises zero points; a symmetric format (NONE) has none")
    if weight.dim() != 2 or len(block_size) != 2 or block_size[0] != 1 or block_size[1] < 1:
        raise ValueError(f"block_size: HQQ needs groups (1, g) along the rows of a 2-D weight, got {tuple(block_size)} "
                         f"for shape {tuple(weight.shape)}")
    k, g = weight.shape[1], block_size[1]
    groups = -(-k // g)
    if tuple(scale.shape) != (weight.shape[0], groups) or tuple(zero_point.shape) != tuple(scale.shape):
        raise ValueError(f"scale, zero_point: expected shape ({weight.shape[0]}, {groups}) for groups of {g} in a weight of "
                         f"shape {tuple(weight.shape)}, got {tuple(scale.shape)} and {tuple(zero_point.shape)}")
    if k % g:  # a partial last group (k % g columns) is a group of its own width, as the format stores it
        opts = dict(iters=iters, lp_norm=lp_norm, beta=beta, kappa=kappa, select_norm=select_norm, round_start=round_start)
        full = k - k % g
        parts = [] if not full else [hqq_zero_points(weight[:, :full], (1, g), quant_min, quant_max, scale[:, :-1],
                                                     zero_point[:, :-1], zero_point_domain, **opts)]
        parts.append(hqq_zero_points(weight[:, full:], (1, k - full), quant_min, quant_max, scale[:, -1:],
                                     zero_point[:, -1:], zero_point_domain, **opts))
        return torch.cat(parts, dim=1)
    if not (isinstance(iters, int) and iters >= 0):
        raise ValueError(f"iters: expected an int >= 0, got {iters!r}")
    if not 0 < lp_norm <= 1:
        raise ValueError(f"lp_norm: expected a value in (0, 1], got {lp_norm!r}")
    if not (beta > 0 and kappa >= 1):
        raise ValueError(f"beta, kappa: expected beta > 0 and kappa >= 1, got {beta!r}, {kappa!r}")
    w = weight.detach().float()
    groups = w.reshape(-1, g)  # [rows * cols / g, g], rows of groups in order
    s = scale.detach().float().reshape(-1, 1)
    mid = mid_code(quant_min, quant_max) if domain is ZeroPointDomain.FLOAT else 0
    code_dtype = torch.uint8 if quant_min >= 0 and quant_max <= 255 else torch.int32

    def format_error(zero: torch.Tensor) -> torch.Tensor:
        """Each group's error in the format's own arithmetic (its roundings, its zero dtype)."""
        codes = quantize_affine(weight, block_size, scale, zero, code_dtype, quant_min, quant_max, domain)
        approx = dequantize_affine(codes, block_size, scale, zero, quant_min, quant_max, domain, torch.float32)
        return lp_error(w, approx, g, select_norm)

    def to_format(z_hqq: torch.Tensor) -> torch.Tensor:
        """HQQ's zero ``(q - z) s`` as the format's zero point, in its dtype and shape."""
        if domain is ZeroPointDomain.FLOAT:  # (q - mid) s + z_f = (q - z) s  =>  z_f = (mid - z) s
            z = (mid - z_hqq) * s
        else:
            z = torch.clamp(torch.round(z_hqq), quant_min, quant_max)
        return z.reshape(zero_point.shape).to(zero_point.dtype)

    def to_hqq(zero: torch.Tensor) -> torch.Tensor:
        z = zero.detach().float().reshape(-1, 1)
        return mid - z / s if domain is ZeroPointDomain.FLOAT else z

    # The iterations run in fp32 on the groups (HQQ's own parametrisation, ``(q - z) s``), each
    # group keeping its best iterate; the result is then checked once in the format's arithmetic
    # against the start's zero points, per group. Groups are independent: they run in
    # chunks that stay in cache (one pass over a whole layer per operation was 3x slower).
    z_all = to_hqq(zero_point)
    if round_start:
        z_all = torch.round(z_all)
    best_all = torch.empty_like(z_all)
    chunk = max(1, (1 << 18) // g)
    for c0 in range(0, groups.shape[0], chunk):
        best_all[c0:c0 + chunk] = _hqq_chunk(groups[c0:c0 + chunk], s[c0:c0 + chunk], z_all[c0:c0 + chunk], quant_min, quant_max,
                                             domain is ZeroPointDomain.INT, iters, lp_norm, beta, kappa, select_norm)
    start = to_format(z_all) if round_start else zero_point.detach()
    candidate = to_format(best_all)
    better = format_error(candidate) < format_error(start)
    return torch.where(better.reshape(zero_point.shape), candidate, start)


def _hqq_chunk(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmin: int, qmax: int, integer_zero: bool, iters: int,
               lp_norm: float, beta: float, kappa: float, select_norm: float) -> torch.Tensor:
    """HQQ's iterations on groups ``w`` ``[G, g]`` with scales ``s`` and zero points ``z`` (``[G, 1]``,
    HQQ's parametrisation): each group's best iterate by ``sum |w - (q - z) s|^select_norm``."""
    inv_s = 1.0 / s
    best_z = z.clone()
    best_err = torch.full_like(z, float("inf"))
    for i in range(iters + 1):
        q = torch.clamp_(torch.round_(w * inv_s + z), qmin, qmax)
        diff = w - (q - z) * s
        a = diff.abs()
        err = (diff * diff if select_norm == 2 else a.pow(select_norm)).sum(dim=1, keepdim=True)
        better = err < best_err
        best_z = torch.where(better, z, best_z)
        best_err = torch.where(better, err, best_err)
        if i == iters:
            break
        shrunk = torch.sign(diff).mul_(torch.relu_(a - a.clamp_min(1e-30).pow_(lp_norm - 1).div_(beta)))
        z = (q - (w - shrunk) * inv_s).mean(dim=1, keepdim=True)
        if integer_zero:
            z = torch.clamp_(torch.round_(z), qmin, qmax)
        beta *= kappa
    return best_z
