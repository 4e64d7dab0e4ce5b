"""``calibrate``: quantize a model with an algorithm that learns from data (GPTQ), block by block.

1. The model runs on the calibration batches up to its first block (the ``nn.ModuleList`` of
   repeated blocks holding most of the selected layers, e.g. a transformer's ``layers``); the
   inputs of that block (positional and keyword: masks, rotary embeddings) are kept.
2. For each block in turn: the block runs on those inputs while hooks accumulate, per selected
   linear, the statistics of its input (the Hessian ``X X^T / T``); the block's layers are then
   quantized with :func:`torchq.quantize_` inside a :func:`~torchq.algorithms.statistics.calibration_scope`
   (each config's ``algorithm`` reads its layer's statistics); the block runs again, now
   quantized, and its outputs become the next block's inputs. Each block is calibrated on the
   outputs of the already quantized blocks before it and, with ``sequential`` (the default), each
   stage of a block (the layers fed one input tensor, in the order they run) on the outputs of the
   block's quantized stages before it.
3. Layers outside the blocks (e.g. ``lm_head``) are calibrated last, on one more pass of the
   whole, now quantized, model.

Memory: the calibration inputs of one block (``tokens x hidden`` floats), one Hessian per distinct
input of the block's layers, and the quantized weights beside the float ones the model already
holds; with ``weights=`` (a meta-device model streamed from its float checkpoint) the float
weights of one block at a time instead of the whole model's. Atomic: if anything fails or the run is interrupted (``KeyboardInterrupt``), every
parameter and buffer the model had is put back, so the model is exactly as it was.
Deterministic: the same model, batches and config give the same codes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .algorithms.statistics import CALIBRATED, LayerStatistics, calibration_scope
from .configs import QuantConfig
from .quantize import UNSET, ConfigSpec, config_resolver, default_filter, quantize_
from .tensor import AffineQuantizedTensor

__all__ = ["calibrate", "CalibrationResult", "CalibratedLayer"]


class _BlockInputs(Exception):
    """Raised by the hook on the first block once its inputs are recorded (stops the forward)."""


@dataclass
class CalibratedLayer:
    """One layer's calibration: ``error`` / ``rtn_error`` are the output errors on the calibration
    inputs relative to the layer's output energy (``tr(dW H dW^T) / tr(W H W^T)``) of the codes kept
    and of round-to-nearest's; ``used``: the algorithm whose codes were kept."""

    name: str
    algorithm: str
    used: str
    error: float
    rtn_error: float
    tokens: int
    seconds: float
    alpha: float | None = None  # AWQ's chosen exponent


