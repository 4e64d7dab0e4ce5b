"""Static activation quantization: observers, calibration and conversion, with SmoothQuant.

    torchq.static.prepare(model, torchq.int8_static_activation_int8_weight())
    for batch in calibration_batches:
        model(**batch)                      # observers record the selected linears' inputs
    report = torchq.static.convert(model)   # int8 static activations x int8 weights, in place

:func:`prepare` adds forward pre-hooks that observe every selected linear's input (the model's
outputs are unchanged while it calibrates); :func:`convert` turns each observed range into a
:class:`~torchq.activation.StaticInt8` (one fp32 scale and int zero point per layer) and quantizes
the layers with :func:`torchq.quantize_`, atomically. The scales are saved with the weights (the
activation scheme is part of a quantized weight's metadata) and :func:`torchq.explain` shows them.

**Observers** (the config's ``observer``), per tensor:

* ``"minmax"``: the least and greatest value seen;
* ``"moving_average"``: per batch (one forward), its least and greatest value, averaged as
  PyTorch's ``MovingAverageMinMaxObserver`` does (``m += c · (batch - m)``, the first batch taken
  as it is; ``c``: the config's ``averaging_constant``);
* ``"percentile"``: the ``100 - p`` and ``p`` percentiles of a uniform sample (reservoir sampling,
  ``sample_tokens`` input rows) of the values seen: outliers are clipped.

Layers fed the very same tensor (q, k and v of an attention block) share one site: one set of
statistics, one sample.

**SmoothQuant** (``algorithm="smoothquant"``, Xiao et al., 2023): a site's input feature ``j`` is
divided by ``s_j = max|X_j|^α / max|W_{:,j}|^(1-α)`` and every weight column of the site's layers
multiplied by it, which moves activation outliers into the weights where per-channel scales
absorb them. ``α`` is searched per site on a grid (``alpha_grid`` values in [0, 1], and "no
smoothing") for the least output error of the quantized layers on the sampled inputs:
``Σ ||X Wᵀ - Q_a(X / s) Q_w(W s)ᵀ||² / Σ ||X Wᵀ||²`` with each layer's own activation scheme
(static with the range its observer gives for ``X / s``, or per-token dynamic); ``alpha`` fixes it.
``1 / s`` is folded into the norm whose output is the site's input (its ``weight`` and ``bias``)
where the model allows it: the norm fed this site only, on every call, has an affine weight of
its own, and dividing its weight by ``s`` divides its recorded outputs by ``s`` (checked on inputs
recorded during calibration: a norm computing ``x · (1 + w)`` fails the check). Elsewhere ``1 / s``
stays on the quantized weight (:attr:`~torchq.AffineQuantizedTensor.input_scale`, as AWQ's) and
multiplies the input at run time. The ranges of ``X / s`` come from the statistics per input
channel: exact for ``minmax``, per channel then combined for ``moving_average``, from the scaled
sample for ``percentile``. SmoothQuant composes with int8 dynamic activations too
(:class:`~torchq.configs.Int8DynamicActivationInt8WeightConfig`: no observer, only the smoothing).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import nn

from .activation import PerTokenInt8, StaticInt8
from .configs import Int8DynamicActivationInt8WeightConfig, Int8StaticActivationInt8WeightConfig, QuantConfig
from .dispatch import strict
from .division import divide
from .quantize import UNSET, ConfigSpec, config_resolver, default_filter, is_conv1d, quantize_, tensor_slots
from .tensor import AffineQuantizedTensor

__all__ = ["prepare", "convert", "unprepare", "prepared_layers", "StaticReport", "StaticLayer", "ALGORITHMS"]

ALGORITHMS = (None, "smoothquant")
_ATTR = "_torchq_static"  # the calibration state, on the prepared model's __dict__
_EPS = 1e-5


class _Site:
    """The statistics of one input tensor (fed to one or several layers), in fp32."""

    def __init__(self, k: int, sample_tokens: int, averaging_constant: float, generator: torch.Generator) -> None:
        self.k = k
        self.layers: list[str] = []
        self.rows = 0
        self.batches = 0
        self.ch_min = torch.full((k,), math.inf)
        self.ch_max = torch.full((k,), -math.inf)
        self.ema_min = self.ema_max = 0.0  # per tensor
        self.ema_ch_min = torch.zeros(k)
        self.ema_ch_max = torch.zeros(k)
        self.c = averaging_constant
        self.sample = torch.empty(0, k)
        self.capacity = sample_tokens
        self.gen = generator
        self.nonfinite = False
        self.norm: str | None = None
        self.last: tuple[weakref.ref, int] | None = None  # the tensor last observed in this forward, and its version

    def observe(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """Record ``x``'s rows (its last dimension is the feature), or with ``tokens`` (a bool mask of
        ``x``'s leading dimensions) only the rows it marks."""
        x = x.detach()
        if tokens is not None:
            x = x[tokens.to(x.device)]
        rows = x.reshape(-1, self.k).to(torch.float32).cpu()
        if rows.shape[0] == 0:
            return
        finite = torch.isfinite(rows)
        if not bool(finite.all()):
            self.nonfinite = True
            rows = torch.where(finite, rows, 0.0)
        bmin, bmax = rows.amin(dim=0), rows.amax(dim=0)
        self.ch_min = torch.minimum(self.ch_min, bmin)
        self.ch_max = torch.maximum(self.ch_max, bmax)
        tmin, tmax = float(bmin.min()), float(bmax.max())
        if self.batches == 0:
            self.ema_min, self.ema_max = tmin, tmax
            self.ema_ch_min, self.ema_ch_max = bmin.clone(), bmax.clone()
        else:
            self.ema_min += self.c * (tmin - self.ema_min)
            self.ema_max += self.c * (tmax - self.ema_max)
            self.ema_ch_min += self.c * (bmin - self.ema_ch_min)
            self.ema_ch_max += self.c * (bmax - self.ema_ch_max)
        self.batches += 1
        self._reservoir(rows)
        self.rows += rows.shape[0]

    def _reservoir(self, rows: torch.Tensor) -> None:
        """Algorithm R over the rows seen: every row is in the sample with the same probability."""
        if self.capacity == 0:
            return
        take = min(self.capacity - self.sample.shape[0], rows.shape[0])
        if take > 0:
            self.sample = torch.cat([self.sample, rows[:take]])
        rest = rows.shape[0] - max(take, 0)
        if rest <= 0:
            return
        seen = self.rows + max(take, 0) + torch.arange(rest, dtype=torch.float64)
        accept = torch.rand(rest, generator=self.gen, dtype=torch.float64) * (seen + 1) < self.capacity
        for i in accept.nonzero().reshape(-1).tolist():
            slot = int(torch.randint(self.capacity, (1,), generator=self.gen))
            self.sample[slot] = rows[max(take, 0) + i]

    def absmax(self) -> torch.Tensor:
        return torch.maximum(self.ch_min.abs(), self.ch_max.abs())

    def range(self, cfg: Int8StaticActivationInt8WeightConfig, s: torch.Tensor | None) -> tuple[float, float]:
        """The observed range of ``X / s`` (``s`` None: of ``X``) as the config's observer sees it."""
        inv = None if s is None else 1.0 / s
        if cfg.observer == "minmax":
            lo, hi = self.ch_min, self.ch_max
        elif cfg.observer == "moving_average":
            if inv is None:
                return self.ema_min, self.ema_max
            lo, hi = self.ema_ch_min, self.ema_ch_max
        else:
            x = self.sample if inv is None else self.sample * inv
            flat = x.reshape(-1)
            n = flat.numel()
            q = Fraction(str(cfg.percentile)) / 100  # exact: 99.9 / 100 * 1000 is 999, not 999.0000000000001
            hi_k = min(n, max(1, math.ceil(q * n)))
            lo_k = max(1, min(n, n - hi_k + 1))
            return float(flat.kthvalue(lo_k).values), float(flat.kthvalue(hi_k).values)
        if inv is not None:
            lo, hi = lo * inv, hi * inv
        return float(lo.min()), float(hi.max())


