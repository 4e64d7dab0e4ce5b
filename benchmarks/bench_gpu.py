"""GPU linear kernels: bf16 ``F.linear`` (cuBLAS) vs PyTorch's ``_weight_int4pack_mm`` (tinygemm,
``TensorCoreTiledLayout``) vs torchq's Triton kernels, on Llama-style weight shapes.

Every case is a bias-free ``nn.Linear(K, N)`` in bf16 (fixed seed), quantized with
``torchq.quantize_`` and timed with CUDA events (median over repetitions after warm-up, the
configs of a row interleaved so clock drift hits them alike). Columns:

* ``us``: median time per call, host overhead included (eager use); ``vs_bf16``: bf16
  ``F.linear`` time / this (>1 = faster); ``vs_best``: the fastest other config of the row / this;
* ``gpu_us``: device time per call, the call replayed from a CUDA graph (no host overhead: what
  a captured or compiled model pays); ``gpu_vs_bf16`` likewise;
* ``hbm%`` (M=1 only): bytes the call must read (weight + scales + activations) / time (the
  device time ``gpu_us`` where the call could be captured), as a
  fraction of the device's peak HBM bandwidth (``--hbm-tbs``, default: the H100 SXM 3.35 TB/s,
  the H200 4.8 TB/s, else measured with a device-to-device copy);
* ``sqnr``: output vs the bf16 float layer, dB; ``kernel``: what ``torchq.explain`` reports.

Configs: ``bf16`` (cuBLAS), ``tinygemm`` (int4 g128, TensorCoreTiledLayout), ``triton-int4``
(int4 g128, Int4NativeLayout on Triton), ``triton-nf4`` (NF4 block 64), ``triton-int8dq``
(per-token int8 x int8), and any config name of :func:`torchq.config_from_name` (``int8wo``,
``int4a8-g32``, ``fp8dq-row``, ``fp8dq-tensor``, ``fp8wo``...). Target (issue 6): int4 at M=1 >= 3x faster than bf16 on 8192x8192 and
8192x28672, and no slower than bf16 at M=128.

    python benchmarks/bench_gpu.py                                   # default shapes, M in 1,16,128,1024
    python benchmarks/bench_gpu.py --shapes 8192x8192 --m 1 --json gpu.json
    TRITON_INTERPRET=1 python benchmarks/bench_gpu.py --device cpu --shapes 64x128 --m 1,20   # smoke test, no GPU

On ``--device cpu`` (only with ``TRITON_INTERPRET=1``) the Triton configs run in triton's
interpreter: the table checks the script, not the speed; tinygemm is skipped there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import torch
from torch import nn

import torchq
from torchq.layouts import Int4NativeLayout
from torchq.layouts.tensor_core_tiled import TensorCoreTiledLayout

DEFAULT_SHAPES = "4096x4096,4096x14336,8192x8192,8192x28672,28672x8192"  # KxN (Llama 3 8B / 70B projections)
DEFAULT_CONFIGS = "bf16,tinygemm,triton-int4,triton-nf4,triton-int8dq,int8wo,fp8dq-row,fp8wo"
PEAK_HBM_TBS = {"H100": 3.35, "H200": 4.8, "A100": 2.0}
COLUMNS = [("shape", "<"), ("M", ">"), ("config", "<"), ("us", ">"), ("vs_bf16", ">"), ("vs_best", ">"), ("gpu_us", ">"),
           ("gpu_vs_bf16", ">"), ("hbm%", ">"), ("sqnr", ">"), ("kernel", "<")]


def make_config(name: str):
    named = {
        "tinygemm": lambda: torchq.Int4WeightOnlyConfig(group_size=128, layout=TensorCoreTiledLayout()),
        "triton-int4": lambda: torchq.Int4WeightOnlyConfig(group_size=128, layout=Int4NativeLayout()),
        "triton-nf4": lambda: torchq.nf4_weight_only(block_size=64),
        "triton-int8dq": torchq.int8_dynamic_activation_int8_weight,
    }
    return named[name]() if name in named else torchq.config_from_name(name)


def peak_hbm_tbs(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tbs in PEAK_HBM_TBS.items():
        if key in name:
            return tbs
    buf = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB copy: read + write
    out = torch.empty_like(buf)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out.copy_(buf)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * buf.numel() / min(times) / 1e12


def graph_time(fn, reps: int) -> float | None:
    """Device time per call in microseconds, host overhead excluded: ``fn`` captured once in a
    CUDA graph and replayed ``reps`` times (best of 3). None (with the reason on stderr) when the
    call cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # e.g. a host synchronization inside the call
        print(f"# CUDA graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", file=sys.stderr)
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


