"""Latency, accuracy and size of one quantized ``nn.Linear`` on CPU, per config, dtype and M.

For every shape ``KxN``, activation dtype and config, a ``Linear(K, N, bias=False)`` is built
with a fixed seed (in fp32, then cast, so every dtype holds the same rounded weights), a copy
is quantized with ``torchq.quantize_`` and its forward on an ``[M, K]`` input is timed under
``torch.inference_mode()``: a few warm-up calls, then the configs of one input are timed in
interleaved rounds (each gets a slice of every round, so a slow phase of a shared machine hits
all alike) until a per-cell time budget is spent (at least ``--min-reps`` calls). Columns:

* ``ms``: median latency (``min_ms``: the fastest call, less sensitive to a busy machine);
* ``spread``: interquartile range / median of the calls;
* ``speedup``: float ``F.linear`` in the same dtype / this (>1 = faster); ``vs_best``: the fastest
  float path for that input (``F.linear`` in its dtype, or upcast to fp32: row ``float-fp32``) / this;
  ``noisy`` instead of a ratio when either side's timing is noisy: a spread above 25%, or a median
  above twice the fastest call (most calls were held up: an oversubscribed machine);
* ``kernel``: what ``torchq.explain`` says the layer ran (``FALLBACK: ...`` = no fast kernel);
* ``sqnr``: 10*log10(|ref|^2 / |ref - out|^2) in dB, ref = the float output in the same dtype;
* ``weight``: bytes of the weight (``nbytes_quantized()`` for torchq weights).

For reference, fp32 also gets a ``fbgemm`` row: PyTorch's own dynamic int8 Linear
(``torch.ao.quantization.quantize_dynamic``, per-channel qint8), skipped if unavailable.

    torchq bench                                           # full default run, a few minutes on 2 cores (= python benchmarks/bench_linear.py)
    torchq bench --quick                                   # small shapes, few reps (smoke test; timings indicative only)
    torchq bench --shapes 4096x11008 --m 1 --dtypes bf16 --configs float,int4-g128 --json out.json

Config names: float, int8wo, int8dq, int4-g<G>, intx<B>-g<G>, nf4[-b<B>], fp4[-b<B>], fbgemm, and, when
bitsandbytes is installed, bnb-nf4 / bnb-fp4 (its Linear4bit, the alternative to torchq's NF4/FP4).
A torchq config with the suffix ``@ref`` (``nf4@ref``) runs the same weights through the pure-PyTorch
reference ops instead of the native CPU kernels (``torchq.native.status()`` is printed first).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import torchq
from torchq.timing import NOISY_SPREAD, STALLED, time_interleaved

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CONFIGS = "float,int8wo,int8dq,int4-g128,int4-g32,intx3-g32,fbgemm"
COLUMNS = [("shape", "<"), ("M", ">"), ("dtype", "<"), ("config", "<"), ("ms", ">"), ("min_ms", ">"), ("spread", ">"),
           ("speedup", ">"), ("vs_best", ">"), ("sqnr", ">"), ("weight", ">"), ("kernel", "<")]


def build_linear(k: int, n: int, dtype: torch.dtype, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)  # initialised in fp32, then cast: every dtype holds the same rounded weights
    return nn.Linear(k, n, bias=False).to(dtype).eval()


def build_input(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def build_fbgemm(lin: nn.Linear) -> nn.Module:
    """PyTorch's dynamic int8 Linear (fp32 only); raises if torch.ao quantization is unavailable."""
    from torch.ao import quantization as tq

    qconfig = getattr(tq, "per_channel_dynamic_qconfig", None) or tq.default_dynamic_qconfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tq.quantize_dynamic(nn.Sequential(copy.deepcopy(lin).float()), {nn.Linear: qconfig}, dtype=torch.qint8)


def build_bnb_4bit(lin: nn.Linear, quant_type: str) -> nn.Module:
    """bitsandbytes' Linear4bit (double-quantized statistics, compute in the weight's dtype);
    raises ImportError when bitsandbytes is not installed."""
    import bitsandbytes as bnb

    out = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=lin.weight.dtype,
                            compress_statistics=True, quant_type=quant_type)
    out.weight = bnb.nn.Params4bit(lin.weight.detach().clone(), requires_grad=False, compress_statistics=True, quant_type=quant_type)
    return out.to("cpu")  # bitsandbytes quantizes on the move


