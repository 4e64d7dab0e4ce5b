"""``explain``: which linear kernel each quantized layer runs, and why the others do not."""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field

import torch
from torch import nn

from . import dispatch
from .layouts import layout_rejections
from .tensor import AffineQuantizedTensor

__all__ = ["explain", "ExplainReport", "LinearDecision"]

FALLBACK = "FALLBACK: dequantize + F.linear"
WIDTH = 100  # the text report fits a terminal this wide
ACCEPTS_TOO = "accepts, but a kernel before it was chosen"


@dataclass
class LinearDecision:
    layer: str
    config: str
    layout: str
    format: str
    input: str
    kernel: str
    verdicts: list[tuple[str, str | None]] = field(default_factory=list)
    compute: str = ""  # the dtype computed in and how the input gets there ("bfloat16 (input cast)")
    fallback: str | None = None  # why this is not the kernel asked for (a cast fallback), else None
    # automatic layout choice (the config names no layout): the layouts tried before this one on
    # the weight's device, and why each was passed over
    layouts_passed_over: list[tuple[str, str]] = field(default_factory=list)

    @property
    def rejected(self) -> list[tuple[str, str]]:
        return [(k, r) for k, r in self.verdicts if r is not None]

    @property
    def is_fallback(self) -> bool:
        return self.kernel == FALLBACK


class ExplainReport:
    """One :class:`LinearDecision` per (layer, input dtype, input shape) seen."""

    def __init__(self, decisions: list[LinearDecision]) -> None:
        self.decisions = decisions

    def __iter__(self):
        return iter(self.decisions)

    def __len__(self) -> int:
        return len(self.decisions)

    def kernels(self) -> dict[str, str]:
        """layer -> chosen kernel (last input seen wins)."""
        return {d.layer: d.kernel for d in self.decisions}

    def to_dict(self) -> list[dict]:
        return [
            {"layer": d.layer, "config": d.config, "layout": d.layout, "format": d.format, "input": d.input,
             "kernel": d.kernel, "compute": d.compute, "fallback": d.fallback, "rejected": dict(d.rejected),
             "layouts_passed_over": dict(d.layouts_passed_over)}
            for d in self.decisions
        ]

    def __str__(self) -> str:
        """Layers that share config, layout, input dtype, kernel and rejection reasons are one
        group; within a group, one line per distinct reason (naming every kernel it rejected)."""
        if not self.decisions:
            return "torchq.explain: no quantized linear layers were called"
        groups: dict[tuple, list[LinearDecision]] = {}
        for d in self.decisions:
            key = (d.config, d.layout, d.input.split("[")[0], d.kernel, d.compute, tuple(d.verdicts))
            groups.setdefault(key, []).append(d)
        n, g = len(self.decisions), len(groups)
        lines = _wrap(f"torchq.explain: {n} quantized linear call{'s' * (n > 1)} in {g} group{'s' * (g > 1)} "
                      "(same config, layout, kernel and reasons)", "  ")
        for ds in groups.values():
            d = ds[0]
            names = list(dict.fromkeys(x.layer for x in ds))
            lines.append("")
            lines += _wrap(f"{len(names)} layer{'s' if len(names) > 1 else ''}: {_compact_names(names)}", "  ")
            for label, value in (("kernel", d.kernel), ("compute", d.compute),
                                 ("input", ", ".join(dict.fromkeys(x.input for x in ds))),
                                 ("config", d.config), ("layout", d.layout),
                                 ("format", ", ".join(dict.fromkeys(x.format for x in ds)))):
                lines += _wrap(f"  {label:<8}{value}", " " * 10)
            passed_over: dict[str, list[str]] = {}  # layers of a group differ in shape: every distinct reason
            for x in ds:
                for layout, reason in x.layouts_passed_over:
                    if layout not in passed_over.setdefault(reason, []):
                        passed_over[reason].append(layout)
            if passed_over:
                lines.append("  layout chosen automatically; passed over (one line per reason):")
                for reason, layouts in passed_over.items():
                    lines += _wrap(f"    {', '.join(layouts)}: {reason}", " " * 8)
            reasons: dict[str, list[str]] = {}
            for k, reason in d.verdicts:
                if k != d.kernel:
                    reasons.setdefault(ACCEPTS_TOO if reason is None else reason, []).append(k)
            if reasons:
                lines.append("  not chosen (one line per reason):")
                for reason, kernels in reasons.items():
                    lines += _wrap(f"    {', '.join(kernels)}: {reason}", " " * 8)
        return "\n".join(lines)

    __repr__ = __str__


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_on_hyphens=False) or [text]