def _version(x: torch.Tensor) -> int:
    try:
        return x._version
    except RuntimeError:  # an inference tensor: no version counter
        return -1


def _same(mark: tuple[weakref.ref, int] | None, x: torch.Tensor) -> bool:
    """Whether ``x`` is the tensor ``mark`` recorded, unchanged since (not a refilled buffer)."""
    return mark is not None and mark[0]() is x and mark[1] == _version(x)


def _mark(x: torch.Tensor) -> tuple[weakref.ref, int]:
    return weakref.ref(x), _version(x)


@dataclass
class _Calibration:
    configs: dict[str, QuantConfig]
    algorithm: str | None
    alpha: float | None
    alpha_grid: int
    sites: list[_Site] = field(default_factory=list)
    site_of: dict[str, _Site] = field(default_factory=dict)
    handles: list = field(default_factory=list)
    norm_calls: dict[str, int] = field(default_factory=dict)
    first_input: tuple[tuple, dict] | None = None  # the model's first calibration call (SmoothQuant's fold check)
    first_output: list[torch.Tensor] | None = None
    pending_input: tuple[tuple, dict] | None = None
    tokens: torch.Tensor | None = None  # this forward's attention_mask != 0 ([batch, sequence]), if ignore_padding
    replaying: bool = False
    last_norm: tuple[tuple[weakref.ref, int], str] | None = None
    site_calls: dict[int, int] = field(default_factory=dict)