def bnb_nbytes(model: nn.Module) -> int:
    qs = model.weight.quant_state
    stats = [qs.absmax] + ([qs.state2.absmax] if getattr(qs, "nested", False) else [])
    return model.weight.data.numel() + sum(t.numel() * t.element_size() for t in stats)


def fbgemm_nbytes(model: nn.Module) -> int:
    w = model[0]._packed_params._weight_bias()[0]
    n = w.numel() * w.element_size()
    if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
        n += sum(t.numel() * t.element_size() for t in (w.q_per_channel_scales(), w.q_per_channel_zero_points()))
    return n


class ReferenceOps(nn.Module):
    """Runs a quantized module with torchq's native kernels disabled (config suffix ``@ref``)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torchq.native.disabled():
            return self.inner(x)


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    err = (ref - out).pow(2).sum().item()
    return math.inf if err == 0 else 10 * math.log10(ref.pow(2).sum().item() / err)


def first_call(fn, x: torch.Tensor, ref: torch.Tensor) -> dict:
    """Output accuracy of ``fn(x)`` and the warnings it raised (the first call sees torchq's
    one-time FallbackWarning)."""
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(x)
    return {"sqnr_db": sqnr_db(ref, out), "warnings": sorted({str(w.message)[:200] for w in caught})}


def time_cells(fns: dict, args) -> dict[str, dict]:
    """Latency of every function in ``fns`` (config -> zero-argument call), in interleaved rounds."""
    per_round = -(-args.min_reps // args.rounds)
    with torch.inference_mode():
        timings = time_interleaved(fns, rounds=args.rounds, budget_s=args.budget, min_reps=per_round,
                                   max_reps=-(-args.max_reps // args.rounds), warmup=args.warmup)
    return {name: {"ms": t.median * 1e3, "min_ms": t.min * 1e3, "max_ms": t.max * 1e3, "q1_ms": t.quartiles[0] * 1e3,
                   "q3_ms": t.quartiles[1] * 1e3, "spread": t.spread, "noisy": t.noisy, "reps": len(t.samples)}
            for name, t in timings.items()}


def run_shape_dtype(k: int, n: int, dname: str, args) -> list[dict]:
    """All rows for one (shape, dtype): quantize each config once, then measure every M."""
    dtype = DTYPES[dname]
    lin = build_linear(k, n, dtype, args.seed)
    w = lin.weight.detach()
    w32 = w.float()
    cands: list[tuple[str, object, int, str]] = [("float", lambda x: F.linear(x, w), w.numel() * w.element_size(), "F.linear (aten)")]
    if dtype != torch.float32:
        cands.append(("float-fp32", lambda x: F.linear(x.float(), w32).to(dtype), w32.numel() * 4, "F.linear fp32 (input upcast)"))
    errors: list[dict] = []
    for name in args.configs:
        try:
            if name == "float":
                continue
            if name in ("bnb-nf4", "bnb-fp4"):
                bl = build_bnb_4bit(lin, name[4:])
                cands.append((name, bl, bnb_nbytes(bl), "bitsandbytes Linear4bit"))
                continue
            if name == "fbgemm":
                if dtype == torch.float32:
                    fb = build_fbgemm(lin)
                    cands.append((name, fb, fbgemm_nbytes(fb), f"quantized::linear_dynamic ({torch.backends.quantized.engine})"))
                continue
            q = copy.deepcopy(lin)
            torchq.quantize_(q, torchq.config_from_name(name.removesuffix("@ref")))
            if name.endswith("@ref"):  # the same weights through the pure-PyTorch reference ops
                cands.append((name, ReferenceOps(q), q.weight.nbytes_quantized(), "reference ops (torchq.native.disabled())"))
            else:
                cands.append((name, q, q.weight.nbytes_quantized(), ""))
        except Exception as e:  # one broken config must not stop the run
            if name in ("fbgemm", "bnb-nf4", "bnb-fp4"):  # references only: note it and go on
                print(f"note: {name} baseline unavailable ({type(e).__name__}: {e})")
            else:
                errors.append({"config": name, "error": f"{type(e).__name__}: {e}"})
    rows = []
    for m in args.m:
        x = build_input(m, k, dtype, args.seed + 1)
        with torch.inference_mode():
            ref = F.linear(x, w)
        cells: dict[str, dict] = {}
        fns = {}
        for name, fn, nbytes, kernel in cands:
            row = {"shape": f"{k}x{n}", "K": k, "N": n, "M": m, "dtype": dname, "config": name, "weight_bytes": nbytes, "kernel": kernel}
            try:
                row.update(first_call(fn, x, ref))
                if not row["kernel"]:
                    row["kernel"] = ", ".join(sorted(set(torchq.explain(fn, x).kernels().values())))
                fns[name] = functools.partial(fn, x)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            cells[name] = row
        try:
            for name, timing in time_cells(fns, args).items():
                cells[name].update(timing)
        except Exception as e:  # a config that ran once but fails when timed
            for name in fns:
                cells[name].setdefault("error", f"timing: {type(e).__name__}: {e}")
        rows += cells.values()
        rows += [{"shape": f"{k}x{n}", "K": k, "N": n, "M": m, "dtype": dname, **err} for err in errors]
    return rows


def add_ratios(rows: list[dict]) -> None:
    """speedup (vs float in the same dtype) and vs_best (vs the fastest float path for that input);
    ``*_noisy`` is set when either side's timing is noisy (the ratio is then not shown)."""
    for r in rows:
        same = [o for o in rows if (o["shape"], o["M"], o["dtype"]) == (r["shape"], r["M"], r["dtype"]) and "ms" in o]
        base = [o for o in same if o["config"] == "float"]
        best = min((o for o in same if o["config"] in ("float", "float-fp32")), key=lambda o: o["ms"], default=None)
        if "ms" in r:
            r["speedup"] = base[0]["ms"] / r["ms"] if base else None
            r["vs_best"] = best["ms"] / r["ms"] if best else None
            r["speedup_noisy"] = bool(base) and (base[0]["noisy"] or r["noisy"])
            r["vs_best_noisy"] = best is not None and (best["noisy"] or r["noisy"])


