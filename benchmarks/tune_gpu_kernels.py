"""Launch parameters of torchq's 4-bit Triton kernels, measured: the streaming GEMV
(:mod:`torchq.backends.triton.stream_gemv`, M <= 4) and the tensor-core kernel
(``dequant_linear._dot_kernel``, M up to ``DOT_MAX_M``), each candidate against bf16 cuBLAS
``F.linear`` and the path it replaces (the one-row split-K GEMV; dequantize + cuBLAS) in the same run.

Times are device times per call: the call captured once in a CUDA graph and replayed (best of 3 x
``--reps``), so host overhead is excluded. ``vs_bf16`` = bf16 time / this; ``hbm%`` = bytes the
call must read (weight, scales, activations) / time / peak HBM bandwidth. ``sqnr`` checks every
candidate's output against the float layer on the dequantized weight (dB).

    python benchmarks/tune_gpu_kernels.py --json tune.json                 # on a CUDA machine
    TRITON_INTERPRET=1 python benchmarks/tune_gpu_kernels.py --device cpu --shapes 256x256 --quick   # smoke run
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
from torchq.layouts import Int4NativeLayout

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling bench_gpu, also when loaded by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import graph_time  # noqa: E402

STREAM_CANDIDATES = [  # block_n, block_kw, num_warps
    (128, 16, 4), (256, 16, 4), (128, 32, 4), (64, 16, 4), (256, 8, 4), (128, 16, 2),
]
STREAM_PPS = (8, 32)
STREAM_DECODES = (0, 1, 2)  # int4 only (NF4 looks its codes up)
DOT_CANDIDATES = [  # block_m, block_n, block_kw, num_warps, num_stages
    (16, 64, 16, 4, 3), (16, 128, 16, 4, 3), (16, 64, 32, 4, 3), (32, 64, 16, 4, 3), (64, 64, 16, 4, 3),
    (64, 128, 16, 8, 3), (16, 128, 32, 8, 2),
]
DOT_PPS = (2, 8)
FACTORED_CANDIDATES = [  # block_m, block_n, block_k, num_warps, num_stages, programs_per_sm, decode (int4 only)
    (16, 64, 128, 4, 3, 4, 0), (16, 64, 128, 4, 3, 4, 1), (16, 128, 128, 4, 4, 2, 1), (16, 256, 64, 8, 3, 2, 1),
    (64, 128, 128, 4, 3, 2, 1), (64, 128, 64, 8, 4, 1, 1), (128, 128, 64, 8, 3, 1, 1), (64, 256, 64, 8, 3, 1, 0),
]
PEAK_HBM_TBS = {"H100": 3.35, "H200": 4.8}


def device_time_us(fn, device: torch.device, reps: int) -> float:
    """Device time per call (``bench_gpu.graph_time``: captured in a CUDA graph, best of 3 x ``reps``
    replays); on the CPU (interpreter smoke runs) one call's wall time."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    fn()
    us = graph_time(fn, reps)
    if us is None:
        raise RuntimeError("the call could not be captured in a CUDA graph")
    return us


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    err = (ref.double() - out.double()).norm()
    return float("inf") if err == 0 else float(20 * torch.log10(ref.double().norm() / err))


