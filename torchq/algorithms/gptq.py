"""GPTQ: codes chosen column by column, each column's rounding error compensated on the columns
not yet quantized, weighted by the layer's input statistics (Frantar et al., 2022).

For a linear ``y = W x`` with calibration inputs ``X`` (``[K, T]``), ``H = X X^T / T`` is the
Hessian of the output error ``||(W - Q) X||^2``. Quantizing column ``j`` to ``q_j`` and moving
the columns after it to their least-squares optimum given the fixed ones is the update
``W[:, j+1:] -= (w_j - q_j) / U[j, j] * U[j, j+1:]`` with ``U`` the upper Cholesky factor of
``H^-1`` (restricted to the columns not yet fixed). Updates are applied lazily per block of
columns (one matrix product per block).

* ``damp``: ``H += damp * mean(diag(H)) * I`` (ridge towards the weight itself); inputs that are
  always zero (``H[j, j] == 0``) get ``H[j, j] = 1``.
* ``act_order``: columns are visited by decreasing ``H[j, j]``; the codes are stored back in
  input order, so layouts and kernels see an ordinary weight. Groups are then static: each
  group's scale and zero point come from the original weight before any code is chosen (a group's
  columns are visited out of order). Without it, each group's parameters are taken from the
  compensated weight when its first column is reached (``static_groups=True`` forces the static
  form; double-quantized NF4 scales are always static).
* The result is checked against round-to-nearest on the same Hessian: a layer whose GPTQ proxy
  error ``tr((W - Q) H (W - Q)^T)`` is not below round-to-nearest's keeps round-to-nearest's codes.

Everything runs in fp32 (fp64 when the Hessian is fp64), deterministically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import GroupFormat, proxy_error

__all__ = ["GPTQ_DEFAULTS", "GPTQResult", "gptq_quantize", "proxy_error"]

GPTQ_DEFAULTS = {"damp": 0.01, "block_size": 128, "act_order": False, "static_groups": False, "clip": False}


@dataclass
class GPTQResult:
    """Codes ``[N, K]`` in input order, the groups' ``scale`` / ``zero`` ``[N, K / g]``, the
    format's ``state`` (for :meth:`GroupFormat.plain`), and the proxy errors relative to
    ``tr(W H W^T)`` of the chosen codes and of round-to-nearest's (``used``: "gptq" or "rtn")."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    state: object
    error: float
    rtn_error: float
    used: str


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``, raising the damping tenfold
    (up to 4 times) while ``H`` is not numerically positive definite."""
    mean_diag = float(torch.diagonal(h).mean())
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    d = damp
    for _ in range(5):
        chol, info = torch.linalg.cholesky_ex(h + (d * mean_diag) * eye)
        if int(info) == 0:
            inv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0:
                return upper
        d = d * 10 if d > 0 else 1e-6
    raise ValueError(f"hessian: not positive definite even with damping {d / 10:g} (inputs degenerate or not finite)")


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    fmt: GroupFormat,
    *,
    damp: float = GPTQ_DEFAULTS["damp"],
    block_size: int = GPTQ_DEFAULTS["block_size"],
    act_order: bool = GPTQ_DEFAULTS["act_order"],
    static_groups: bool = GPTQ_DEFAULTS["static_groups"],
    clip: bool = GPTQ_DEFAULTS["clip"],
    keep_better: bool = True,
) -> GPTQResult:
    """GPTQ codes of a 2-D ``weight`` ``[N, K]`` in format ``fmt`` for inputs with second moment
    ``hessian`` ``[K, K]`` (``X X^T / T``; fp32 or fp64: the computation's dtype). See the module
    docstring for the options; ``clip=True`` fixes the groups' parameters first (static groups)
    with each group's range shrunk by AWQ's clip search on this Hessian
    (:func:`torchq.algorithms.awq.clip_ratios`); ``keep_better=False`` returns GPTQ's codes even where
    round-to-nearest's have the lower proxy error."""
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a 2-D [out_features, in_features] tensor, got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"hessian: expected shape ({k}, {k}) for a weight with {k} input features, got {tuple(hessian.shape)}")
    g = fmt.group_size  # a partial last group is one more group (as round-to-nearest makes it)
    if not 0 <= damp < 1e6:
        raise ValueError(f"damp: expected a value >= 0, got {damp!r}")
    if not (isinstance(block_size, int) and block_size >= 1):
        raise ValueError(f"block_size: expected a positive int, got {block_size!r}")
    if not bool(torch.isfinite(hessian).all()):
        raise ValueError("hessian: contains NaN/inf (calibration inputs not finite)")
    dt = torch.float64 if hessian.dtype == torch.float64 else torch.float32
    w_orig = weight.detach().to(dt)
    h_orig = hessian.detach().to(dt)
    h = h_orig.clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0

    static = static_groups or act_order or fmt.static_scales or clip
    rtn_codes, rtn_scale, rtn_zero, rtn_state = fmt.round_to_nearest(weight.detach())
    groups = -(-k // g)
    if clip:
        from .awq import clipped_qparams

        scale, zero, state = clipped_qparams(weight, h_orig, fmt)
    elif static:
        scale, zero, state = rtn_scale, rtn_zero, rtn_state
    else:
        scale = torch.empty_like(rtn_scale)
        zero = None if rtn_zero is None else torch.empty_like(rtn_zero)
        state = None
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(k, device=h.device)
    w = w_orig[:, perm].clone() if act_order else w_orig.clone()
    if act_order:
        h = h[perm][:, perm]
    u = _inverse_cholesky(h, damp)
    codes = torch.empty_like(rtn_codes)
    order = perm.tolist()
    step = block_size if static else max(g, (block_size // g) * g)  # dynamic groups never straddle a block
    for i1 in range(0, k, step):
        i2 = min(i1 + step, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = order[i1 + i]
            grp = col // g
            if not static and col % g == 0:
                s_new, z_new = fmt.qparams(w1[:, i:i + g])
                scale[:, grp:grp + 1] = s_new
                if zero is not None:
                    zero[:, grp:grp + 1] = z_new
            s_g = scale[:, grp:grp + 1]
            z_g = None if zero is None else zero[:, grp:grp + 1]
            x = w1[:, i:i + 1]
            q = fmt.quantize(x, s_g, z_g)
            codes[:, col:col + 1] = q
            e = (x - fmt.dequantize(q, s_g, z_g).to(dt)) / u1[i, i]
            w1[:, i:] -= e @ u1[i:i + 1, i:]
            err1[:, i:i + 1] = e
        if i2 < k:
            w[:, i2:] -= err1 @ u[i1:i2, i2:]
    assert scale.shape[1] == groups

    total = proxy_error(w_orig, torch.zeros_like(w_orig), h_orig) or 1.0
    err = proxy_error(w_orig, fmt.dequantize(codes, scale, zero), h_orig) / total
    rtn_err = proxy_error(w_orig, fmt.dequantize(rtn_codes, rtn_scale, rtn_zero), h_orig) / total
    if keep_better and not err < rtn_err:
        return GPTQResult(rtn_codes, rtn_scale, rtn_zero, rtn_state, rtn_err, rtn_err, "rtn")
    return GPTQResult(codes, scale, zero, state, err, rtn_err, "gptq")