def _fmt_bytes(b: int) -> str:
    return f"{b / 2**20:.2f}M" if b >= 2**20 else f"{b / 1024:.1f}K"


def format_table(rows: list[dict]) -> str:
    def cell(r: dict, col: str) -> str:
        if col == "kernel":
            return "ERROR: " + r["error"][:120] if "error" in r else r.get("kernel", "")
        if col == "sqnr":
            v = r.get("sqnr_db")
            return "-" if v is None else ("inf" if math.isinf(v) else f"{v:.1f}")
        if col == "weight":
            return _fmt_bytes(r["weight_bytes"]) if "weight_bytes" in r else "-"
        if col == "spread":
            return f"{r['spread']:.0%}" if "spread" in r else "-"
        if col in ("speedup", "vs_best") and r.get(f"{col}_noisy"):
            return "noisy"
        v = r.get(col)
        if v is None:
            return "-"
        if col in ("ms", "min_ms"):
            return f"{v:.3f}"
        if col in ("speedup", "vs_best"):
            return f"{v:.3g}x"
        return str(v)

    table = [[c for c, _ in COLUMNS]] + [[cell(r, c) for c, _ in COLUMNS] for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(COLUMNS))]
    lines = []
    for j, t in enumerate(table):
        if j > 1 and (rows[j - 1]["shape"], rows[j - 1]["M"]) != (rows[j - 2]["shape"], rows[j - 2]["M"]):
            lines.append("")
        lines.append("  ".join(f"{s:{a}{w}}" for s, (_, a), w in zip(t, COLUMNS, widths)).rstrip())
    return "\n".join(lines)


