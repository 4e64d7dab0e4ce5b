"""torchq end to end: quantize a small MLP with every built-in config and show what changed.

    python -m torchq.demo               # bf16 MLP 2048 -> 4096 -> 2048 -> 512, ~30-60 s on 2 CPU cores
    python -m torchq.demo --quick       # a smaller MLP
    python -m torchq.demo --no-compile  # skip the torch.compile check

A fixed-seed bf16 MLP (Linear -> GELU -> Linear -> GELU -> Linear) and a fixed random input
are built; for each config a deep copy is quantized with ``torchq.quantize_`` and measured:

* weight memory of the linear weights before/after (``nbytes_quantized()``), and the ratio;
* latency at M=1 and M=32 rows: median of repeated ``torch.inference_mode()`` forwards after
  warm-up (``time.perf_counter``), and the speed-up over the bf16 model (fp32 shown for reference);
* output error against the bf16 model at M=32: SQNR in dB and the max absolute error;
* the kernel each layer runs, from ``torchq.explain`` (``FALLBACK`` = dequantize + F.linear).

Then the full ``torchq.explain`` report for the int4 model is printed, and ``torch.compile(model,
fullgraph=True)`` is run on it and checked against eager mode (unless ``--no-compile``).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time
import warnings

import torch
from torch import nn

import torchq

CONFIGS: list[tuple[str, torchq.QuantConfig]] = [
    ("int8 weight-only", torchq.int8_weight_only()),
    ("int8 dyn-act+weight", torchq.int8_dynamic_activation_int8_weight()),
    ("int4 g128", torchq.int4_weight_only(group_size=128)),
    ("int4 g32", torchq.int4_weight_only(group_size=32)),
    ("intx 3-bit g32", torchq.intx_weight_only(bits=3, group_size=32)),
    ("nf4 (QLoRA)", torchq.nf4_weight_only()),
]
COMPILE_CONFIG = "int4 g128"


def build_model(dims: tuple[int, ...], seed: int = 0) -> nn.Sequential:
    """Linear -> GELU -> ... -> Linear over ``dims``, initialised in fp32 with ``seed``, cast to bf16."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers += [nn.Linear(a, b)] + ([nn.GELU()] if i < len(dims) - 2 else [])
    return nn.Sequential(*layers).to(torch.bfloat16).eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the linear weights (quantized ones count their codes, scales and zeros)."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            w = mod.weight
            total += w.nbytes_quantized() if isinstance(w, torchq.AffineQuantizedTensor) else w.numel() * w.element_size()
    return total


