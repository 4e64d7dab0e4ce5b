"""Per-call cost of a decode-sized (M = 1) quantized linear next to float ``F.linear``, alone and in a model.

* ``layer``: one ``nn.Linear`` of SmolLM2-135M's shapes (576x576: attention; 576x1536: MLP), called
  in a loop, float vs each torchq config, in fp32 and bf16;
* ``model``: one decode step (one token, KV cache of ``--context`` tokens) of the SmolLM2-135M
  architecture (30 layers of 7 linears with RMSNorm, RoPE, attention and SiLU between them: PyTorch's
  own ops, on its intra-op threads, alternate with torchq's calls) with random weights and a
  2048-token vocabulary (so the float LM head does not dominate), float vs the same model quantized.

Everything runs under ``torch.inference_mode()`` (``--grad``: grad mode on, the biases requiring
grad as an ``nn.Linear``'s do: the autograd path), with ``torch.set_num_threads(t)`` for each ``t``
in ``--threads``. Configs are interleaved within every round; a cell is the median over
``--rounds`` rounds of the mean time per call, with the spread (min-max), and its ratio to float.
Timings on a shared machine are noisy: compare ratios, and repeat.

    python benchmarks/bench_percall.py                  # ~1-2 minutes on 2 cores
    python benchmarks/bench_percall.py --quick          # smoke run
    python benchmarks/bench_percall.py --what layer --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import torchq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's examples/ package
from examples import smollm

CONFIGS: dict[str, Callable[[], object]] = {
    "int4": lambda: torchq.int4_weight_only(group_size=128),
    "nf4": lambda: torchq.nf4_weight_only(),
    "int8wo": lambda: torchq.int8_weight_only(),
    "int8dq": lambda: torchq.int8_dynamic_activation_int8_weight(),
    "int8dq-r7": lambda: torchq.int8_dynamic_activation_int8_weight(reduce_range=True),
    "int4a8": lambda: torchq.int8_dynamic_activation_4bit_weight(),
    "nf4a8": lambda: torchq.int8_dynamic_activation_4bit_weight(weight="nf4"),
}
SHAPES = ((576, 576), (576, 1536))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _mean_us(fn: Callable[[], object], calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def _interleaved(fns: dict[str, Callable[[], object]], calls: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Per-call microseconds of each function, ``rounds`` samples each, the functions interleaved
    (their order rotated every round, so none always runs first)."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(_mean_us(fns[name], calls))
    return samples


def _quantized(module: nn.Module, config: str) -> nn.Module:
    q = copy.deepcopy(module)
    torchq.quantize_(q, CONFIGS[config](), filter_fn=lambda m, name: isinstance(m, nn.Linear) and "token_embd" not in name)
    return q


def _rows(kind: str, shape: str, dtype: str, threads: int, samples: dict[str, list[float]]) -> list[dict]:
    base = statistics.median(samples["float"])
    rows = []
    for name, s in samples.items():
        med = statistics.median(s)
        rows.append(dict(what=kind, shape=shape, dtype=dtype, threads=threads, config=name, median_us=med, min_us=min(s),
                         max_us=max(s), vs_float=med / base))
    return rows


def bench_layers(configs: list[str], dtypes: list[str], threads: list[int], args, grad_ctx) -> list[dict]:
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for k, n in SHAPES:
            torch.manual_seed(0)
            lin = nn.Linear(k, n).to(dtype)
            x = torch.randn(1, k, dtype=dtype)
            layers = {"float": lin} | {c: _quantized(nn.Sequential(lin), c)[0] for c in configs}
            fns = {name: (lambda m=m, x=x: m(x)) for name, m in layers.items()}
            for t in threads:
                torch.set_num_threads(t)
                with grad_ctx():
                    samples = _interleaved(fns, args.calls, args.rounds, warmup=50)
                rows += _rows("layer", f"{k}x{n}", dname, t, samples)
    return rows


def bench_model(configs: list[str], dtypes: list[str], threads: list[int], args, grad_ctx) -> list[dict]:
    arch = smollm.Arch(layers=args.layers, vocab=2048)
    rows = []
    for dname in dtypes:
        torch.manual_seed(0)
        base = smollm.SmolLM(arch).to(DTYPES[dname]).eval()
        models = {"float": base} | {c: _quantized(base, c) for c in configs}
        ids = torch.randint(0, arch.vocab, (1, args.context), generator=torch.Generator().manual_seed(0))
        step = ids[:, -1:]
        fns = {}
        for name, m in models.items():
            with torch.no_grad():  # (not inference_mode: --grad reads the cache in grad mode)
                cache: list = []
                m(ids, cache, 0)  # the KV cache of the context; every timed step reads it and is not appended
            frozen = list(cache)

            def decode(m=m, frozen=frozen, step=step) -> torch.Tensor:
                return m(step, list(frozen), args.context)

            fns[name] = decode
        for t in threads:
            torch.set_num_threads(t)
            with grad_ctx():
                samples = _interleaved(fns, args.steps, args.rounds, warmup=3)
            rows += _rows("model", f"{arch.layers} layers", dname, t, samples)
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("what", "shape", "dtype", "threads", "config", "us/call (median)", "spread (min-max)", "vs float")
    body = [(r["what"], r["shape"], r["dtype"], str(r["threads"]), r["config"], f"{r['median_us']:.1f}",
             f"{r['min_us']:.1f}-{r['max_us']:.1f}", f"{r['vs_float']:.2f}x") for r in rows]
    table = [head] + body
    widths = [max(len(x[i]) for x in table) for i in range(len(head))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(x, widths)).rstrip() for x in table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", default="layer,model", help="comma-separated: layer, model (default both)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, from fp32, bf16")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts (default 1,2)")
    p.add_argument("--rounds", type=int, default=7, help="samples per cell, configs interleaved (default 7)")
    p.add_argument("--calls", type=int, default=300, help="layer calls per sample (default 300)")
    p.add_argument("--steps", type=int, default=5, help="model decode steps per sample (default 5)")
    p.add_argument("--layers", type=int, default=30, help="model layers (default 30, SmolLM2-135M's)")
    p.add_argument("--context", type=int, default=32, help="tokens in the KV cache of a decode step (default 32)")
    p.add_argument("--grad", action="store_true", help="grad mode on (biases require grad) instead of inference_mode")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, few calls, a 2-layer model")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON to PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.calls, args.steps, args.layers = 2, 20, 2, 2
    what = [w.strip() for w in args.what.split(",") if w.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    for name, given, known in (("--what", what, ("layer", "model")), ("--configs", configs, CONFIGS), ("--dtypes", dtypes, DTYPES)):
        bad = [g for g in given if g not in known]
        if bad:
            p.error(f"{name}: unknown {bad}; expected some of {', '.join(known)}")
    if any(t < 1 for t in threads):
        p.error(f"--threads: expected positive integers, got {args.threads!r}")
    grad_ctx = torch.enable_grad if args.grad else torch.inference_mode
    rows: list[dict] = []
    if "layer" in what:
        rows += bench_layers(configs, dtypes, threads, args, grad_ctx)
    if "model" in what:
        rows += bench_model(configs, dtypes, threads, args, grad_ctx)
    status = torchq.native.status()
    print(f"M=1, {'grad mode' if args.grad else 'inference_mode'}, native {status.isa if status.available else 'unavailable'}, "
          f"{args.rounds} rounds per cell; median of per-round means, spread min-max (noisy on a shared machine)")
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