def header() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"torch {torch.__version__} | threads {torch.get_num_threads()} | cpu capability {torch.backends.cpu.get_cpu_capability()} | "
            f"quantized engine {torch.backends.quantized.engine} | load avg {load:.1f} on {os.cpu_count()} cpus\n{torchq.native.status()}")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The options of ``torchq bench`` (``prog``: the name shown in usage lines)."""
    from .text import plain_text

    p = argparse.ArgumentParser(prog=prog, description=plain_text((__doc__ or "").split("\n\n")[0]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=None, help="comma-separated KxN (default 4096x4096; --quick: 256x512)")
    p.add_argument("--m", default=None, help="comma-separated batch sizes M (default 1,32; --quick: 1,8)")
    p.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated activation dtypes: fp32,bf16,fp16")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated configs (default {DEFAULT_CONFIGS})")
    p.add_argument("--budget", type=float, default=None, help="timed seconds per cell (default 0.5; --quick: 0.05)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds per input (default 5; --quick: 3)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls per cell (default 3; --quick: 1)")
    p.add_argument("--min-reps", type=int, default=None, help="timed calls per cell at least (default 10; --quick: 9)")
    p.add_argument("--max-reps", type=int, default=200, help="timed calls per cell at most (default 200)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--quick", action="store_true", help="small shapes, few reps (smoke test; timings indicative only)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    return p


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    p = build_parser(prog)
    a = p.parse_args(argv)
    a.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in (a.shapes or ("256x512" if a.quick else "4096x4096")).split(",")]
    a.m = [int(v) for v in (a.m or ("1,8" if a.quick else "1,32")).split(",")]
    a.dtypes = [d.strip() for d in a.dtypes.split(",")]
    a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    a.budget = a.budget if a.budget is not None else (0.05 if a.quick else 0.5)
    a.rounds = a.rounds if a.rounds is not None else (3 if a.quick else 5)
    a.min_reps = a.min_reps if a.min_reps is not None else (9 if a.quick else 10)
    a.warmup = min(a.warmup, 1) if a.quick else a.warmup
    if a.rounds < 1 or a.min_reps < 1:
        p.error(f"--rounds/--min-reps: expected at least 1, got {a.rounds}/{a.min_reps}")
    try:
        [DTYPES[d] for d in a.dtypes] + [torchq.config_from_name(c.removesuffix("@ref")) for c in a.configs if c not in ("float", "fbgemm", "bnb-nf4", "bnb-fp4")]
    except (KeyError, ValueError) as e:
        p.error(f"--dtypes/--configs: {e} (dtypes: {', '.join(DTYPES)})")
    return a


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the benchmark (``prog``: the command name in usage lines, e.g. ``torchq bench``)."""
    args = parse_args(argv, prog)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(header())
    if args.quick:
        print("quick: timings indicative only (small shapes, few calls); run without --quick to compare configs")
    if hasattr(os, "getloadavg") and os.getloadavg()[0] > 0.75 * (os.cpu_count() or 1):
        print("note: the machine is busy; timings will be noisy (try --threads 1, or rerun when idle)")
    t0 = time.perf_counter()
    rows: list[dict] = []
    for k, n in args.shapes:
        for d in args.dtypes:
            rows += run_shape_dtype(k, n, d, args)
    add_ratios(rows)
    order = {c: i for i, c in reversed(list(enumerate(["float", "float-fp32", *args.configs])))}
    rows.sort(key=lambda r: (args.shapes.index((r["K"], r["N"])), r["M"], args.dtypes.index(r["dtype"]), order.get(r["config"], 99)))
    print(format_table(rows))
    for r in rows:
        for w in r.get("warnings", []):
            print(f"note: {r['shape']} M={r['M']} {r['dtype']} {r['config']}: {w}")
    print(f"ms = median, min_ms = fastest call, spread = interquartile range / median ({args.rounds} interleaved rounds).\n"
          "speedup = float F.linear in the same dtype / ms; vs_best = fastest float path / ms (>1 = faster).\n"
          f"noisy = this or the float timing has a spread above {NOISY_SPREAD:.0%} or a median above {STALLED:g}x its fastest "
          f"call: no ratio shown. Total {time.perf_counter() - t0:.1f}s.")
    noisy = [r for r in rows if r.get("noisy")]
    if noisy:
        cells = ", ".join(f"{r['config']} (M={r['M']} {r['dtype']})" for r in noisy[:4]) + (", ..." if len(noisy) > 4 else "")
        print(f"note: {len(noisy)} of {len(rows)} timings are too noisy to rank configs: {cells};\n"
              "      rerun on an idle machine, with --threads 1 or a larger --budget")
    if args.json:
        clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
        with open(args.json, "w") as f:
            json.dump({"header": header(), "rows": clean}, f, indent=1)
        print(f"wrote {len(rows)} rows to {args.json}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