def _compact_names(names: list[str]) -> str:
    """Layer names with one varying number folded: ``blk.[0-29].attn_q`` for 30 names."""
    by_pattern: dict[str, list[str]] = {}
    for n in names:
        by_pattern.setdefault(re.sub(r"\d+", "#", n), []).append(n)
    out = []
    for pattern, members in by_pattern.items():
        if len(members) < 3 or pattern.count("#") != 1:
            out += members
            continue
        numbers = sorted(int(re.search(r"\d+", m).group()) for m in members)
        runs, start = [], numbers[0]
        for a, b in zip(numbers, numbers[1:] + [None]):
            if b != a + 1:
                runs.append(str(start) if start == a else f"{start}-{a}")
                start = b
        out.append(pattern.replace("#", f"[{','.join(runs)}]"))
    return ", ".join(out)


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _compute(plan: dispatch.LinearPlan) -> str:
    if not plan.cast:
        return _dtype(plan.run_dtype)
    asked = "" if plan.fallback is None else f", FALLBACK: no kernel takes {_dtype(plan.compute_dtype)}"
    return f"{_dtype(plan.run_dtype)} (input {_dtype(plan.input_dtype)} cast, output cast back{asked})"


def _layouts_passed_over(w: AffineQuantizedTensor) -> list[tuple[str, str]]:
    """For a weight whose config left the layout to automatic choice: the layouts automatic choice
    tries before the weight's own on its device, each with why it was passed over."""
    if w.config is None or getattr(w.config, "layout", True) is not None:
        return []
    impl = w.tensor_impl
    scale_dtype = impl.map(lambda t: t.to("meta")).to_plain().scale.dtype  # no data is unpacked
    out = []
    for name, reason in layout_rejections(impl.spec, impl.shape, scale_dtype, w.device).items():
        if name == impl.layout.name:
            break
        out.append((name, reason or "would be chosen now (the weight was placed with other options or on another device)"))
    return out


def _decision(name: str, w: AffineQuantizedTensor, x: torch.Tensor, plan: dispatch.LinearPlan) -> LinearDecision:
    cfg = w.config
    kernel = plan.kernel
    return LinearDecision(
        layer=name,
        config=repr(cfg) if cfg is not None else "(none recorded)",
        layout=repr(w.tensor_impl.layout),
        format=w.tensor_impl.spec.describe() + (f" + {w.act_quant.describe()}" if w.act_quant is not None else "")
        + (" + input scale (AWQ: x * input_scale before the codes)" if w.input_scale is not None else ""),
        input=f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}",
        kernel=FALLBACK if kernel is None else kernel.name,
        verdicts=list(plan.verdicts),
        compute=_compute(plan),
        fallback=plan.fallback if kernel is not None else None,
        layouts_passed_over=_layouts_passed_over(w),
    )


def explain(target: nn.Module | torch.Tensor, *example_inputs, **example_kwargs) -> ExplainReport:
    """Report the kernel each quantized linear chooses.

    With example inputs, ``target`` (a module, or a quantized weight) is run on them under
    ``torch.no_grad()`` and every quantized linear call is recorded. Without inputs, each
    quantized weight is checked against a one-row input in its own dtype.
    """
    if isinstance(target, AffineQuantizedTensor):
        weights = {id(target): ("weight" if not target.label else target.label, target)}
    elif isinstance(target, nn.Module):
        weights = {}
        for mname, mod in target.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                if isinstance(p, AffineQuantizedTensor):
                    full = f"{mname}.{pname}" if mname else pname
                    weights[id(p)] = (mname if pname == "weight" and mname else full, p)
    else:
        raise TypeError(f"target: expected an nn.Module or an AffineQuantizedTensor, got {type(target).__name__}")

    if not example_inputs and not example_kwargs:
        out = []
        for name, w in weights.values():
            x = torch.zeros(1, w.shape[-1], dtype=w.dtype, device=w.device)
            out.append(_decision(name, w, x, dispatch.plan_linear(x, w, None, evaluate_all=True)))
        return ExplainReport(out)

    with dispatch.recording() as records, torch.no_grad():
        if isinstance(target, AffineQuantizedTensor):
            torch.nn.functional.linear(example_inputs[0], target)
        else:
            target(*example_inputs, **example_kwargs)
    seen: dict[tuple, LinearDecision] = {}
    for w, x, plan in records:
        name = weights.get(id(w), (w.label or f"<unnamed {tuple(w.shape)}>", w))[0]
        key = (name, x.dtype, tuple(x.shape))
        seen[key] = _decision(name, w, x, plan)
    return ExplainReport(list(seen.values()))