@dataclass
class StaticLayer:
    """One converted layer: its activation scheme (None: dynamic), the SmoothQuant exponent chosen
    for its site (None: not smoothed), where ``1 / s`` went (``"norm <name>"``, ``"input_scale"``
    or ``"-"``), the relative output error on the sampled inputs after SmoothQuant's search and
    before it (unsmoothed, the observed range), and the range clip chosen."""

    name: str
    activation: StaticInt8 | None
    alpha: float | None
    smoothing: str
    error: float | None
    unsmoothed_error: float | None
    tokens: int
    clip: float | None = None  # the static range's shrink factor SmoothQuant's search chose (1: as observed)


@dataclass
class StaticReport:
    layers: list[StaticLayer]

    def table(self) -> str:
        head = ("layer", "activation", "alpha", "clip", "1/s into", "error", "unsmoothed")
        rows = [head]
        for r in self.layers:
            act = "dynamic" if r.activation is None else f"s={r.activation.scale:.4g} z={r.activation.zero_point}"
            rows.append((r.name, act, "-" if r.alpha is None else f"{r.alpha:.2f}", "-" if r.clip is None else f"{r.clip:.2f}",
                         r.smoothing,
                         "-" if r.error is None else f"{r.error:.3e}",
                         "-" if r.unsmoothed_error is None else f"{r.unsmoothed_error:.3e}"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)

    def __str__(self) -> str:
        return self.table()


def _is_norm(mod: nn.Module) -> bool:
    w = mod._parameters.get("weight")
    name = type(mod).__name__
    return (isinstance(mod, (nn.LayerNorm, getattr(nn, "RMSNorm", nn.LayerNorm))) or name.endswith("Norm")) and \
        isinstance(w, torch.Tensor) and w.dim() == 1 and w.is_floating_point()


def prepared_layers(model: nn.Module) -> dict[str, QuantConfig]:
    """The layers :func:`prepare` observes, with their configs (empty when not prepared)."""
    state = model.__dict__.get(_ATTR)
    return {} if state is None else dict(state.configs)


def prepare(model: nn.Module, config: ConfigSpec | None = None, filter_fn: Callable[[nn.Module, str], bool] | None = None, *,
            algorithm: str | None = None, alpha: float | None = None, alpha_grid: int = 21, sample_tokens: int = 512,
            seed: int = 0, ignore_padding: bool = True) -> nn.Module:
    """Add observers to the selected linears of ``model`` (in place; returns ``model``).

    ``config`` and ``filter_fn`` select and configure layers as in :func:`torchq.quantize_` (default:
    :func:`torchq.int8_static_activation_int8_weight` for every linear). Configs:
    :class:`~torchq.configs.Int8StaticActivationInt8WeightConfig` without an ``activation`` (the
    observers calibrate it), or, with ``algorithm="smoothquant"``, also
    :class:`~torchq.configs.Int8DynamicActivationInt8WeightConfig`; others are refused by name.
    ``algorithm``: None or ``"smoothquant"`` (module docstring); ``alpha``: a fixed SmoothQuant
    exponent in [0, 1] (default: searched on ``alpha_grid`` evenly spaced values). ``sample_tokens``:
    the input rows each site keeps (percentile observers, SmoothQuant's search); ``seed``: the
    sampling's. ``ignore_padding``: when the model is called with an ``attention_mask`` keyword of
    shape ``[batch, sequence]`` (a padded batch, as tokenizers return it), an input of shape
    ``[batch, sequence, features]`` is observed at the positions the mask marks only (its padding
    tokens' activations are never used, and min-max ranges that include them are wider than the
    real tokens need); other inputs are observed whole. Then run the model on calibration data
    and call :func:`convert`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if _ATTR in model.__dict__:
        raise ValueError("model: already prepared for static quantization; convert or unprepare it first")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {algorithm!r}")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha: expected None or a number in [0, 1], got {alpha!r}")
    if alpha is not None and algorithm != "smoothquant":
        raise ValueError("alpha: only SmoothQuant takes an exponent (algorithm='smoothquant')")
    if isinstance(alpha_grid, bool) or not isinstance(alpha_grid, int) or alpha_grid < 2:
        raise ValueError(f"alpha_grid: expected an int >= 2, got {alpha_grid!r}")
    if isinstance(sample_tokens, bool) or not isinstance(sample_tokens, int) or sample_tokens < 1:
        raise ValueError(f"sample_tokens: expected a positive int, got {sample_tokens!r}")
    if not isinstance(ignore_padding, bool):
        raise ValueError(f"ignore_padding: expected a bool, got {ignore_padding!r}")
    if config is None:
        config = Int8StaticActivationInt8WeightConfig()
    filter_fn = filter_fn or default_filter
    selected = [(name, mod) for name, mod in model.named_modules() if filter_fn(mod, name)]
    resolve = config_resolver(config, [n for n, _ in selected])
    configs: dict[str, QuantConfig] = {}
    modules: dict[str, nn.Module] = {}
    for name, mod in selected:
        cfg = resolve(name)
        if cfg is None or cfg is UNSET:
            continue
        weight = mod._parameters.get("weight")
        if isinstance(getattr(mod, "weight", None), AffineQuantizedTensor):
            raise ValueError(f"static.prepare: layer {name!r} is already quantized; prepare the float model")
        if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16) or \
                weight.dim() != 2 or \
                torch.nn.utils.parametrize.is_parametrized(mod, "weight"):
            raise ValueError(f"static.prepare: layer {name!r}: its weight is not a registered 2-D float parameter "
                             f"(a parametrization, a property, or not fp32 / bf16 / fp16); select only plain linears")
        if isinstance(cfg, Int8StaticActivationInt8WeightConfig):
            if cfg.activation is not None:
                raise ValueError(f"static.prepare: layer {name!r}: its config already has calibrated activations "
                                 f"({cfg.activation.describe()}); give activation=None to calibrate, or quantize_ it")
        elif not (algorithm == "smoothquant" and isinstance(cfg, Int8DynamicActivationInt8WeightConfig)):
            what = "int8 static" + (" or int8 dynamic" if algorithm == "smoothquant" else "")
            raise ValueError(f"static.prepare: layer {name!r}: {type(cfg).__name__} has nothing to calibrate here; "
                             f"expected an {what} activation config")
        configs[name] = cfg
        modules[name] = mod
    if not configs:
        raise ValueError("config: selects no layer to calibrate")
    state = _Calibration(configs, algorithm, None if alpha is None else float(alpha), alpha_grid)
    gen = torch.Generator().manual_seed(seed)
    sampled = algorithm == "smoothquant" or any(
        isinstance(cfg, Int8StaticActivationInt8WeightConfig) and cfg.observer == "percentile" for cfg in configs.values())

    def pre_hook(name: str) -> Callable:
        def observe(mod: nn.Module, args: tuple) -> None:
            if state.replaying:
                return
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise TypeError(f"static calibration: layer {name!r} got a non-float input "
                                f"({type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype})")
            site = state.site_of.get(name)
            if site is None:
                last = state.sites[-1] if state.sites else None
                if last is not None and _same(last.last, x) and x.shape[-1] == last.k:
                    site = last
                else:
                    cfg = configs[name]  # a site's moving average: the averaging constant of its first layer's config
                    c = cfg.averaging_constant if isinstance(cfg, Int8StaticActivationInt8WeightConfig) else 0.01
                    site = _Site(x.shape[-1], sample_tokens if sampled else 0, c, gen)
                    state.sites.append(site)
                    if state.last_norm is not None and _same(state.last_norm[0], x):
                        site.norm = state.last_norm[1]
                site.layers.append(name)
                state.site_of[name] = site
            if not _same(site.last, x):
                site.last = _mark(x)
                mask = state.tokens
                site.observe(x, mask if mask is not None and x.dim() == 3 and tuple(x.shape[:2]) == tuple(mask.shape) else None)
                state.site_calls[id(site)] = state.site_calls.get(id(site), 0) + 1

        return observe

    def norm_hook(name: str) -> Callable:
        def record(mod: nn.Module, args: tuple, out: object) -> None:
            if state.replaying:
                return
            state.norm_calls[name] = state.norm_calls.get(name, 0) + 1
            if isinstance(out, torch.Tensor):
                state.last_norm = (_mark(out), name)

        return record

    def keep(t: object) -> object:
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    def model_input(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if state.replaying:
            return
        for site in state.sites:  # a new forward: a tensor seen before is a new batch (a reused buffer, say)
            site.last = None
        state.last_norm = None
        mask = kwargs.get("attention_mask") if ignore_padding else None
        state.tokens = mask.detach() != 0 if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        if state.first_output is None and algorithm == "smoothquant":
            state.pending_input = torch.utils._pytree.tree_map(keep, (args, kwargs))

    def model_output(mod: nn.Module, args: tuple, kwargs: dict, out: object) -> None:
        if state.first_output is None and state.pending_input is not None and not state.replaying:
            state.first_input, state.first_output = state.pending_input, [t.clone() for t in _floats(out)]
        state.pending_input = None

    try:
        for name, mod in modules.items():
            state.handles.append(mod.register_forward_pre_hook(pre_hook(name)))
        state.handles.append(model.register_forward_pre_hook(model_input, with_kwargs=True))
        if algorithm == "smoothquant":
            for name, mod in model.named_modules():
                if _is_norm(mod):
                    state.handles.append(mod.register_forward_hook(norm_hook(name)))
            state.handles.append(model.register_forward_hook(model_output, with_kwargs=True))
    except BaseException:
        for h in state.handles:
            h.remove()
        raise
    model.__dict__[_ATTR] = state
    return model


def unprepare(model: nn.Module) -> nn.Module:
    """Remove :func:`prepare`'s observers (and what they recorded) without quantizing; returns ``model``."""
    state = model.__dict__.pop(_ATTR, None)
    if state is None:
        raise ValueError("model: not prepared for static quantization (torchq.static.prepare)")
    for h in state.handles:
        h.remove()
    return model


def _fake_int8_weight(w: torch.Tensor) -> torch.Tensor:
    """Per-row symmetric int8 [-127, 127] (the configs' weight format) as fp32 values."""
    s = divide(w.abs().amax(dim=1, keepdim=True), 127).clamp_min(torch.finfo(torch.float32).eps)
    return torch.round(w / s).clamp(-127, 127) * s


def _activation(cfg: QuantConfig, site: _Site, s: torch.Tensor | None, clip: float = 1.0) -> StaticInt8 | None:
    """The static scheme of a layer for inputs ``X / s``, its observed range shrunk by ``clip``; None
    for a dynamic config."""
    if not isinstance(cfg, Int8StaticActivationInt8WeightConfig):
        return None
    lo, hi = site.range(cfg, s)
    return StaticInt8.from_range(lo * clip, hi * clip, symmetric=cfg.symmetric)


class _SiteSearch:
    """The output errors of a site's quantized layers on its sampled inputs, relative to their float
    outputs ``Σ ||X Wᵀ - Q_a(X / s) Q_w(W s)ᵀ||² / Σ ||X Wᵀ||²``: the float outputs are computed once,
    the quantized weights once per smoothing."""

    def __init__(self, site: _Site, weights: dict[str, torch.Tensor], configs: dict[str, QuantConfig]) -> None:
        self.site, self.weights, self.configs = site, weights, configs
        x = site.sample
        self.ref = {n: x @ w.t() for n, w in weights.items()}
        self.energy = sum(float(r.square().sum()) for r in self.ref.values())
        self._wq: tuple[torch.Tensor | None, dict[str, torch.Tensor]] | None = None

    def error(self, s: torch.Tensor | None, clip: float = 1.0) -> float:
        if self._wq is None or self._wq[0] is not s:
            self._wq = (s, {n: _fake_int8_weight(w if s is None else w * s) for n, w in self.weights.items()})
        x = self.site.sample
        xs = x if s is None else x / s
        num = 0.0
        for name, wq in self._wq[1].items():
            cfg = self.configs[name]
            act = _activation(cfg, self.site, s, clip)
            if act is None:
                act = PerTokenInt8(-63, 63) if getattr(cfg, "reduce_range", False) else PerTokenInt8()
            num += float((self.ref[name] - act.fake_quantize(xs) @ wq.t()).square().sum())
        return num / self.energy if self.energy > 0 else num


#: the shrink factors of a static range SmoothQuant tries with each alpha (1: the observed range),
#: 1 down to 0.5 in steps of 0.025
CLIP_RATIOS = tuple(round(1.0 - 0.025 * i, 3) for i in range(21))


def _smoothing(site: _Site, weights: dict[str, torch.Tensor], configs: dict[str, QuantConfig], alpha: float | None,
               grid: int, smooth: bool = True) -> tuple[torch.Tensor | None, float | None, float, float, float]:
    """``(s or None, alpha, clip, error, unsmoothed error)`` for a site: SmoothQuant's search over
    alpha (only "no smoothing" when ``smooth`` is False) jointly with the static ranges' clip ratio
    (:data:`CLIP_RATIOS`, for sites with static layers), each alpha's clips tried from 1 down while
    the error falls."""
    search = _SiteSearch(site, weights, configs)
    base = search.error(None)
    static = any(isinstance(configs[n], Int8StaticActivationInt8WeightConfig) for n in weights)
    candidates: list[tuple[torch.Tensor | None, float | None]] = [(None, None)]
    if smooth:
        a = site.absmax().clamp_min(_EPS)
        wmax = torch.stack([w.abs().amax(dim=0) for w in weights.values()]).amax(dim=0).clamp_min(_EPS)
        alphas = [alpha] if alpha is not None else [i / (grid - 1) for i in range(grid)]
        smoothed = [((a.pow(al) / wmax.pow(1 - al)).clamp_min(_EPS), al) for al in alphas]
        candidates = smoothed if alpha is not None else candidates + smoothed
    best: tuple[torch.Tensor | None, float | None, float, float] | None = None
    for s, al in candidates:
        prev = math.inf
        for r in CLIP_RATIOS if static else (1.0,):
            err = base if s is None and r == 1.0 else search.error(s, r)
            if best is None or err < best[3]:
                best = (s, al, r, err)
            if err > prev:
                break
            prev = err
    assert best is not None
    return best[0], best[1], best[2], best[3], base


def _share_tied_scales(plan: dict[str, QuantConfig], rows: dict[str, StaticLayer], ranges: dict[str, tuple[float, float]],
                       modules: dict[str, nn.Module], slots: dict) -> None:
    """Layers sharing one weight tensor but fed different inputs get one activation scheme: the
    union of their ranges (a quantized weight carries one)."""
    groups: dict[int, list[str]] = {}
    for n in ranges:
        groups.setdefault(id(modules[n].weight), []).append(n)
    for names in groups.values():
        acts = {plan[n].activation for n in names}  # type: ignore[attr-defined]
        if len(acts) <= 1:
            continue
        cfgs = {dataclasses.replace(plan[n], activation=None) for n in names}  # type: ignore[type-var]
        if len(cfgs) > 1:
            raise ValueError(f"static.convert: layers {names} share one weight tensor but have different configs")
        cfg = next(iter(cfgs))
        act = StaticInt8.from_range(min(ranges[n][0] for n in names), max(ranges[n][1] for n in names),
                                    symmetric=cfg.symmetric)  # type: ignore[attr-defined]
        for n in names:
            plan[n] = dataclasses.replace(cfg, activation=act)
            rows[n].activation = act


def _float_weight(mod: nn.Module) -> torch.Tensor:
    """The layer's ``[out, in]`` weight in fp32 (a Conv1D holds ``[in, out]``)."""
    w = mod.weight.detach()
    return (w.t() if is_conv1d(mod) else w).to(torch.float32).cpu()


def _floats(out: object) -> list[torch.Tensor]:
    """The float tensors of a model's output: tensors, mappings (transformers' ModelOutput),
    sequences and dataclasses, in order; other leaves are ignored."""
    if isinstance(out, torch.Tensor):
        return [out.detach()] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        items = list(out.values())
    elif isinstance(out, (list, tuple)):
        items = list(out)
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        items = [getattr(out, f.name) for f in dataclasses.fields(out)]
    else:
        return []
    return [t for item in items for t in _floats(item)]


def _replay_matches(model: nn.Module, state: _Calibration) -> bool:
    """Whether the model, run again on its first calibration input, gives that call's outputs
    (within float rounding): the check that a norm fold changed nothing but the site's input."""
    if state.first_input is None or state.first_output is None:
        return False
    args, kwargs = state.first_input
    state.replaying = True
    try:
        with torch.no_grad():
            got = _floats(model(*args, **kwargs))
    except Exception:  # the replay itself failed: no fold is proven
        return False
    finally:
        state.replaying = False
    want = state.first_output
    if not want or len(got) != len(want):  # nothing to compare proves nothing
        return False
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return False
        tol = 2e-2 if w.dtype in (torch.bfloat16, torch.float16) else 1e-3
        diff = (g.float() - w.float()).norm()
        if not bool(torch.isfinite(diff)) or float(diff) > tol * float(w.float().norm()) + 1e-30:
            return False
    return True


def _apply_fold(norm: nn.Module, s: torch.Tensor, backups: list) -> None:
    with torch.no_grad():
        for pname in ("weight", "bias"):
            p = norm._parameters.get(pname)
            if p is not None:
                backups.append((norm, pname, p.detach().clone()))
                p.copy_((p.float() / s.to(device=p.device, dtype=torch.float32)).to(p.dtype))


def _swap_weights(modules: dict[str, nn.Module], weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Install ``weights`` (new parameters); returns the parameters they replaced."""
    before = {n: modules[n]._parameters["weight"] for n in weights}
    for n, w in weights.items():
        modules[n]._parameters["weight"] = nn.Parameter(w, requires_grad=before[n].requires_grad)
    return before


def _put_back(modules: dict[str, nn.Module], before: dict[str, torch.Tensor]) -> None:
    for n, p in before.items():
        modules[n]._parameters["weight"] = p


def _checked_folds(model: nn.Module, state: _Calibration, modules: dict[str, nn.Module],
                   candidates: list[tuple[str, torch.Tensor, list[str]]],
                   new_weights: dict[str, torch.Tensor]) -> set[str]:
    """The norms of ``candidates`` ``(norm, s, site layers)`` whose fold leaves the model's
    outputs unchanged on the first calibration input: all at once when that holds, else each alone."""
    if not candidates:
        return set()

    def trial(chosen: list[tuple[str, torch.Tensor, list[str]]]) -> bool:
        backups: list = []
        before: dict[str, torch.Tensor] = {}
        try:
            for norm, s, names in chosen:
                _apply_fold(modules[norm], s, backups)
                before.update(_swap_weights(modules, {n: new_weights[n] for n in names}))
            return _replay_matches(model, state)
        except Exception:  # a norm that cannot take the fold
            return False
        finally:
            _put_back(modules, before)
            _restore_norms(backups)

    if trial(candidates):
        return {c[0] for c in candidates}
    accepted: list[tuple[str, torch.Tensor, list[str]]] = []
    for c in candidates:  # greedily: the set kept is the last one verified, whole
        if trial(accepted + [c]):
            accepted.append(c)
    return {c[0] for c in accepted}


def convert(model: nn.Module) -> StaticReport:
    """Quantize the layers :func:`prepare` observed, in place, and remove the observers; returns a
    :class:`StaticReport` (a row per layer: its activation scale and zero point, SmoothQuant's
    choice). Atomic: on failure the model is as it was, still prepared (its recorded statistics
    kept). Refuses a layer that saw no calibration input or a non-finite one, naming it."""
    state: _Calibration | None = model.__dict__.get(_ATTR)
    if state is None:
        raise ValueError("model: not prepared for static quantization (call torchq.static.prepare first)")
    missing = [n for n in state.configs if n not in state.site_of or state.site_of[n].rows == 0]
    if missing:
        raise ValueError(f"static.convert: {len(missing)} layer(s) saw no calibration input: {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}; run the model on calibration data between prepare and convert")
    bad = [n for n in state.configs if state.site_of[n].nonfinite]
    if bad:
        raise ValueError(f"static.convert: layer(s) {bad[:6]} saw inf or NaN inputs during calibration; calibrate on "
                         f"finite activations (a float16 overflow?)")
    modules = dict(model.named_modules())
    slots = tensor_slots(model)
    norm_sites: dict[str, list[_Site]] = {}
    for site in state.sites:
        if site.norm is not None:
            norm_sites.setdefault(site.norm, []).append(site)

    plan: dict[str, QuantConfig] = {}
    rows: dict[str, StaticLayer] = {}
    ranges: dict[str, tuple[float, float]] = {}
    new_weights: dict[str, torch.Tensor] = {}  # layer -> smoothed float weight (its module's orientation)
    smoothed: list[tuple[_Site, torch.Tensor, list[str]]] = []
    tied: list[str] = []
    for site in state.sites:
        names = [n for n in site.layers if n in state.configs]
        s = alpha = err = base = None
        clip = 1.0
        if state.algorithm == "smoothquant":
            shared = [n for n in names if len(slots.get(id(modules[n].weight), [])) > 1]
            tied.extend(shared)
            weights = {n: _float_weight(modules[n]) for n in names}
            s, alpha, clip, err, base = _smoothing(site, weights, state.configs, state.alpha, state.alpha_grid,
                                                   smooth=not shared)
        if s is not None:
            smoothed.append((site, s, names))
            for n in names:
                mod = modules[n]
                w = mod.weight.detach()
                sv = s.to(device=w.device, dtype=torch.float32)
                new_weights[n] = (w.float() * (sv[:, None] if is_conv1d(mod) else sv)).to(w.dtype)
        for n in names:
            cfg = state.configs[n]
            act = _activation(cfg, site, s, clip)
            plan[n] = cfg if act is None else dataclasses.replace(cfg, activation=act)
            rows[n] = StaticLayer(n, act, alpha, "-" if s is None else "input_scale", err, base, site.rows,
                                  clip if act is not None else None)
            if act is not None:
                lo, hi = site.range(cfg, s)
                ranges[n] = (lo * clip, hi * clip)
    _share_tied_scales(plan, rows, ranges, modules, slots)
    if tied:
        warnings.warn(f"static.convert: SmoothQuant left {len(tied)} layer(s) unsmoothed because their weights are shared "
                      f"with other modules (scaling them would change those too; their static range is still searched): "
                      f"{tied[:6]}", RuntimeWarning, stacklevel=2)
    # folds: a norm feeding one site only, on every call, with parameters of its own; then checked on the model
    candidates = []
    for site, s, names in smoothed:
        norm = None if site.norm is None else modules.get(site.norm)
        if (norm is not None and len(norm_sites.get(site.norm, [])) == 1
                and state.norm_calls.get(site.norm, 0) == state.site_calls.get(id(site), -1)
                and all(len(slots.get(id(p), [])) <= 1 and tuple(p.shape) == (site.k,)
                        for p in norm._parameters.values() if p is not None)):
            candidates.append((site.norm, s, names))
    folded = _checked_folds(model, state, modules, candidates, new_weights)
    input_scales: dict[str, torch.Tensor] = {}
    for site, s, names in smoothed:
        for n in names:
            if site.norm in folded:
                rows[n].smoothing = f"norm {site.norm}"
            else:
                input_scales[n] = (1.0 / s).to(torch.float32)

    # Apply: folded norms in place (backed up), smoothed weights as new parameters, quantize_ in
    # strict mode (a layer it would skip is an error: nothing is left half done), then the input
    # scales. Every module's weight slot is remembered first: a failure anywhere puts all back.
    slots_before = [(mod, key, mod._parameters.get(key, mod._buffers.get(key)))
                    for mod in modules.values() for key in ("weight",) if key in mod._parameters or key in mod._buffers]
    backups: list = []
    try:
        for site, s, _names in smoothed:
            if site.norm in folded:
                _apply_fold(modules[site.norm], s, backups)
        _swap_weights(modules, new_weights)
        with strict():
            quantize_(model, plan, filter_fn=lambda m, n: n in plan)
        staged = {n: nn.Parameter(modules[n].weight._replace(input_scale=sc.to(modules[n].weight.device)), requires_grad=False)
                  for n, sc in input_scales.items()}
    except BaseException:
        for mod, key, value in slots_before:
            (mod._parameters if key in mod._parameters else mod._buffers)[key] = value
        _restore_norms(backups)
        raise
    for n, p in staged.items():
        modules[n]._parameters["weight"] = p
    for h in state.handles:
        h.remove()
    del model.__dict__[_ATTR]
    return StaticReport([rows[n] for n in state.configs if n in rows])


def _restore_norms(backups: list[tuple[nn.Module, str, object]]) -> None:
    with torch.no_grad():
        for mod, pname, value in reversed(backups):
            mod._parameters[pname].copy_(value)
