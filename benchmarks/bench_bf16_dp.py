"""The bf16 dot-product GEMM of the native weight-only kernels (``csrc/bf16_dp_gemm.h``) on and off,
one linear layer, bf16 activations, per row count: on AVX512_BF16 CPUs without AMX it takes many
rows (the thresholds in ``bf16_dp_gemm.h``; on AMX CPUs at most 16, ``--all`` times its mode "all" there); off, the paths before it serve every call (the bf16
dot paths, table paths, dequantized tiles + ``torch.mm``). bf16 ``F.linear`` on the float weight is
the baseline. Each cell is microseconds per call; the modes alternate within each round (this VM's
speed drifts over minutes, so only interleaved timings compare) and each keeps its best round. A
``*`` marks the cells whose calls took the GEMM.

    python benchmarks/bench_bf16_dp.py --rows 1,2,8,16,32,256 --threads 1 --json dp.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import torchq
from torchq.backends.native_cpu import library
from torchq.configs import config_from_name
from torchq.layouts.int8_vnni import Int8VnniLayout

#: formats: a config name, or int8 weight-only in panel order (the vLLM plugin's layout on VNNI CPUs)
FORMATS = ("nf4", "int4-g32", "int8wo", "int8wo-panels")


def _layer(fmt: str, n: int, k: int, lin: torch.nn.Linear) -> torch.nn.Linear:
    model = torch.nn.Sequential(torch.nn.Linear(k, n, dtype=torch.bfloat16))
    model.load_state_dict(torch.nn.Sequential(lin).state_dict())
    cfg = torchq.int8_weight_only(layout=Int8VnniLayout()) if fmt == "int8wo-panels" else config_from_name(fmt)
    torchq.quantize_(model, cfg)
    return model[0]


def _best_us(fn, reps: int, rounds: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="3072x576", help="NxK: out_features x in_features (SmolLM2's MLP up)")
    ap.add_argument("--rows", default="1,2,8,16,32,64,256", help="comma-separated activation rows (M)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each cell keeps its best")
    ap.add_argument("--all", action="store_true", help='"on" is its mode "all": every row count on AMX CPUs too')
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if library.loaded() is None:
        print("the native library is not built: nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split("x"))
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, dtype=torch.bfloat16)
    formats = args.formats.split(",")
    layers = {fmt: _layer(fmt, n, k, lin) for fmt in formats}
    results = []
    print(f"{n}x{k}, bf16, {args.threads} thread(s); us per call, off -> on (* the GEMM ran), ratio off/on")
    print(f"{'rows':>5} {'bf16':>8} " + " ".join(f"{fmt:>26}" for fmt in formats))
    for m in (int(v) for v in args.rows.split(",")):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        reps = max(2, 2000 // (m + 50))
        cell = {"rows": m, "bf16": float("inf")}
        took = {}
        for _ in range(args.rounds):
            cell["bf16"] = min(cell["bf16"], _best_us(lambda x=x: F.linear(x, lin.weight, lin.bias), reps, 1))
            for fmt, layer in layers.items():
                for mode in ("off", "on"):
                    with library.bf16_dp_gemm("all" if args.all and mode == "on" else mode):
                        before = library.bf16_dp_gemm_calls()
                        us = _best_us(lambda x=x, layer=layer: F.linear(x, layer.weight, layer.bias), reps, 1)
                        took[(fmt, mode)] = library.bf16_dp_gemm_calls() > before
                    key = f"{fmt}/{mode}"
                    cell[key] = min(cell.get(key, float("inf")), us)
        for fmt in formats:
            cell[f"{fmt}/gemm_ran"] = took[(fmt, "on")]
        results.append(cell)
        cols = []
        for fmt in formats:
            off, on = cell[f"{fmt}/off"], cell[f"{fmt}/on"]
            cols.append(f"{off:7.0f} -> {on:7.0f}{'*' if took[(fmt, 'on')] else ' '} {off / on:4.2f}x")
        print(f"{m:5d} {cell['bf16']:8.0f} " + " ".join(f"{c:>26}" for c in cols), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": [n, k], "threads": args.threads, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