def weights(k: int, n: int, device: torch.device) -> dict:
    """bf16 weight and its int4 g128 / NF4 b64 forms: (call(x), bytes read, float weight)."""
    torch.manual_seed(0)
    w = (torch.randn(n, k, dtype=torch.bfloat16) * 0.02).to(device)
    from torchq.backends.triton import dequant_linear as dl

    out = {}
    impl = torchq.Int4WeightOnlyConfig(group_size=128, layout=Int4NativeLayout()).quantize_weight(w).tensor_impl
    args = (impl.packed, impl.scale, impl.shift, impl.zero, [n, k], impl.group_size, impl.code_base, *impl.round_kinds)
    out["int4-g128"] = (lambda x, a=args: dl.int4_groupwise_linear(x, *a), impl.packed.nbytes + 4 * impl.scale.numel() * 2,
                        impl.dequantize(torch.bfloat16))
    nf = torchq.nf4_weight_only(block_size=64).quantize_weight(w).tensor_impl
    spec = nf.spec
    nargs = (nf.packed, nf.absmax, nf.nested_codes, nf.nested_absmax, nf.nested_offset, [n, k], spec.block_size[1], spec.codebook)
    scales = 4 * nf.absmax.numel() if nf.absmax is not None else nf.nested_codes.numel()
    out["nf4-b64"] = (lambda x, a=nargs: dl.blockwise_4bit_linear(x, *a), nf.packed.nbytes + scales, nf.dequantize(torch.bfloat16))
    out["bf16"] = (lambda x, w=w: F.linear(x, w), w.nbytes, w)
    return out