@dataclass
class CalibrationResult:
    """What :func:`calibrate` did: the plan (layer -> config, as quantize_ takes it), a row per
    calibrated layer, the time and the largest statistics it held at once."""

    plan: dict[str, QuantConfig | None]
    layers: list[CalibratedLayer]
    seconds: float
    blocks: int
    tokens: int
    peak_statistics_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    peak_float_bytes: int | None = None  # streaming (weights=): the most float bytes the model held at once

    def save_plan(self, path: str | os.PathLike) -> Path:
        """The plan as JSON (:func:`torchq.save_plan`); its configs name their algorithm. Re-applying a
        calibrated plan needs the data again: ``calibrate(model, batches, load_plan(path))``."""
        from .autotune import save_plan

        return save_plan(self.plan, path)

    def table(self) -> str:
        head = ("layer", "algorithm", "kept", "error", "rtn_error", "gain", "alpha", "seconds")
        rows = [head]
        for r in self.layers:
            gain = f"{r.rtn_error / r.error:.2f}x" if r.error > 0 else "-"
            alpha = "-" if r.alpha is None else f"{r.alpha:.2f}"
            rows.append((r.name, r.algorithm, r.used, f"{r.error:.3e}", f"{r.rtn_error:.3e}", gain, alpha, f"{r.seconds:.2f}"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
        streamed = "" if self.peak_float_bytes is None else f"; float weights held at most {self.peak_float_bytes / 2**20:.1f} MiB (streamed)"
        lines.append(f"# {len(self.layers)} layers in {self.blocks} blocks on {self.tokens} tokens, {self.seconds:.1f} s; "
                     f"statistics held at most {self.peak_statistics_bytes / 2**20:.1f} MiB{streamed}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _with_algorithm(cfg: QuantConfig | None, algorithm: str | None, name: str) -> QuantConfig | None:
    if cfg is None or algorithm is None:
        return cfg
    if not any(f.name == "algorithm" for f in dataclasses.fields(cfg)):  # type: ignore[arg-type]
        raise ValueError(f"algorithm: {type(cfg).__name__} (layer {name!r}) has no algorithm choice; "
                         f"calibrated algorithms apply to int4, intx and nf4 / fp4 weight-only configs")
    return dataclasses.replace(cfg, algorithm=algorithm)  # type: ignore[type-var]


def _find_blocks(model: nn.Module, names: set[str]) -> tuple[str, nn.ModuleList] | None:
    """The ModuleList whose children hold the most of ``names`` (at least two children with some)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for prefix, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        p = f"{prefix}." if prefix else ""
        per_child = [sum(1 for n in names if n.startswith(f"{p}{i}.")) for i in range(len(mod))]
        count = sum(per_child)
        if sum(1 for c in per_child if c) >= 2 and (best is None or count > best[0]):
            best = (count, prefix, mod)
    return None if best is None else (best[1], best[2])


def takes_one_mapping(model: nn.Module, batch: Mapping) -> bool:
    """Whether ``model``'s forward takes the mapping ``batch`` as one positional argument
    (``SentenceTransformer.forward(input: dict, **kwargs)``) rather than as keyword arguments
    (transformers' ``forward(input_ids=..., attention_mask=...)``): its signature binds ``batch``,
    does not bind ``**batch``, and no key of ``batch`` names one of its parameters. A forward that
    binds both (``*args, **kwargs``) gets keywords, as before."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # no signature to read (a builtin): keywords, as before
        return False
    named = {n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if named & set(batch):
        return False
    try:
        sig.bind(**batch)
        return False
    except TypeError:
        pass
    try:
        sig.bind(batch)
        return True
    except TypeError:
        return False


def _call(model: nn.Module, batch: Any) -> Any:
    """The default ``forward``: ``model(**b)`` for a mapping (``model(b)`` where the forward takes
    the mapping as its one argument, :func:`takes_one_mapping`), ``model(*b)`` for a tuple or list,
    else ``model(b)``."""
    if isinstance(batch, Mapping):
        return model(batch) if takes_one_mapping(model, batch) else model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


class _Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()

    def line(self, text: str, final: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty and not final:
            print("\r" + text[:150].ljust(150), end="", file=sys.stderr, flush=True)
        else:
            print(("\r" if self.tty else "") + text, file=sys.stderr, flush=True)


def _token_mask(batch: Any) -> torch.Tensor | None:
    """The batch's ``attention_mask`` (``[B, T]``; of a mapping batch, or of the first mapping in a
    tuple or list batch) as bools: padding positions are left out of the statistics."""
    if isinstance(batch, (tuple, list)):  # (features,): the first mapping of a positional batch
        batch = next((b for b in batch if isinstance(b, Mapping)), None)
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    return mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


class _Collector:
    """Forward pre-hooks that accumulate each layer's input Hessian (fp32, on the layer's device);
    layers fed the very same input tensor (q, k, v) share one product per call. ``mask``: the
    current batch's token mask (``[B, T]``); inputs ``[B, T, K]`` then count the kept tokens only."""

    mask: torch.Tensor | None = None

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        self.layers = layers
        self.hessian: dict[str, torch.Tensor] = {}
        self.abs_sum: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = dict.fromkeys(layers, 0)
        self.stage_of: dict[str, int] = {}  # layers fed the same input tensor share a stage, numbered in call order
        self._stages = 0
        self._last: tuple[Any, torch.Tensor, int, torch.Tensor] | None = None
        self.handles = [mod.register_forward_pre_hook(self._hook(name)) for name, mod in layers.items()]

    def _hook(self, name: str) -> Callable:
        def record(mod: nn.Module, args: tuple) -> None:
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor):
                return
            k = x.shape[-1]
            if self._last is not None and self._last[0] is x:
                xtx, rows = self._last[1], self._last[2]
                self.stage_of.setdefault(name, self._stages - 1)
            else:
                self.stage_of.setdefault(name, self._stages)
                self._stages += 1
                flat = x.detach()
                mask = self.mask
                if mask is not None and flat.dim() == 3 and tuple(flat.shape[:2]) == tuple(mask.shape):
                    flat = flat[mask.to(flat.device)]
                flat = flat.reshape(-1, k).float()
                xtx, rows = flat.T @ flat, flat.shape[0]
                self._last = (x, xtx, rows, flat.abs().sum(dim=0))
            abs_sum = self._last[3]
            if name in self.hessian:
                self.hessian[name] += xtx
                self.abs_sum[name] += abs_sum
            else:
                self.hessian[name] = xtx.clone()
                self.abs_sum[name] = abs_sum.clone()
            self.tokens[name] += rows

        return record

    def statistics(self, options: dict[str, Any]) -> dict[str, LayerStatistics]:
        out = {}
        for name, h in self.hessian.items():
            t = self.tokens[name]
            if t:
                out[name] = LayerStatistics(hessian=h / t, mean_abs=self.abs_sum[name] / t, sample=None, tokens=t,
                                            options=options)
        return out

    def first_stage(self) -> list[str]:
        """The layers that ran first, on one shared input (e.g. q, k and v), in the order given."""
        if not self.stage_of:
            return list(self.layers)
        first = min(self.stage_of.values())
        return [n for n in self.layers if self.stage_of.get(n) == first]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.hessian, self.abs_sum) for t in d.values())

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self._last = None


def calibrate(
    model: nn.Module,
    batches: Iterable[Any],
    config: ConfigSpec,
    *,
    algorithm: str | None = None,
    filter_fn: Callable[[nn.Module, str], bool] | None = None,
    blocks: str | nn.ModuleList | None = None,
    damp: float = 0.01,
    act_order: bool = True,
    static_groups: bool = False,
    gptq_clip: bool = True,
    gptq_awq_scale: bool = True,
    grid: int = 20,
    clip: bool = True,
    sequential: bool = True,
    weights: str | os.PathLike | None = None,
    init_buffers: Callable[[nn.Module], None] | str | None = "auto",
    forward: Callable[[nn.Module, Any], Any] | None = None,
    progress: bool = True,
) -> CalibrationResult:
    """Quantize ``model`` in place with a calibrated algorithm; returns a :class:`CalibrationResult`.

    ``batches``: the calibration inputs, each passed to the model as ``model(**b)`` (a mapping;
    ``model(b)`` where the forward takes one mapping argument, as ``SentenceTransformer`` does with
    ``st_model.tokenize(texts)``), ``model(*b)`` (a tuple or list) or ``model(b)``; ``forward``, a
    callable ``forward(model, b)``, runs a batch any other way. A batch's ``attention_mask`` (of a
    mapping, or of the first mapping in a tuple or list) keeps padding out of the statistics. ``config``: as for :func:`torchq.quantize_` (one
    config, or a mapping of names / ``"re:"`` patterns / ``"_default"`` to configs); ``algorithm``
    (``"gptq"`` or ``"awq"``) replaces the ``algorithm`` of every config (configs may instead name it themselves;
    layers whose config needs no data, e.g. ``algorithm="rtn"``, are quantized with the others of
    their block). ``blocks``: the ``nn.ModuleList`` (or its qualified name) to walk block by block
    (default: found, see the module docstring; a model without one is calibrated in one pass).
    GPTQ options: ``damp``, ``act_order`` (on by default: SmolLM2 int4 g128 perplexity +14.4% without,
    +11.1% with; MiniLM cosine 0.9871 -> 0.9889), ``static_groups``, ``gptq_clip`` (its ``clip``, on by
    default: SmolLM2 int4 g128 perplexity +21% -> +12.8% over float; :func:`torchq.algorithms.gptq_quantize`),
    ``gptq_awq_scale`` (on by default: GPTQ also runs on the columns scaled by AWQ's input factor and
    each layer keeps whichever has the lower output error; +12.8% -> +11.1%, at about twice the time);
    AWQ options: ``grid``, ``clip`` (:func:`torchq.algorithms.awq_quantize`). AWQ's input scales stay
    on the quantized weights (:attr:`torchq.AffineQuantizedTensor.input_scale`).
    ``sequential`` (default True): within a block, the layers are calibrated stage by stage (the
    layers sharing one input, e.g. q/k/v, then o, then gate/up, then down), each stage's statistics
    gathered with the stages before it already quantized (one more run of the block per stage);
    False gathers every layer's statistics from one run of the float block.
    ``weights``: streaming. A float checkpoint (a safetensors file, a folder or a sharded index, as
    ``save_pretrained`` or :func:`torchq.save_quantized` write them) holding the tensors of a model
    built on the ``meta`` device: the tensors outside the blocks (embeddings, final norm, head) are
    read at the start, each block's when calibration reaches it, so the float model is never whole
    in memory: peak is the quantized model, the float tensors outside the blocks, one block's float
    weights and its calibration activations. ``init_buffers`` (default ``"auto"``: a transformers
    model's ``_init_weights``) computes the non-persistent buffers a meta model lacks (rotary
    ``inv_freq``); see :func:`torchq.checkpoint.init_meta_buffers`. On failure the model is put
    back on ``meta`` exactly as it was.
    ``progress``: one line per layer on stderr, with its error.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if algorithm is not None and algorithm not in CALIBRATED:
        raise ValueError(f"algorithm: expected one of {CALIBRATED} or None (the configs' own), got {algorithm!r}")
    if forward is not None and not callable(forward):
        raise TypeError(f"forward: expected a callable forward(model, batch) or None, got {type(forward).__name__}")
    run = _call if forward is None else forward
    if isinstance(batches, (torch.Tensor, Mapping)):
        batches = [batches]
    data = list(batches)
    if not data:
        raise ValueError("batches: calibrate needs at least one calibration batch")
    if not 0 <= damp < 1e6:
        raise ValueError(f"damp: expected a value >= 0, got {damp!r}")
    if not (isinstance(grid, int) and grid >= 1):
        raise ValueError(f"grid: expected a positive int, got {grid!r}")
    options = {"gptq": {"damp": float(damp), "act_order": bool(act_order), "static_groups": bool(static_groups),
                        "clip": bool(gptq_clip), "awq_scale": bool(gptq_awq_scale)},
               "awq": {"grid": grid, "clip": bool(clip)}}
    filter_fn = filter_fn or default_filter
    selected = [name for name, mod in model.named_modules() if filter_fn(mod, name)]
    resolve = config_resolver(config, selected)
    plan: dict[str, QuantConfig | None] = {}
    for name in selected:
        cfg = resolve(name)
        if cfg is UNSET:
            continue
        plan[name] = _with_algorithm(cfg, algorithm, name)  # type: ignore[arg-type]
    if not any(cfg is not None for cfg in plan.values()):
        raise ValueError("config: selects no layer to quantize")
    modules = dict(model.named_modules())
    if isinstance(blocks, str):
        if not isinstance(modules.get(blocks), nn.ModuleList):
            raise ValueError(f"blocks: {blocks!r} is not an nn.ModuleList of the model")
        found: tuple[str, nn.ModuleList] | None = (blocks, modules[blocks])  # type: ignore[assignment]
    elif isinstance(blocks, nn.ModuleList):
        prefix = next((n for n, m in modules.items() if m is blocks), None)
        if prefix is None:
            raise ValueError("blocks: the ModuleList given is not part of the model")
        found = (prefix, blocks)
    elif blocks is None:
        found = _find_blocks(model, {n for n, c in plan.items() if c is not None})
    else:
        raise TypeError(f"blocks: expected an nn.ModuleList, its name or None, got {type(blocks).__name__}")

    if weights is None:
        on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
        if on_meta:
            raise ValueError(f"model: {len(on_meta)} tensor(s) are on the meta device ({', '.join(on_meta[:4])}"
                             f"{', ...' if len(on_meta) > 4 else ''}); pass weights= the float checkpoint to read them from")
    state = _Snapshot(model)
    bar = _Progress(progress)
    result = CalibrationResult(plan, [], 0.0, 0, 0)
    start = time.perf_counter()
    try:
        with torch.no_grad(), _no_cache(model), contextlib.ExitStack() as stack:
            streamed = None
            if weights is not None:
                streamed = _Streamed(model, Path(weights), found, stack)
                streamed.load_outside_blocks(init_buffers)
            if found is None:
                _calibrate_group(model, list(plan), plan, options, _whole(model, data, run), result, bar, "model", sequential)
            else:
                _calibrate_blocks(model, data, run, plan, options, found, result, bar, sequential, streamed)
            if streamed is not None:
                result.peak_float_bytes = streamed.peak_bytes
    except BaseException:
        state.restore()
        raise
    result.seconds = time.perf_counter() - start
    bar.line(f"calibrate: {len(result.layers)} layers in {result.seconds:.1f} s", final=True)
    return result


def _whole(model: nn.Module, data: list, forward: Callable[[nn.Module, Any], Any]) -> Callable[[_Collector], None]:
    def run(collector: _Collector) -> None:
        for b in data:
            collector.mask = _token_mask(b)
            forward(model, b)

    return run


def _calibrate_blocks(model: nn.Module, data: list, forward: Callable[[nn.Module, Any], Any],
                      plan: dict[str, QuantConfig | None], options: dict,
                      found: tuple[str, nn.ModuleList], result: CalibrationResult, bar: _Progress, sequential: bool,
                      streamed: _Streamed | None = None) -> None:
    prefix, blocks = found
    p = f"{prefix}." if prefix else ""
    inputs: list[tuple[list, dict]] = []

    def capture(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs.append((list(args), dict(kwargs)))
        raise _BlockInputs

    handle = blocks[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        for b in data:
            try:
                forward(model, b)
            except _BlockInputs:
                pass
    finally:
        handle.remove()
    if len(inputs) != len(data):
        raise RuntimeError(f"calibrate: the first block {p}0 ran on {len(inputs)} of {len(data)} batches")
    result.tokens = sum(int(m.sum()) if (m := _token_mask(b)) is not None else _hidden(a, k).shape[:-1].numel()
                        for (a, k), b in zip(inputs, data))
    done: set[str] = set()
    for i, block in enumerate(blocks):
        if streamed is not None:
            streamed.load_block(i)
        names = [n for n in plan if n.startswith(f"{p}{i}.")]
        done.update(names)

        def run_block(collector: _Collector | None = None, block: nn.Module = block) -> list:
            outs = []
            for (a, k), b in zip(inputs, data):
                if collector is not None:
                    collector.mask = _token_mask(b)
                outs.append(_output(block(*a, **k)))
            return outs

        if names:
            _calibrate_group(model, names, plan, options, run_block, result, bar, f"block {i + 1}/{len(blocks)}", sequential)
        outputs = run_block()  # the quantized block's outputs feed the next one
        for (a, k), y in zip(inputs, outputs):
            _set_hidden(a, k, y)
        result.blocks += 1
    rest = [n for n in plan if n not in done]
    if rest:
        _calibrate_group(model, rest, plan, options, _whole(model, data, forward), result, bar, "rest", sequential)


def _hidden(args: list, kwargs: dict) -> torch.Tensor:
    x = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(x, torch.Tensor):
        raise TypeError("calibrate: the block's first input is not a tensor (expected the hidden states)")
    return x


def _set_hidden(args: list, kwargs: dict, y: torch.Tensor) -> None:
    if args:
        args[0] = y
    else:
        kwargs["hidden_states"] = y


def _output(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"calibrate: a block returned {type(out).__name__}; expected the hidden states (a tensor or a tuple starting with one)")


def _calibrate_group(model: nn.Module, names: list[str], plan: dict[str, QuantConfig | None], options: dict,
                     run: Callable[[_Collector], Any], result: CalibrationResult, bar: _Progress, where: str,
                     sequential: bool = False) -> None:
    """Gather the statistics of ``names`` while ``run()`` runs, then quantize them. ``sequential``:
    one stage at a time (the layers that share an input, in the order they run); each stage's
    statistics are gathered with the stages before it already quantized."""
    modules = dict(model.named_modules())
    wanted = {n: plan[n] for n in names if plan[n] is not None}
    calibrated = [n for n in wanted if getattr(wanted[n], "algorithm", "rtn") in CALIBRATED]
    data_free = [n for n in wanted if n not in calibrated]
    _quantize_layers(model, data_free, wanted, {}, result, bar, where)  # first: the stages after them see them quantized
    pending = calibrated
    while pending:
        collector = _Collector({n: modules[n] for n in pending})
        try:
            bar.line(f"calibrate [{where}] collecting inputs of {len(pending)} layers")
            run(collector)
        finally:
            collector.close()
        result.peak_statistics_bytes = max(result.peak_statistics_bytes, collector.nbytes())
        if not result.tokens:  # no block list: the tokens are those the layers saw
            result.tokens = max(collector.tokens.values(), default=0)
        stage = collector.first_stage() if sequential else pending
        stats = collector.statistics(options)
        del collector
        _quantize_layers(model, stage, wanted, stats, result, bar, where)
        pending = [n for n in pending if n not in stage]


def _quantize_layers(model: nn.Module, names: list[str], wanted: dict[str, QuantConfig], stats: dict[str, LayerStatistics],
                     result: CalibrationResult, bar: _Progress, where: str) -> None:
    for name in names:  # one quantize_ per layer: each reports its own time and error
        t0 = time.perf_counter()
        with calibration_scope(stats):
            quantize_(model, {name: wanted[name]}, filter_fn=lambda m, n, only=name: n == only and default_filter(m, n))
        st = stats.get(name)
        if st is not None and st.report:
            row = CalibratedLayer(name, wanted[name].algorithm, st.report["used"], st.report["error"],  # type: ignore[attr-defined]
                                  st.report["rtn_error"], st.tokens, time.perf_counter() - t0, st.report.get("alpha"))
            result.layers.append(row)
            bar.line(f"calibrate [{where}] {name}: {row.algorithm} error {row.error:.3e} (rtn {row.rtn_error:.3e})")
            stats.pop(name)


class _Streamed:
    """The meta tensors of a model, read from a float checkpoint as calibration reaches them
    (:func:`calibrate`'s ``weights``). Everything is checked before anything is read: each meta
    tensor (tied ones once) must be in the checkpoint, as a float tensor of the same shape."""

    def __init__(self, model: nn.Module, path: Path, found: tuple[str, nn.ModuleList] | None, stack: contextlib.ExitStack) -> None:
        from .checkpoint.model_state import model_slots
        from .checkpoint.safetensors_io import open_checkpoint

        self.model, self.path = model, path
        self.incoming, aliases = open_checkpoint(path, stack)
        in_ckpt = set(self.incoming) | set(aliases)
        ties: dict[int, list[str]] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        for name, slot in model_slots(model).items():
            if slot.tensor.device.type == "meta":
                ties.setdefault(id(slot.tensor), []).append(name)
                self.shape_of[name] = tuple(slot.tensor.shape)
        if not ties:
            raise ValueError(f"weights: given ({path}), but no tensor of the model is on the meta device; build the model "
                             f"under torch.device('meta') to stream its float weights, or leave weights=None")
        self.source: dict[str, str] = {}  # model name -> the checkpoint entry that fills it
        missing = []
        for names in ties.values():
            sources = {aliases.get(n, n) for n in names if n in in_ckpt}
            if not sources:
                missing.extend(names)
                continue
            if len(sources) > 1:
                raise ValueError(f"weights: the model ties {names} to one tensor, but {path} stores them separately ({sorted(sources)})")
            src = sources.pop()
            inc = self.incoming[src]
            if inc.quantized:
                raise ValueError(f"weights: {src!r} is already quantized in {path} ({inc.describe}); calibrate reads float weights")
            for n in names:
                if self.shape_of[n] != tuple(inc.shape):
                    raise ValueError(f"weights: {n!r} has shape {list(self.shape_of[n])} in the model but {list(inc.shape)} "
                                     f"in {path}; is it a checkpoint of another model?")
                self.source[n] = src
        if missing:
            raise ValueError(f"weights: {path} holds no tensor for {len(missing)} meta tensor(s) of the model "
                             f"({', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''})")
        self.block_of: dict[str, int | None] = {}
        prefix = None if found is None else (f"{found[0]}." if found[0] else "")
        for names in ties.values():
            idx = [self._block(n, prefix) for n in names]
            self.block_of.update(dict.fromkeys(names, None if None in idx else min(idx)))  # tied across: read first
        self.peak_bytes = 0  # the most float bytes the model held at once, right after a read

    @staticmethod
    def _block(name: str, prefix: str | None) -> int | None:
        if prefix is None or not name.startswith(prefix):
            return None
        head = name[len(prefix):].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def _load(self, names: list[str]) -> None:
        from .checkpoint.model_state import LoadWarning, install_checkpoint

        if not names:
            return
        sources = {self.source[n] for n in names}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LoadWarning)  # the rest is still on meta, by design
            install_checkpoint(self.model, {s: self.incoming[s] for s in sources},
                               {n: self.source[n] for n in names if n != self.source[n]},
                               device=None, strict=False, source=str(self.path))
        held = {id(t): t for t in [*self.model.parameters(), *self.model.buffers()]
                if t.device.type != "meta" and not isinstance(t, AffineQuantizedTensor)}
        self.peak_bytes = max(self.peak_bytes, sum(t.numel() * t.element_size() for t in held.values()))

    def load_outside_blocks(self, init_buffers: Callable[[nn.Module], None] | str | None) -> None:
        from .checkpoint.model_state import init_meta_buffers, meta_buffers

        self._load([n for n, b in self.block_of.items() if b is None])
        if meta_buffers(self.model):
            if init_buffers is None:
                raise ValueError(f"init_buffers: the model has non-persistent buffers on the meta device "
                                 f"({', '.join(sorted(meta_buffers(self.model))[:4])}), which no checkpoint holds; pass "
                                 f"init_buffers='auto' (a transformers model) or a function(module) that fills them")
            init_meta_buffers(self.model, init_buffers)

    def load_block(self, i: int) -> None:
        self._load([n for n, b in self.block_of.items() if b == i])


class _no_cache:
    """``model.config.use_cache = False`` while calibrating (a transformers model would otherwise
    build key/value caches it never uses), restored afterwards."""

    def __init__(self, model: nn.Module) -> None:
        self.config = getattr(model, "config", None)
        self.had = self.config is not None and hasattr(self.config, "use_cache")

    def __enter__(self) -> None:
        if self.had:
            self.old = self.config.use_cache
            self.config.use_cache = False

    def __exit__(self, *exc: Any) -> None:
        if self.had:
            self.config.use_cache = self.old


_MISSING = object()


class _Snapshot:
    """Every parameter and buffer registration of the model, and the attributes quantize_ sets on a
    transformers model, to put back if calibration fails."""

    def __init__(self, model: nn.Module) -> None:
        self.slots = [(mod, table, attr, t) for mod in model.modules()
                      for table in (mod._parameters, mod._buffers) for attr, t in table.items()]
        self.model = model
        self.quantizer = model.__dict__.get("hf_quantizer", _MISSING)
        cfg = getattr(model, "config", None)
        self.qconfig = _MISSING if cfg is None else getattr(cfg, "quantization_config", _MISSING)

    def restore(self) -> None:
        for _mod, table, attr, t in self.slots:
            table[attr] = t
        if self.quantizer is _MISSING:
            self.model.__dict__.pop("hf_quantizer", None)
        else:
            self.model.__dict__["hf_quantizer"] = self.quantizer
        cfg = getattr(self.model, "config", None)
        if cfg is not None:
            if self.qconfig is _MISSING:
                if hasattr(cfg, "quantization_config"):
                    try:
                        delattr(cfg, "quantization_config")
                    except AttributeError:
                        pass
            else:
                cfg.quantization_config = self.qconfig
