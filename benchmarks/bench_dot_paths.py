"""The native kernel's bf16 dot paths against the paths they replace, one layer at a time, in one
process: NF4 (plain and double-quantized absmax, blocks of 64) through the scaled dot path's table
kind, and int4 with fp32 scales through its scaled kind, each with the path on and off (the table
or lookup path then serves the call), against bf16 ``F.linear`` on the dequantized weight. SmolLM2's
shapes, bf16 activations, 1-4 rows (5 and more go to the bf16 AMX or dot-product GEMM where the CPU
has one, which this script switches off so that the dot paths' own rows are timed as the kernel
serves them without). The candidates alternate within each round (a VM's speed drifts) and each
keeps its best round; the table prints microseconds per call and the path's speed-up
(``off / on``, above 1: the path is faster), which decides the switch's default on this CPU
(``csrc/lut4_linear.cpp``: the table kind's ``g_table_dot``).

    python benchmarks/bench_dot_paths.py --threads 1 --rows 1,2,4 --json dot_paths.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import sys
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

import torchq
from torchq import native
from torchq.backends.native_cpu import library

#: (out_features, in_features) of SmolLM2-135M's linears: gate+up fused, down, qkv fused, o
SHAPES = ((3072, 576), (576, 1536), (960, 576), (576, 576))
CONFIGS = {  # name -> (config, the path's switch: a context manager taking "on" / "off")
    "nf4": (lambda: torchq.nf4_weight_only(), lambda mode: _table_kind(mode)),
    "nf4-plain-absmax": (lambda: torchq.nf4_weight_only(double_quant=False), lambda mode: _table_kind(mode)),
    "int4-g32-fp32": (lambda: torchq.int4_weight_only(group_size=32, scale_dtype=torch.float32), library.lut4_scaled_dot),
    "int4-g128-fp32": (lambda: torchq.int4_weight_only(group_size=128, scale_dtype=torch.float32), library.lut4_scaled_dot),
}


@contextlib.contextmanager
def _table_kind(mode: str) -> Iterator[None]:
    """The scaled dot path on and its table kind (NF4 / FP4) ``mode``."""
    with library.lut4_scaled_dot("on"), library.lut4_table_dot(mode):
        yield


def _best_us(fn, budget_s: float) -> float:
    """Microseconds per call: the best of 3 runs of as many calls as fill budget_s / 3 each."""
    fn()
    t0 = time.perf_counter()
    fn()
    reps = max(10, int(budget_s / 3 / max(time.perf_counter() - t0, 1e-7)))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def run(args: argparse.Namespace) -> list[dict]:
    rows_out = []
    for name in args.configs.split(","):
        config, switch = CONFIGS[name]
        for n, k in args.shapes:
            torch.manual_seed(n + k)
            lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
            torchq.quantize_(lin, config())
            dense = lin.weight.dequantize().to(torch.bfloat16)
            for m in args.rows:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                best = {"on": float("inf"), "off": float("inf"), "F.linear": float("inf")}
                for _ in range(args.rounds):
                    for mode in ("on", "off"):
                        with switch(mode), torch.no_grad():
                            best[mode] = min(best[mode], _best_us(functools.partial(lin, x), args.budget))
                    best["F.linear"] = min(best["F.linear"], _best_us(functools.partial(F.linear, x, dense), args.budget))
                with switch("on"), torch.no_grad():
                    before = library.lut4_scaled_dot_calls()
                    lin(x)
                    took = library.lut4_scaled_dot_calls() - before == 1
                rows_out.append(dict(config=name, n=n, k=k, rows=m, on_us=best["on"], off_us=best["off"], flinear_us=best["F.linear"],
                                     path_ran=took))
    return rows_out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4])
    p.add_argument("--shapes", type=lambda s: [tuple(int(v) for v in shape.split("x")) for shape in s.split(",")], default=list(SHAPES),
                   help="comma-separated NxK (default: SmolLM2's)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.3, help="seconds per timing (3 runs)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    for name in args.configs.split(","):
        if name not in CONFIGS:
            p.error(f"--configs: expected names of {', '.join(CONFIGS)}, got {name!r}")
    st = native.status()
    if not st.available:
        print(f"the native library is not active: {st.reason}", file=sys.stderr)
        return 1
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with library.bf16_amx("off"), library.bf16_dp_gemm("off"):
            rows = run(args)
    finally:
        torch.set_num_threads(saved_threads)
    print(f"{st}; {platform.processor() or platform.machine()}, {args.threads} thread(s); best of {args.rounds} alternating rounds")
    print("| config | N × K | rows | path on µs | off µs | on / off speed-up | bf16 F.linear µs | × F.linear | path ran |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['n']} × {r['k']} | {r['rows']} | {r['on_us']:.1f} | {r['off_us']:.1f} | {r['off_us'] / r['on_us']:.2f}× | "
              f"{r['flinear_us']:.1f} | {r['flinear_us'] / r['on_us']:.2f}× | {'yes' if r['path_ran'] else 'no'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(status=str(st), threads=args.threads, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