def measure(case: dict, kind: str, fmt: str, label: str, fn) -> dict:
    """One candidate's row (printed as it comes)."""
    shape, m, base = case["shape"], case["m"], case["base"]
    try:
        us = device_time_us(fn, case["device"], case["reps"])
        q = sqnr_db(case["refs"][fmt], fn().float())
    except Exception as e:  # a candidate that does not compile or launch: a row that says so
        print(f"{shape:>11} M={m:<4} {kind:<8} {fmt:<9} {label:<28} FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
        return dict(shape=shape, M=m, kernel=kind, format=fmt, params=label, error=f"{type(e).__name__}: {e}"[:200])
    moved = case["ws"][fmt][1] + 2 * m * (case["k"] + case["n"])
    hbm = case["hbm"]
    row = dict(shape=shape, M=m, kernel=kind, format=fmt, params=label, us=us, bf16_us=base, vs_bf16=base / us,
               hbm_pct=100 * moved / (us * 1e-6) / (hbm * 1e12) if hbm else None, sqnr=q)
    hb = f"{row['hbm_pct']:5.1f}%" if hbm else "-"
    print(f"{shape:>11} M={m:<4} {kind:<8} {fmt:<9} {label:<28} {us:9.1f} us  bf16 {base:8.1f}  {base / us:5.2f}x  hbm {hb}  "
          f"sqnr {q:5.1f}", flush=True)
    return row


def run(args) -> list[dict]:
    from torchq.backends.triton import dequant_linear as dl
    from torchq.backends.triton import stream_gemv as sg

    device = torch.device(args.device)
    hbm = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        hbm = next((v for key, v in PEAK_HBM_TBS.items() if key in name), None)
    rows = []
    from torchq.backends.triton import factored_dot as fd

    default_stream, default_dot = sg.DEFAULT_TUNING, sg.DOT_TUNING
    kinds = set(args.kernels.split(","))
    stream_c = STREAM_CANDIDATES[:2] if args.quick else STREAM_CANDIDATES
    dot_c = DOT_CANDIDATES[:2] if args.quick else DOT_CANDIDATES
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        ws = weights(k, n, device)
        for m in [int(v) for v in args.m.split(",")]:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            base = device_time_us(lambda w=ws["bf16"][0], x=x: w(x), device, args.reps)
            case = dict(shape=shape, k=k, n=n, m=m, base=base, ws=ws, hbm=hbm, reps=args.reps, device=device,
                        refs={fmt: F.linear(x.float(), ws[fmt][2].float()) for fmt in ("int4-g128", "nf4-b64")})

            def record(kind, fmt, label, fn, case=case):
                rows.append(measure(case, kind, fmt, label, fn))

            for fmt in args.formats.split(","):
                call = ws[fmt][0]
                record("op", fmt, "as routed", lambda c=call, x=x: c(x))
                if "factored" in kinds and fmt.startswith("int4"):  # the op routes codebook formats elsewhere
                    saved_rows, saved_t = dl.FACTORED_ROWS, fd.FACTORED_TUNING
                    dl.FACTORED_ROWS = (1, 1 << 30)
                    try:
                        for bm, bn, bk, nw, ns, pps, dec in (FACTORED_CANDIDATES[:2] if args.quick else FACTORED_CANDIDATES):
                            if (bm > max(16, m) or (dec and fmt.startswith("nf4"))) and not args.quick:
                                continue
                            fd.FACTORED_TUNING = fd.FactoredTuning(bm, bn, bk, nw, ns, pps, dec)
                            record("factored", fmt, f"m{bm} n{bn} k{bk} w{nw} s{ns} pps{pps} d{dec}", lambda c=call, x=x: c(x))
                    finally:
                        dl.FACTORED_ROWS, fd.FACTORED_TUNING = saved_rows, saved_t
                if m <= sg.STREAM_MAX_M and "stream" in kinds:
                    for bn, bkw, nw in stream_c:
                        for pps in STREAM_PPS:
                            for dec in (STREAM_DECODES if fmt.startswith("int4") and not args.quick else (0,)):
                                tuning = sg.StreamTuning(block_n=bn, block_kw=bkw, num_warps=nw, programs_per_sm=pps, decode=dec)
                                sg.DEFAULT_TUNING = tuning
                                record("stream", fmt, f"n{bn} kw{bkw} w{nw} pps{pps} d{dec}", lambda c=call, x=x: c(x))
                    sg.DEFAULT_TUNING = default_stream
                    if m == 1:  # the one-row split-K GEMV this replaces
                        saved = dl.stream_gemv_fits, dl.words_fit
                        dl.stream_gemv_fits = dl.words_fit = lambda *a: False
                        try:
                            record("old-gemv", fmt, "n32 k128", lambda c=call, x=x: c(x))
                        finally:
                            dl.stream_gemv_fits, dl.words_fit = saved
                if (sg.STREAM_MAX_M < m <= 64 or (args.quick and m > 1)) and "dot" in kinds:
                    for bm, bn, bkw, nw, ns in dot_c:
                        for pps in DOT_PPS:
                            sg.DOT_TUNING = sg.DotTuning(block_m=bm, block_n=bn, block_kw=bkw, num_warps=nw, num_stages=ns,
                                                         programs_per_sm=pps)
                            record("dot", fmt, f"m{bm} n{bn} kw{bkw} w{nw} s{ns} pps{pps}", lambda c=call, x=x: c(x))
                    sg.DOT_TUNING = default_dot
                if m > sg.STREAM_MAX_M:  # dequantize + cuBLAS, the path above DOT_MAX_M
                    saved_max = dl.DOT_MAX_M
                    dl.DOT_MAX_M = 0
                    try:
                        record("deq+mm", fmt, "", lambda c=call, x=x: c(x))
                    finally:
                        dl.DOT_MAX_M = saved_max
    return rows


def best_rows(rows: list[dict]) -> list[dict]:
    best: dict[tuple, dict] = {}
    for r in rows:
        if "us" not in r:
            continue
        key = (r["shape"], r["M"], r["kernel"], r["format"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    return list(best.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="4096x4096,8192x8192,8192x28672,28672x8192", help="comma-separated KxN")
    p.add_argument("--m", default="1,4,16,64", help="comma-separated activation rows")
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="two candidates per kernel (smoke runs)")
    p.add_argument("--kernels", default="stream,dot,factored", help="comma-separated: stream, dot, factored")
    p.add_argument("--formats", default="int4-g128,nf4-b64", help="comma-separated: int4-g128, nf4-b64")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tune_gpu_kernels: no CUDA device (TRITON_INTERPRET=1 ... --device cpu for a smoke run)", file=sys.stderr)
        return 2
    rows = run(args)
    print("# best per shape, M, kernel, format")
    for r in sorted(best_rows(rows), key=lambda r: (r["shape"], r["M"], r["format"], r["us"])):
        print(f"{r['shape']:>11} M={r['M']:<4} {r['format']:<9} {r['kernel']:<8} {r['params']:<28} {r['us']:9.1f} us  {r['vs_bf16']:5.2f}x bf16")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
