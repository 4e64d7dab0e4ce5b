"""torchq's native CPU kernels against the memory bandwidth, float F.linear and PyTorch's own ops.

One run measures:

1. the machine's read bandwidth: ``torch.sum`` over a 1 GiB fp32 tensor (best of 5), with the
   threads torch uses;
2. for every shape ``KxN`` (a ``Linear(K, N)``; default 4096x4096, 4096x11008, 11008x4096),
   activation dtype (fp32, bf16, fp16) and M (1, 4, 16, 64, 256), the median time of

   * ``float``: ``F.linear`` in the activation dtype, and ``float32``: upcast to fp32 and back
     (the faster of the two is the "fastest float" every quantized path is compared with);
   * PyTorch's own quantized ops: ``aten-int4`` (``_weight_int4pack_mm_for_cpu``, g128),
     ``aten-int8`` (``_weight_int8pack_mm``), both in the activation dtype; ``fbgemm``
     (``torch.ao.quantization.quantize_dynamic``, per-channel qint8, fp32 activations: the input
     is cast to fp32 and the output back, included in the time); ``int_mm``: per-token int8
     activations through ``torch._int_mm`` (torchq's reference path for int8 dynamic);
   * torchq through ``nn.Linear`` (the whole user-facing path: subclass dispatch, the kernel
     table, the op): ``int4`` (int4 g128, tinygemm numerics: scales and zeros in the weight's
     dtype, ``Int4NativeLayout``), ``int4-fp32`` (the same with fp32 scales and zeros whatever
     the activation dtype: the form the AVX2 decode path factors, autoquant's candidate for
     bf16 / fp16 models), ``nf4`` (NF4 b64, double-quantized absmax), ``int4a8`` / ``nf4a8``
     (the int8-activation 4-bit mode: int4 g32 with fp32 scales, NF4 b64; activations int8 per
     32-block), ``int8wo`` (int8 weight-only), ``int8dq`` (int8 dynamic), ``int8dq-r7`` (int8
     dynamic with 7-bit activations, ``reduce_range=True``: the range FBGEMM's column uses),
     ``int8sq`` (int8 static activations, :class:`~torchq.activation.StaticInt8`: symmetric, scale
     4/127 for the standard-normal inputs), ``int8sq-z`` (static with a zero point: the range
     [-3, 5], z = -32: the kernel's zero-point correction), ``int8sq-r7`` (static, 7-bit range
     [-64, 63]: the AVX2 narrow kernels).

Weights are rotated through enough copies that every call reads its weight from DRAM, not from
a cache (at least ``--rotate-mb`` MB of weights per config; the L3 of a server CPU holds 8-100 MB).

Columns: ``ms`` (median per call), ``x best float`` (fastest float / this, >1 = faster) and, at
M=1, ``%bw``: the weight's bytes (codes + scales) / time / the read bandwidth measured next to
that row (the better of just before and just after it: a shared machine's bandwidth drifts by 2x
within minutes). The configs of a row are timed in interleaved rounds for the same reason
(:func:`torchq.timing.time_interleaved`); ``*`` marks a cell whose timing is noisy. Under each row
with static configs, ``static vs dynamic``: the dynamic config's time / the static one's (>1 = static
faster; ``int8sq`` and ``int8sq-z`` against ``int8dq``, ``int8sq-r7`` against ``int8dq-r7``), also
in the JSON rows as ``x_dynamic``.

ISA: ``--isa native`` runs on what the machine has; ``--isa avx2`` (``avx512``, ``scalar``) re-runs
the script in a subprocess with torchq's and PyTorch's kernels capped there (``isa_caps.py``:
PyTorch reads its caps when it is imported). By default a machine with more than AVX2 runs both
``native`` and ``avx2`` (users run AVX2-only CPUs). Each run's tables are headed by the ISA it ran
under (torchq's native ISA, ``torch.backends.cpu.get_cpu_capability()``); the JSON has one entry
per run in ``runs`` and every row in ``rows``, with its ``isa``.

    python benchmarks/bench_cpu_kernels.py                         # full run (~10 minutes on 2 cores per ISA)
    python benchmarks/bench_cpu_kernels.py --quick                 # one shape, M in {1, 16}
    python benchmarks/bench_cpu_kernels.py --shapes 4096x4096 --m 1 --dtypes bf16 --json out.json
    python benchmarks/bench_cpu_kernels.py --quick --isa avx2      # only as an AVX2 CPU would run it
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import torchq
from torchq.activation import StaticInt8
from torchq.layouts import Int4CPULayout
from torchq.ops.int8 import int8_dynamic_linear
from torchq.timing import Timing, time_interleaved

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling isa_caps module, also when loaded by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import isa_caps  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIGS = ("float", "float32", "aten-int4", "aten-int8", "fbgemm", "int_mm", "int4", "int4-fp32", "nf4", "int4a8", "nf4a8", "int8wo",
           "int8dq", "int8dq-r7", "int8sq", "int8sq-z", "int8sq-r7")
TORCHQ = {"int4": "int4", "int4-fp32": "int4-fp32", "nf4": "nf4", "int4a8": "int4a8", "nf4a8": "nf4a8", "int8wo": "int8wo", "int8dq": "int8dq",
          "int8dq-r7": "int8dq-r7", "int8sq": "int8sq", "int8sq-z": "int8sq-z", "int8sq-r7": "int8sq-r7"}
# each static config's dynamic counterpart (same weight, same activation range): the "static vs dynamic" ratio
STATIC_VS_DYNAMIC = {"int8sq": "int8dq", "int8sq-z": "int8dq", "int8sq-r7": "int8dq-r7"}
# the static configs' activation schemes (inputs are standard normal)
STATIC_ACTIVATIONS = {
    "int8sq": lambda: StaticInt8(4.0 / 127),
    "int8sq-z": lambda: StaticInt8.from_range(-3.0, 5.0),
    "int8sq-r7": lambda: StaticInt8(4.0 / 63, 0, -64, 63),
}


def read_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """GB/s of torch.sum over a ``gib`` GiB fp32 tensor (best of ``reps``)."""
    big = torch.ones(int(gib * (1 << 30)) // 4)
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - t)
    return big.numel() * 4 / best / 1e9


def _quantized(k: int, n: int, name: str, dtype: torch.dtype) -> nn.Linear:
    lin = nn.Linear(k, n, bias=False).to(dtype)
    if name in STATIC_ACTIVATIONS:
        torchq.quantize_(lin, torchq.Int8StaticActivationInt8WeightConfig(activation=STATIC_ACTIVATIONS[name]()))
        return lin
    cfg = {
        "int4": torchq.int4_weight_only(group_size=128),
        "int4-fp32": torchq.int4_weight_only(group_size=128, scale_dtype=torch.float32),
        "nf4": torchq.nf4_weight_only(),
        "int4a8": torchq.int8_dynamic_activation_4bit_weight("int4", group_size=32),
        "nf4a8": torchq.int8_dynamic_activation_4bit_weight("nf4", group_size=64),
        "int8wo": torchq.int8_weight_only(),
        "int8dq": torchq.int8_dynamic_activation_int8_weight(),
        "int8dq-r7": torchq.int8_dynamic_activation_int8_weight(reduce_range=True),
    }[name]
    torchq.quantize_(lin, cfg)
    return lin


def _weight_bytes(lin: nn.Linear) -> int:
    w = lin.weight
    return w.nbytes_quantized() if hasattr(w, "nbytes_quantized") else w.numel() * w.element_size()


class Case:
    """One config on one shape and dtype: ``copies`` independent weights and a call(x, i)."""

    def __init__(self, name: str, k: int, n: int, dtype: torch.dtype, rotate_bytes: int) -> None:
        self.name, self.nbytes = name, 0
        torch.manual_seed(0)
        make, self.call = self._build(name, k, n, dtype)
        first = make()
        copies = max(1, min(64, math.ceil(rotate_bytes / max(1, self.nbytes))))
        self.weights = [first] + [make() for _ in range(copies - 1)]

    def _build(self, name, k, n, dtype):
        if name in ("float", "float32"):
            def make():
                w = torch.randn(n, k, dtype=dtype) * 0.02
                self.nbytes = w.numel() * w.element_size()
                return w.float() if name == "float32" else w
            call = (lambda x, w: F.linear(x, w)) if name == "float" else (lambda x, w: F.linear(x.float(), w).to(x.dtype))
            return make, call
        if name == "aten-int4":
            def make():
                lin = _quantized_int4_cpu(k, n, dtype)
                self.nbytes = lin.weight.nbytes_quantized()
                impl = lin.weight.tensor_impl
                return impl.packed, impl.scales_and_zeros.to(dtype), impl.padded_shape
            def call(x, w):
                packed, sz, (np_, kp) = w
                return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 128, sz)[:, :n]
            return make, call
        if name == "aten-int8":
            def make():
                codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
                scale = torch.rand(n) * 1e-3
                self.nbytes = codes.numel() + scale.numel() * 4
                return codes, scale.to(dtype)
            return make, lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w[0], w[1])
        if name == "fbgemm":
            def make():
                lin = nn.Linear(k, n, bias=False)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    q = torch.ao.quantization.quantize_dynamic(
                        nn.Sequential(lin), {nn.Linear}, dtype=torch.qint8
                    )
                self.nbytes = n * k + n * 8
                return q
            return make, lambda x, w: w(x.float()).to(x.dtype)
        if name == "int_mm":
            def make():
                codes = torch.randint(-127, 128, (n, k), dtype=torch.int8)
                self.nbytes = codes.numel() + n * 4
                return codes, torch.rand(n) * 1e-3
            def call(x, w):
                with torchq.native.disabled():
                    return int8_dynamic_linear(x, w[0], w[1], -127, 127, 1e-5)
            return make, call
        def make():
            lin = _quantized(k, n, TORCHQ[name], dtype)
            self.nbytes = _weight_bytes(lin)
            return lin
        return make, lambda x, lin: lin(x)


def _quantized_int4_cpu(k: int, n: int, dtype: torch.dtype) -> nn.Linear:
    lin = nn.Linear(k, n, bias=False).to(dtype)
    torchq.quantize_(lin, torchq.int4_weight_only(group_size=128, layout=Int4CPULayout()))
    return lin


def time_cases(cases: dict, x: torch.Tensor, budget_s: float, min_reps: int, rounds: int = 5) -> dict[str, Timing]:
    """Seconds per call of every case, measured in ``rounds`` interleaved rounds (each case gets a
    slice of every round, at least ``min_reps`` calls in all and up to ``budget_s`` seconds, at most
    2000 calls), so that a slow phase of a shared machine hits all of them alike. Each call takes
    the case's next weight copy. Every copy is called once first: what a weight builds on its first
    call (the native weight, the static format's row sums) is not a per-call cost. Cases that fail
    their warm-up are reported and left out."""
    fns = {}
    for c, case in cases.items():
        try:  # warm up every copy; drop cases that cannot run
            for w in case.weights:
                case.call(x, w)
        except Exception as e:
            print(f"  {c} M={x.shape[0]}: failed ({type(e).__name__}: {e})")
            continue
        fns[c] = _cycling_call(case, x)
    return time_interleaved(fns, rounds=rounds, budget_s=budget_s, min_reps=max(1, min_reps // rounds),
                            max_reps=2000 // rounds, warmup=0)


def _cycling_call(case: Case, x: torch.Tensor):
    """A zero-argument call of ``case`` on ``x`` that takes the next weight copy each time."""
    state = {"i": 0}

    def call() -> None:
        case.call(x, case.weights[state["i"] % len(case.weights)])
        state["i"] += 1
    return call


def run(args: argparse.Namespace, isa: str) -> dict:
    """One run of every shape, dtype and M under the ISA this process has; prints the tables and
    returns the results (``rows`` tagged with ``isa``)."""
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.m.split(",")]
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    info = isa_caps.isa_info(isa)
    label = isa_caps.isa_label(info)
    print(f"# {label}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; {torchq.native.status()}")
    bw = read_bandwidth(args.bandwidth_gib)
    print(f"read bandwidth (torch.sum over {args.bandwidth_gib:g} GiB fp32): {bw:.1f} GB/s\n")
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "native": str(torchq.native.status()),
               "read_bandwidth_gbs": bw, **info, "rows": []}
    with torch.no_grad():  # a context, not set_grad_enabled: callers (the tests) keep their grad mode
        noisy = False
        for k, n in shapes:
            for dtype in dtypes:
                dname = str(dtype).replace("torch.", "")
                cases = {}
                for c in configs:
                    try:
                        cases[c] = Case(c, k, n, dtype, int(args.rotate_mb * 1e6))
                    except Exception as e:  # an op PyTorch lacks on this build: say so, go on
                        print(f"  {c} on {k}x{n} {dname}: unavailable ({type(e).__name__}: {e})")
                header = f"{'M':>4} " + " ".join(f"{c:>18}" for c in cases)
                print(f"== Linear({k}, {n}), {dname} activations, {label}: ms (x fastest float){'; %bw at M=1' if 1 in ms else ''}")
                print(header)
                for m in ms:
                    x = torch.randn(m, k).to(dtype)
                    if m == 1:  # shared machines drift: the bandwidth next to the row, the best of before and after
                        before = read_bandwidth(args.bandwidth_gib / 2, 3)
                    timings = time_cases(cases, x, args.budget, args.min_reps)
                    row_bw = max(before, read_bandwidth(args.bandwidth_gib / 2, 3)) if m == 1 else bw
                    floats = [timings[c].median for c in ("float", "float32") if c in timings]
                    best = min(floats) if floats else None
                    cells = []
                    for c, timing in timings.items():
                        t = timing.median
                        ratio = best / t if best else float("nan")
                        frac = cases[c].nbytes / t / 1e9 / row_bw if m == 1 else None
                        noisy |= timing.noisy
                        cell = f"{t * 1e3:.3f}{'*' if timing.noisy else ''} ({ratio:.2f}x)" + (f" {100 * frac:.0f}%" if frac is not None else "")
                        cells.append(f"{cell:>18}")
                        results["rows"].append({"isa": isa, "K": k, "N": n, "dtype": dname, "M": m, "config": c, "ms": t * 1e3,
                                                "x_fastest_float": ratio, "weight_bytes": cases[c].nbytes,
                                                "bandwidth_fraction": frac, "row_bandwidth_gbs": row_bw if m == 1 else None,
                                                "timing_ms": timing.to_dict(1e3)})
                    print(f"{m:>4} " + " ".join(cells) + (f"   (bandwidth {row_bw:.1f} GB/s)" if m == 1 else ""))
                    vs_dynamic = []
                    for row in results["rows"][-len(timings):]:
                        dynamic = STATIC_VS_DYNAMIC.get(row["config"])
                        if dynamic in timings:
                            row["x_dynamic"] = timings[dynamic].median / row["ms"] * 1e3
                            vs_dynamic.append(f"{row['config']} {row['x_dynamic']:.2f}x ({dynamic})")
                    if vs_dynamic:
                        print(f"{'':>4}   static vs dynamic: " + ", ".join(vs_dynamic))
                print()
                del cases
        if noisy:
            print("* noisy: interquartile range above 25% of the median, or the median above 2x the fastest call "
                  "(a shared machine); rerun on an idle machine to rank those cells\n")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,4096x11008,11008x4096", help="KxN list (in_features x out_features)")
    ap.add_argument("--m", default="1,4,16,64,256", help="activation rows")
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--budget", type=float, default=0.25, help="seconds of timing per cell")
    ap.add_argument("--min-reps", type=int, default=5)
    ap.add_argument("--rotate-mb", type=float, default=320.0, help="weights per config to rotate through (MB)")
    ap.add_argument("--bandwidth-gib", type=float, default=1.0, help="size of the tensor the bandwidth is read from")
    ap.add_argument("--quick", action="store_true", help="4096x4096, M in {1, 16}, short budget")
    ap.add_argument("--isa", choices=isa_caps.ISA_CHOICES, default=None,
                    help="run under this ISA (avx2/avx512/scalar: in a subprocess with the caps set); default: native, "
                         "and avx2 too when the machine has more than AVX2")
    ap.add_argument("--json", help="write the results here")
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw_argv)
    if args.quick:
        args.shapes, args.m, args.budget, args.rotate_mb = "4096x4096", "1,16", 0.1, 160.0
    unknown = {c for c in args.configs.split(",") if c} - set(CONFIGS)
    if unknown:
        ap.error(f"--configs: unknown {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    runs = []
    for isa in [args.isa] if args.isa else isa_caps.default_isas():
        if isa_caps.runs_here(isa):
            runs.append(run(args, isa))
        else:
            runs.append(isa_caps.run_capped(__file__, raw_argv, isa))
    if args.json:
        summaries = [{k: v for k, v in r.items() if k not in ("rows", "runs")} for r in runs]
        results = summaries[0] | {"runs": summaries, "rows": [row for r in runs for row in r["rows"]]}
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
        if not isa_caps.runs_capped():
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
