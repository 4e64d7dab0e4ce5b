"""``autoquant``: time every candidate config on every linear layer's real input shapes, keep the
fastest that is accurate enough, and apply it, with a reviewable plan.

1. The model runs on the example inputs; forward pre-hooks record, per ``nn.Linear``, each input
   signature (rows ``M``, dtype, device) with how often it occurred, and keep a few rows of the
   first input of each layer for the accuracy check.
2. Each candidate (a config; its layout is the config's or the device's best, and its kernel is
   the one the dispatch table picks for that weight and input) is timed once per distinct
   ``(weight shape, M, dtype, device, bias)`` against the float layer, with interleaved rounds so
   drift hits all alike, cycling through copies of the weight (64 MiB in all by default) so each
   call reads its weight from memory as it would inside a model. Timings go to a JSON cache keyed by device kind and model, torch and
   torchq versions, native ISA, shape and candidate (``TORCHQ_CACHE_DIR`` or
   ``~/.cache/torchq``): a second run times nothing it has seen.
3. Per layer, the SQNR of each candidate's output against the float layer is measured on that
   layer's own recorded rows; the candidate with the least call-count-weighted time whose SQNR is
   at least ``min_sqnr`` wins (float when nothing beats it).
4. The plan (layer name -> config, or None for float) is applied with :func:`torchq.quantize_`;
   ``result.save_plan(path)`` writes it as JSON, :func:`load_plan` reads it back, and
   ``quantize_(model, load_plan(path))`` re-applies it without timing anything.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch, native
from .algorithms.statistics import CALIBRATED, LayerStatistics, calibration_scope
from .configs import Int4WeightOnlyConfig, QuantConfig, config_from_json, config_from_name
from .layouts import preference, registered_layouts
from .layouts.float8 import SCALED_MM_CAPABILITY
from .quantize import float_linear_filter as default_filter  # autoquant times nn.Linear layers only
from .quantize import quantize_
from .tensor import AffineQuantizedTensor
from .timing import time_interleaved

__all__ = ["autoquant", "AutoquantResult", "LayerChoice", "load_plan", "save_plan", "default_candidates"]

PLAN_FORMAT = "torchq.plan"
PLAN_VERSION = 1
CACHE_VERSION = 1
SAMPLE_ROWS = 16


def default_candidates(device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> dict[str, QuantConfig]:
    """The configs tried when ``candidates`` is None: int8 weight-only and dynamic, int4 g128 / g32
    and NF4 in the device's default layouts, plus int4 g128 in every other registered layout that
    has a kernel on ``device`` (``"int4-g128@<layout name>"``; on a CPU, PyTorch's own int4
    packing; on CUDA, the Triton layout beside tinygemm), found by asking the dispatch table. On a
    CPU, for a model of ``dtype`` bf16 / fp16, also int4 g128 / g32 with fp32 scales and zeros
    (``"int4-g128-fp32"``: more accurate, and the form the AVX2 decode path takes at M <= 4). On a
    CPU with the native library, the int8-activation 4-bit mode too (``"int4a8-g32"``,
    ``"int4a8-g128"``, ``"nf4a8"``: integer dot products, the fastest 4-bit decode on AVX2) and int8
    dynamic with 7-bit activations (``"int8dq-r7"``: the faster int8 GEMM on CPUs without VNNI). On
    CUDA devices with FP8 tensor cores (compute capability 8.9+), the float8 configs
    (``"fp8dq-row"``, ``"fp8dq-tensor"``, ``"fp8wo"``); elsewhere they only run the reference."""
    names = ["int8wo", "int8dq", "int4-g128", "int4-g32", "nf4"]
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= SCALED_MM_CAPABILITY:
        names += ["fp8dq-row", "fp8dq-tensor", "fp8wo"]
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        names += ["int4-g128-fp32", "int4-g32-fp32"]
    if device.type == "cpu" and native.available():
        names += ["int4a8-g32", "int4a8-g128", "nf4a8", "int8dq-r7"]
    out = {name: config_from_name(name) for name in names}
    probe = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=torch.bfloat16)
    default = out["int4-g128"].quantize_weight(probe).quant_layout
    for name, cls in registered_layouts().items():
        if name not in preference.order(device.type) or name == default.name:
            continue
        try:
            config = Int4WeightOnlyConfig(group_size=128, layout=cls())
            kernel, _ = dispatch.select_linear_kernel(probe[:1], config.quantize_weight(probe), None)
        except (TypeError, ValueError):  # the layout cannot hold int4 g128 weights
            continue
        if kernel is not None:
            out[f"int4-g128@{name}"] = config
    return out


@dataclass
class Signature:
    m: int
    dtype: torch.dtype
    device: torch.device

    def key(self) -> tuple:
        return (self.m, str(self.dtype), str(self.device))


@dataclass
class LayerChoice:
    """What autoquant measured and chose for one layer."""

    layer: str
    shape: tuple[int, int]
    signatures: dict[tuple, int]  # (M, dtype, device) -> calls seen
    chosen: str
    float_ms: float
    chosen_ms: float
    sqnr: float
    candidates: dict[str, dict] = field(default_factory=dict)  # name -> {ms, sqnr, kernel, status}


@dataclass
class AutoquantResult:
    """The plan, the per-layer measurements, and how many timings came from the cache."""

    plan: dict[str, QuantConfig | None]
    choices: list[LayerChoice]
    timed: int
    cached: int
    min_sqnr: float | None

    def save_plan(self, path: str | os.PathLike) -> Path:
        return save_plan(self.plan, path)

    def table(self) -> str:
        head = ("layer", "shape", "inputs", "chosen", "ms", "float_ms", "speedup", "sqnr_db")
        rows = [head]
        for c in self.choices:
            inputs = ", ".join(f"{m}x{d.removeprefix('torch.')}" + (f" (x{n})" if n > 1 else "") for (m, d, _), n in c.signatures.items())
            sq = "inf" if c.sqnr == float("inf") else f"{c.sqnr:.1f}"
            rows.append((c.layer, f"{c.shape[0]}x{c.shape[1]}", inputs, c.chosen, f"{c.chosen_ms:.3f}", f"{c.float_ms:.3f}",
                         f"{c.float_ms / c.chosen_ms:.2f}x", sq))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        floor = "none" if self.min_sqnr is None else f"{self.min_sqnr:g} dB"
        lines.append(f"# min_sqnr: {floor}; timings: {self.timed} measured, {self.cached} from the cache")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# -- plans -------------------------------------------------------------------------------------------
def save_plan(plan: Mapping[str, QuantConfig | None], path: str | os.PathLike) -> Path:
    """Write a plan (layer -> config or None) as JSON: ``{"format", "version", "layers": {...}}``."""
    layers = {}
    for name, cfg in plan.items():
        if cfg is not None and not isinstance(cfg, QuantConfig):
            raise TypeError(f"plan[{name!r}]: expected a torchq config or None, got {type(cfg).__name__}")
        layers[name] = None if cfg is None else cfg.to_json()
    path = Path(path)
    path.write_text(json.dumps({"format": PLAN_FORMAT, "version": PLAN_VERSION, "layers": layers}, indent=1, sort_keys=True) + "\n")
    return path


def load_plan(path: str | os.PathLike) -> dict[str, QuantConfig | None]:
    """Read a plan written by :func:`save_plan` (or edited by hand); pass it to ``quantize_``."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"plan {str(path)!r}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT or not isinstance(data.get("layers"), dict):
        raise ValueError(f"plan {str(path)!r}: expected {{'format': '{PLAN_FORMAT}', 'version': 1, 'layers': {{name: config}}}}")
    if data.get("version", 1) > PLAN_VERSION:
        raise ValueError(f"plan {str(path)!r}: version {data['version']} is newer than this torchq reads ({PLAN_VERSION})")
    plan: dict[str, QuantConfig | None] = {}
    for name, cfg in data["layers"].items():
        try:
            plan[name] = None if cfg is None else config_from_json(cfg)
        except (TypeError, ValueError) as e:
            raise ValueError(f"plan {str(path)!r}: layer {name!r}: {e}") from None
    return plan