def time_call(fn, device: torch.device, reps: int) -> list[float]:
    """Per-call times in microseconds."""
    if device.type == "cuda":
        start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            start[i].record()
            fn()
            end[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(start, end)]
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return out


def interpreter_call(name: str, lin: nn.Module):
    """On the CPU (smoke runs) dispatch picks the native kernels: call the Triton function the
    CUDA dispatch would reach, directly, in the interpreter."""
    from torchq.backends.triton import dequant_linear, int8_linear, int8_weight

    w = lin.weight
    impl = w.tensor_impl
    n, k = impl.shape
    if name == "triton-int4":
        args = (impl.packed, impl.scale, impl.shift, impl.zero, [n, k], impl.group_size, impl.code_base, *impl.round_kinds)
        return lambda x: dequant_linear.int4_groupwise_linear(x, *args)
    if name == "triton-nf4":
        spec = impl.spec
        args = (impl.packed, impl.absmax, impl.nested_codes, impl.nested_absmax, impl.nested_offset, [n, k], spec.block_size[1],
                spec.codebook)
        return lambda x: dequant_linear.blockwise_4bit_linear(x, *args)
    act = w.act_quant
    if isinstance(act, torchq.Float8Activations):  # CUDA: torch._scaled_mm (torch's CPU kernel here)
        from torchq.backends.aten import float8_dynamic_linear_scaled_mm

        return lambda x: float8_dynamic_linear_scaled_mm(x, impl.codes, impl.scale, act.granularity)
    if act is None:  # weight-only one-byte codes: int8 or float8_e4m3fn
        fn = int8_weight.float8_weight_linear if impl.codes.dtype == torch.float8_e4m3fn else int8_weight.int8_weight_linear
        return lambda x: fn(x, impl.codes, impl.scale)
    return lambda x: int8_linear.int8_dynamic_linear(x, impl.codes, impl.scale, act.quant_min, act.quant_max, act.eps)


def weight_bytes(lin: nn.Module) -> int:
    w = lin.weight
    return w.nbytes_quantized() if isinstance(w, torchq.AffineQuantizedTensor) else w.numel() * w.element_size()


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    err = (ref - out).norm()
    return float("inf") if err == 0 else float(20 * torch.log10(ref.norm() / err))