def median_ms(model: nn.Module, x: torch.Tensor, budget_s: float, warmup: int = 2, min_reps: int = 3) -> float:
    """Median forward latency: ``warmup`` calls, then timed calls until ``budget_s`` (>= min_reps)."""
    with torch.inference_mode():
        for _ in range(warmup):
            model(x)
        times: list[float] = []
        deadline = time.perf_counter() + budget_s
        while len(times) < min_reps or (time.perf_counter() < deadline and len(times) < 200):
            t0 = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def errors(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """(SQNR dB, max abs error) of ``out`` against ``ref``, computed in fp64."""
    ref, out = ref.double(), out.double()
    err = (ref - out).pow(2).sum().item()
    sqnr = math.inf if err == 0 else 10 * math.log10(ref.pow(2).sum().item() / err)
    return sqnr, (ref - out).abs().max().item()


def kernels_of(model: nn.Module, x: torch.Tensor) -> str:
    """'int4_cpu' when every layer runs the same kernel, else 'layer: kernel' pairs."""
    ks = torchq.explain(model, x).kernels()
    return next(iter(ks.values())) if len(set(ks.values())) == 1 else ", ".join(f"{k}: {v}" for k, v in ks.items())


def measure(name: str, model: nn.Module, xs: dict[int, torch.Tensor], ref: torch.Tensor, budget: float) -> dict:
    x = xs[max(xs)]
    with torch.inference_mode():
        out = model(x.to(next(model.parameters()).dtype)).to(ref.dtype)
    sqnr, maxerr = errors(ref, out)
    quantized = any(isinstance(p, torchq.AffineQuantizedTensor) for p in model.parameters())
    row = {"name": name, "bytes": weight_bytes(model), "sqnr": sqnr, "maxerr": maxerr}
    row["kernel"] = kernels_of(model, x) if quantized else "F.linear (aten)"
    dtype = next(model.parameters()).dtype
    row["ms"] = {m: median_ms(model, xm.to(dtype), budget) for m, xm in xs.items()}
    return row


def format_table(rows: list[dict], base: dict) -> str:
    ms = sorted(base["ms"])
    head = ["model", "quantize s", "weights MiB", "ratio"] + [f"M={m} ms (speed-up)" for m in ms] + ["SQNR dB", "max|err|", "kernel"]
    table = [head]
    for r in rows:
        lat = [f"{r['ms'][m]:.2f} ({base['ms'][m] / r['ms'][m]:.2f}x)" for m in ms]
        sq = "inf" if math.isinf(r["sqnr"]) else f"{r['sqnr']:.1f}"
        qs = f"{r['quant_s']:.2f}" if "quant_s" in r else "-"
        table.append([r["name"], qs, f"{r['bytes'] / 2**20:.2f}", f"{base['bytes'] / r['bytes']:.2f}x", *lat, sq, f"{r['maxerr']:.3g}", r["kernel"]])
    widths = [max(len(t[i]) for t in table) for i in range(len(head))]
    right = set(range(1, len(head) - 1))
    return "\n".join(
        "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(t, widths))).rstrip() for t in table
    )


def check_compile(model: nn.Module, x: torch.Tensor) -> bool:
    """torch.compile(model, fullgraph=True) runs and matches eager within bf16 tolerance."""
    t0 = time.perf_counter()
    compiled = torch.compile(model, fullgraph=True)
    with torch.inference_mode():
        got, want = compiled(x), model(x)
    secs = time.perf_counter() - t0
    diff = (got.float() - want.float()).abs().max().item()
    ok = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())
    print(f"torch.compile(fullgraph=True) on the {COMPILE_CONFIG} model: compiled + ran in {secs:.1f}s, "
          f"max |compiled - eager| = {diff:.3g} -> {'OK' if ok else 'MISMATCH'}")
    if ok:
        print(f"  compiled latency at M={x.shape[0]}: {median_ms(compiled, x, 0.5):.2f} ms (eager {median_ms(model, x, 0.5):.2f} ms)")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchq.demo", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller model and shorter timing (smoke test)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile check")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    dims = (512, 1024, 512, 128) if args.quick else (2048, 4096, 2048, 512)
    budget = 0.1 if args.quick else 0.4
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    print(f"torchq {torchq.__version__} | torch {torch.__version__} | threads {torch.get_num_threads()} | "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()} | load avg {load:.1f} on {os.cpu_count()} cpus")
    if load > (os.cpu_count() or 1) * 0.75:
        print("note: the machine is busy; latencies below will be noisy")
    model = build_model(dims)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: bf16 MLP {' -> '.join(map(str, dims))} with GELU, {n_params / 1e6:.1f}M parameters; input: randn, seed 1\n")
    gen = torch.Generator().manual_seed(1)
    x32 = torch.randn(32, dims[0], generator=gen).to(torch.bfloat16)
    xs = {1: x32[:1].clone(), 32: x32}
    with torch.inference_mode():
        ref = model(x32)

    base = measure("bf16 (float)", model, xs, ref, budget)
    rows = [base, measure("fp32 (reference)", copy.deepcopy(model).float(), xs, ref, budget)]
    quantized: dict[str, nn.Module] = {}
    notes: list[str] = []
    for _, cfg in CONFIGS:  # warm-up, so the 'quantize s' column does not include one-time setup
        torchq.quantize_(build_model((256, 256)), cfg)
    for name, cfg in CONFIGS:
        q = copy.deepcopy(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            torchq.quantize_(q, cfg)
            t_quant = time.perf_counter() - t0
            rows.append(measure(name, q, xs, ref, budget))
        rows[-1]["quant_s"] = t_quant
        notes += [f"{name}: {w.message}" for w in caught]
        quantized[name] = q

    print("Each config: torchq.quantize_(deep copy, config). Speed-up and memory ratio are vs the bf16 model;")
    print("errors are vs the bf16 model's output at M=32.\n")
    print(format_table(rows, base))
    for note in dict.fromkeys(notes):
        print(f"note: {note}")

    print(f"\ntorchq.explain(model, x) for the {COMPILE_CONFIG} model (which kernel each layer runs and why the others do not):")
    print(torchq.explain(quantized[COMPILE_CONFIG], x32))
    q_rows = rows[2:]
    fastest = min(q_rows, key=lambda r: r["ms"][1])
    print(f"\nsummary: smallest = {min(q_rows, key=lambda r: r['bytes'])['name']}; "
          f"fastest at M=1 = {fastest['name']} ({base['ms'][1] / fastest['ms'][1]:.2f}x bf16); "
          f"most accurate = {max(q_rows, key=lambda r: r['sqnr'])['name']}")

    ok = True
    if not args.no_compile:
        print()
        ok = check_compile(quantized[COMPILE_CONFIG], x32)
    print(f"\ndone in {time.perf_counter() - t_start:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