# -- the timing cache ------------------------------------------------------------------------------
def _device_model(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} x{torch.get_num_threads()} threads"


def _cache_path(cache: bool | str | os.PathLike | None) -> Path | None:
    if cache is False or cache is None:
        return None
    if cache is True:
        root = Path(os.environ.get("TORCHQ_CACHE_DIR") or Path.home() / ".cache" / "torchq")
        return root / "autoquant-timings.json"
    return Path(cache)


class _TimingCache:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, float] = {}
        if path is not None and path.exists():
            try:
                data = json.loads(path.read_text())
                if data.get("version") == CACHE_VERSION:
                    self.entries = {k: float(v) for k, v in data.get("entries", {}).items()}
            except (OSError, ValueError, AttributeError):
                warnings.warn(f"autoquant: ignoring an unreadable timing cache at {path}", RuntimeWarning, stacklevel=3)

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": self.entries}, sort_keys=True))
        tmp.replace(self.path)


def _context(device: torch.device) -> str:
    from ._version import __version__

    isa = native.status().isa if device.type == "cpu" else ""
    return f"{device.type}|{_device_model(device)}|torch {torch.__version__}|torchq {__version__}|{isa}"


# -- measuring -------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _weight_bytes(w: torch.Tensor) -> int:
    return w.nbytes_quantized() if isinstance(w, AffineQuantizedTensor) else w.numel() * w.element_size()