def run_shape(k: int, n: int, ms: list[int], configs: list[str], device: torch.device, args) -> list[dict]:
    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=False).to(torch.bfloat16).to(device).eval()
    layers: dict[str, nn.Module] = {}
    for name in configs:
        if name == "bf16":
            layers[name] = base
            continue
        if name == "tinygemm" and device.type != "cuda":
            continue
        lin = nn.Linear(k, n, bias=False).to(torch.bfloat16).to(device)
        lin.load_state_dict(base.state_dict())
        try:
            torchq.quantize_(lin, make_config(name))
        except Exception as e:  # a config this device cannot hold: say so in the table
            print(f"# {name} {k}x{n}: {e}", file=sys.stderr)
            continue
        layers[name] = lin
    rows = []
    hbm = peak_hbm_tbs(device, args.hbm_tbs)
    calls = {name: lin if device.type == "cuda" or name == "bf16" else interpreter_call(name, lin) for name, lin in layers.items()}
    for m in ms:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        with torch.inference_mode():
            ref = base(x)
            kernels, outs, failed = {}, {}, {}
            for name, lin in layers.items():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        outs[name] = calls[name](x)
                    except Exception as e:  # a kernel that fails at this shape: a row that says so, the others still run
                        failed[name] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                        print(f"# {name} {k}x{n} M={m}: {failed[name]}", file=sys.stderr)
                        continue
                    report = torchq.explain(lin, x) if name != "bf16" and device.type == "cuda" else None
                if name == "bf16":
                    kernels[name] = "cuBLAS F.linear" if device.type == "cuda" else "F.linear"
                else:
                    kernels[name] = "triton interpreter (direct call)" if report is None else "; ".join(sorted(set(report.kernels().values())))
                for _ in range(args.warmup):
                    calls[name](x)
            gpu_us = {name: graph_time(lambda fn=calls[name], x=x: fn(x), args.reps) if device.type == "cuda" else None
                      for name in layers if name not in failed}
            times: dict[str, list[float]] = {name: [] for name in layers if name not in failed}
            for _ in range(args.rounds):
                for name in times:
                    times[name] += time_call(lambda fn=calls[name], x=x: fn(x), device, args.reps)
        for name, lin in layers.items():
            if name in failed:
                rows.append(dict(shape=f"{k}x{n}", M=m, config=name, us=None, sqnr=None, kernel=failed[name], hbm_pct=None))
                continue
            us = statistics.median(times[name])
            moved = weight_bytes(lin) + 2 * m * (k + n)
            rows.append(dict(shape=f"{k}x{n}", M=m, config=name, us=us, gpu_us=gpu_us[name], sqnr=sqnr_db(ref, outs[name]),
                             kernel=kernels[name],
                             hbm_pct=(100 * moved / ((gpu_us[name] or us) * 1e-6) / (hbm * 1e12)) if (hbm and m == 1) else None))
    return rows


def add_ratios(rows: list[dict]) -> None:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["M"]), []).append(r)
    for group in groups.values():
        bf16 = next((r["us"] for r in group if r["config"] == "bf16"), None)
        for r in group:
            others = [o["us"] for o in group if o is not r and o["us"] is not None]
            r["vs_bf16"] = None if bf16 is None or r["us"] is None else bf16 / r["us"]
            r["vs_best"] = min(others) / r["us"] if others and r["us"] is not None else None
            gpu_bf16 = next((o.get("gpu_us") for o in group if o["config"] == "bf16"), None)
            r["gpu_vs_bf16"] = gpu_bf16 / r["gpu_us"] if gpu_bf16 and r.get("gpu_us") else None


def format_table(rows: list[dict]) -> str:
    def cell(r, key):
        v = r.get("hbm_pct" if key == "hbm%" else key)
        if v is None:
            return "-"
        if key in ("us", "gpu_us"):
            return f"{v:.1f}"
        if key in ("vs_bf16", "vs_best", "gpu_vs_bf16"):
            return f"{v:.2f}x"
        if key in ("hbm%", "sqnr"):
            return f"{v:.1f}"
        return str(v)

    table = [[name for name, _ in COLUMNS]] + [[cell(r, name) for name, _ in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    lines = []
    for row in table:
        lines.append("  ".join(f"{v:{align}{w}}" for v, (_, align), w in zip(row, COLUMNS, widths)))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated KxN weight shapes")
    p.add_argument("--m", default="1,16,128,1024", help="comma-separated activation rows")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=20, help="timed calls per config and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--hbm-tbs", type=float, default=None, help="peak HBM bandwidth in TB/s for hbm%%")
    p.add_argument("--json", default=None, help="also write the rows here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (use --device cpu with TRITON_INTERPRET=1 for a smoke run)", file=sys.stderr)
        return 2
    if device.type == "cpu" and not torchq.backends.triton.interpreting():
        print("bench_gpu: --device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    ms = [int(v) for v in args.m.split(",") if v]
    configs = [c for c in args.configs.split(",") if c]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (triton interpreter)"
    print(f"# device: {name}; torch {torch.__version__}; triton {__import__('triton').__version__}")
    rows = []
    for k, n in shapes:
        shape_rows = run_shape(k, n, ms, configs, device, args)
        add_ratios(shape_rows)
        print(format_table(shape_rows), flush=True)  # as each shape finishes: a run cut short still reports
        rows += shape_rows
    print("# all shapes")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
