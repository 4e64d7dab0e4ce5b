"""Where an eager quantized linear call spends its host time: each config's ``F.linear`` on a
bias-free ``nn.Linear(K, N)`` in bf16 (quantized with ``torchq.quantize_``), called ``--calls``
times under :mod:`cProfile` after warm-up, against bf16 ``F.linear`` the same way. Prints, per
config, the wall time per call (host and device; on CUDA the host usually bounds an eager M=1
call) and the functions with the most time of their own per call, so that the eager overhead
issue 36 names (a quantized call costing ~150 us more than bf16 on an H200) is attributed to
argument checks, dispatch, allocations or kernel launches.

    python benchmarks/profile_calls.py --json profile.json                # on a CUDA machine
    python benchmarks/profile_calls.py --device cpu --configs int4-g32,int8wo   # the CPU paths
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import torchq

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling bench_gpu, also when loaded by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import make_config  # noqa: E402

DEFAULT_CONFIGS = "bf16,tinygemm,triton-int4,triton-nf4,int8wo,triton-int8dq,fp8wo"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer(config: str, k: int, n: int, device: torch.device) -> nn.Linear:
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=device)
    if config != "bf16":
        torchq.quantize_(lin, make_config(config))
    return lin


def profile_config(config: str, k: int, n: int, m: int, calls: int, top: int, device: torch.device) -> dict:
    """``{config, us_per_call, functions: [{function, self_us, cum_us, calls_per_call}]}``."""
    lin = layer(config, k, n, device)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    for _ in range(10):  # compile the kernels, fill caches
        F.linear(x, lin.weight)
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        F.linear(x, lin.weight)
    sync(device)
    us = (time.perf_counter() - start) / calls * 1e6
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        F.linear(x, lin.weight)
    prof.disable()
    sync(device)
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():
        where = f"{Path(file).name}:{line}({name})" if line else name
        rows.append(dict(function=where, self_us=tottime / calls * 1e6, cum_us=cumtime / calls * 1e6, calls_per_call=ncalls / calls))
    rows.sort(key=lambda r: -r["self_us"])
    return dict(config=config, shape=f"{k}x{n}", M=m, us_per_call=us, functions=rows[:top])


def report(results: list[dict], top: int) -> str:
    base = next((r["us_per_call"] for r in results if r["config"] == "bf16"), None)
    lines = []
    for r in results:
        extra = f"  ({r['us_per_call'] - base:+.1f} us against bf16)" if base is not None and r["config"] != "bf16" else ""
        lines.append(f"## {r['config']} {r['shape']} M={r['M']}: {r['us_per_call']:.1f} us per call{extra}")
        lines.append(f"  {'self us':>8} {'cum us':>8} {'calls':>6}  function (profiled: cProfile slows Python ~2x)")
        for f in r["functions"][:top]:
            lines.append(f"  {f['self_us']:8.1f} {f['cum_us']:8.1f} {f['calls_per_call']:6.1f}  {f['function']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated: bf16, bench_gpu.py's names or config names")
    p.add_argument("--shape", default="4096x4096", help="KxN")
    p.add_argument("--m", type=int, default=1, help="activation rows")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("profile_calls: no CUDA device (--device cpu profiles the CPU paths)", file=sys.stderr)
        return 2
    k, n = (int(v) for v in args.shape.split("x"))
    results = []
    for config in args.configs.split(","):
        if config == "tinygemm" and device.type != "cuda":
            continue
        try:
            results.append(profile_config(config, k, n, args.m, args.calls, args.top, device))
        except Exception as e:  # a config this device cannot run: a line that says so
            print(f"## {config}: FAILED {type(e).__name__}: {str(e)[:200]}")
    print(report(results, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