def _rotation(w: torch.Tensor, rotate_bytes: int) -> list[torch.Tensor]:
    """``w`` and clones of it, ``rotate_bytes`` in all (at most 64): cycling through them, each
    call reads its weight from memory, not from a cache the previous call warmed, as a layer in
    a real model does."""
    copies = max(1, min(64, -(-rotate_bytes // max(_weight_bytes(w), 1))))
    return [w] + [w.clone() for _ in range(copies - 1)]


def _time_interleaved(fns: dict[str, Any], device: torch.device, budget_s: float, rounds: int = 3) -> dict[str, float]:
    """Median ms per call of each function, timed in ``rounds`` interleaved rounds."""
    timings = time_interleaved(fns, rounds=rounds, budget_s=budget_s, min_reps=3, max_reps=1000, warmup=2,
                               sync=lambda: _sync(device))
    return {name: t.median * 1e3 for name, t in timings.items()}


class _Cycle:
    """Calls ``F.linear(x, w_i, bias)`` with the next weight of a rotation each time."""

    def __init__(self, weights: list[torch.Tensor], x: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weights, self.x, self.bias, self.i = weights, x, bias, 0

    def __call__(self) -> torch.Tensor:
        w = self.weights[self.i]
        self.i = (self.i + 1) % len(self.weights)
        return F.linear(self.x, w, self.bias)


def _sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    ref, y = ref.double(), y.double()
    err = (ref - y).norm()
    if not torch.isfinite(err):
        return float("-inf")
    return float("inf") if err == 0 else float(20 * torch.log10(ref.norm() / err))


def _quantized(cfg: QuantConfig, weight: torch.Tensor, name: str) -> AffineQuantizedTensor | str:
    try:
        return cfg.quantize_weight(weight.detach(), label=name)
    except Exception as e:  # this candidate cannot hold this layer: recorded, never chosen
        return f"cannot quantize: {e}"


def _kernel_name(x: torch.Tensor, w: AffineQuantizedTensor, bias) -> str:
    chosen, _ = dispatch.select_linear_kernel(x, w, bias)
    return "FALLBACK (dequantize + F.linear)" if chosen is None else chosen.name


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self.tty = enabled and sys.stderr.isatty()

    def step(self, text: str) -> None:
        if not self.enabled:
            return
        width = 24
        filled = width * self.done // max(self.total, 1)
        line = f"autoquant [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {text}"
        print(("\r" + line[:150].ljust(150)) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def advance(self) -> None:
        self.done += 1

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


# -- the entry point -------------------------------------------------------------------------------
def autoquant(
    model: nn.Module,
    *example_inputs: Any,
    candidates: Mapping[str, QuantConfig] | Sequence[str] | None = None,
    min_sqnr: float | None = None,
    cache: bool | str | os.PathLike = True,
    apply: bool = True,
    progress: bool = True,
    budget_s: float = 0.2,
    rotate_bytes: int = 64 << 20,
    filter_fn=None,
    **example_kwargs: Any,
) -> AutoquantResult:
    """Choose a config per linear layer by timing candidates on the layer's real input shapes.

    ``candidates``: name -> config, or config names (``"int4-g128"``...; default
    :func:`default_candidates`). Calibrated candidates (``"int4-g128-gptq"``, ``"nf4-awq"``) calibrate
    each layer on the statistics of its inputs from the example inputs (all layers on the float
    model's activations, not block by block as :func:`torchq.calibrate` does) and are measured for
    accuracy on the same rows. ``min_sqnr``: the least output SQNR (dB) against the float
    layer a choice may have (None: no floor). ``cache``: True (the default cache file), False,
    or a path. ``apply=False`` only plans. ``budget_s``: timing budget per candidate and shape.
    ``rotate_bytes``: each candidate is timed cycling through copies of its weight this large in
    all, so that weights come from memory as in a model too big for the caches (0: one copy,
    cache-warm timings).
    Returns an :class:`AutoquantResult` (``print(result)`` shows the table)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not example_inputs and not example_kwargs:
        raise ValueError("example_inputs: autoquant needs at least one example input to run the model on")
    if min_sqnr is not None and not isinstance(min_sqnr, (int, float)):
        raise TypeError(f"min_sqnr: expected a number of dB or None, got {min_sqnr!r}")
    if candidates is None:
        first = next((p for p in model.parameters()), None)
        candidates = default_candidates("cpu" if first is None or first.device.type == "meta" else first.device,
                                        None if first is None else first.dtype)
    elif isinstance(candidates, Mapping):
        bad = {k: type(v).__name__ for k, v in candidates.items() if not isinstance(v, QuantConfig)}
        if bad:
            raise TypeError(f"candidates: expected name -> torchq config, got {bad}")
    elif isinstance(candidates, Sequence) and not isinstance(candidates, str):
        candidates = {name: config_from_name(name) for name in candidates}
    else:
        raise TypeError(f"candidates: expected a mapping name -> config or a list of config names, got {candidates!r}")
    if "float" in candidates:
        raise ValueError("candidates: 'float' is always considered; do not pass it")
    filter_fn = filter_fn or default_filter
    layers = {name: mod for name, mod in model.named_modules() if filter_fn(mod, name)}
    if not layers:
        raise ValueError("autoquant: the model has no float nn.Linear layers to quantize")

    # 1. record input signatures and a sample of rows per layer (and, for calibrated candidates,
    # the statistics of every input row: GPTQ / AWQ calibrate on the example inputs)
    seen: dict[str, Counter] = {name: Counter() for name in layers}
    samples: dict[str, torch.Tensor] = {}
    calibrated = any(getattr(cfg, "algorithm", "rtn") in CALIBRATED for cfg in candidates.values())
    sums: dict[str, list] = {}

    def hook(name):
        def record(mod, args):
            x = args[0]
            k = mod.in_features
            seen[name][(x.numel() // k, str(x.dtype), str(x.device))] += 1
            if name not in samples:
                samples[name] = x.detach().reshape(-1, k)[:SAMPLE_ROWS].clone()
            if calibrated:
                flat = x.detach().reshape(-1, k).float()
                acc = sums.setdefault(name, [0, torch.zeros(k, k, device=flat.device), torch.zeros(k, device=flat.device)])
                acc[0] += flat.shape[0]
                acc[1] += flat.T @ flat
                acc[2] += flat.abs().sum(dim=0)

        return record

    handles = [mod.register_forward_pre_hook(hook(name)) for name, mod in layers.items()]
    try:
        with torch.no_grad():
            model(*example_inputs, **example_kwargs)
    finally:
        for h in handles:
            h.remove()
    stats = {name: LayerStatistics(hessian=h / t, mean_abs=a / t, sample=None, tokens=t, options={})
             for name, (t, h, a) in sums.items() if t}
    sums.clear()
    unused = [name for name in layers if not seen[name]]
    if unused:
        warnings.warn(f"autoquant: layers never called on the examples stay float: {unused[:8]}", RuntimeWarning, stacklevel=2)

    # 2. + 3. time per distinct signature, SQNR per layer
    timing = _TimingCache(_cache_path(cache))
    timed = cached = 0
    plan: dict[str, QuantConfig | None] = {}
    choices: list[LayerChoice] = []
    bar = _Progress(sum(1 for n in layers if seen[n]), progress)
    for name, mod in layers.items():
        if not seen[name]:
            continue
        weight, bias = mod.weight.detach(), None if mod.bias is None else mod.bias.detach()
        n, k = weight.shape
        sample = samples[name]
        ref = F.linear(sample, weight, bias)
        with calibration_scope(stats):
            quantized = {cname: _quantized(cfg, weight, name) for cname, cfg in candidates.items()}
        per: dict[str, dict] = {"float": {"ms": 0.0, "sqnr": float("inf"), "kernel": "F.linear", "status": "ok"}}
        for cname, q in quantized.items():
            if isinstance(q, str):
                per[cname] = {"ms": float("inf"), "sqnr": float("-inf"), "kernel": "-", "status": q}
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                y = F.linear(sample, q, bias)
            per[cname] = {"ms": 0.0, "sqnr": _sqnr(ref, y), "kernel": _kernel_name(sample, q, bias), "status": "ok"}
        for (m, dtype_s, device_s), count in seen[name].items():
            device = torch.device(device_s)
            context = f"{_context(device)}|{n}x{k}|M{m}|{dtype_s}|bias={bias is not None}|rotate={rotate_bytes}"
            x = torch.randn(m, k, device=device).to(getattr(torch, dtype_s.removeprefix("torch.")))
            fns, keys = {}, {}
            for cname in per:
                if per[cname]["status"] != "ok":
                    continue
                key = f"{context}|{'float' if cname == 'float' else candidates[cname].to_json_str()}"
                keys[cname] = key
                if key not in timing.entries:
                    w = weight if cname == "float" else quantized[cname]
                    fns[cname] = _Cycle(_rotation(w, rotate_bytes), x, bias)
            if fns:
                bar.step(f"{name} ({n}x{k}, M={m}): timing {len(fns)} candidates")
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    measured = _time_interleaved(fns, device, budget_s)
                timing.entries.update({keys[c]: ms for c, ms in measured.items()})
                timed += len(fns)
            cached += len(keys) - len(fns)
            for cname, key in keys.items():
                per[cname]["ms"] += count * timing.entries[key]
        eligible = [c for c, v in per.items() if v["status"] == "ok" and (min_sqnr is None or v["sqnr"] >= min_sqnr)]
        best = min(eligible, key=lambda c: (per[c]["ms"], c != "float"))
        plan[name] = None if best == "float" else candidates[best]
        choices.append(LayerChoice(name, (n, k), dict(seen[name]), best, per["float"]["ms"], per[best]["ms"], per[best]["sqnr"], per))
        bar.advance()
        bar.step(f"{name}: {best}")
    bar.close()
    timing.save()

    # 4. apply
    if apply and any(cfg is not None for cfg in plan.values()):
        with calibration_scope(stats):  # the same statistics: a calibrated choice gets the codes it was measured with
            quantize_(model, {name: cfg for name, cfg in plan.items()}, filter_fn=filter_fn)
    return AutoquantResult(plan, choices, timed, cached, min_sqnr)
