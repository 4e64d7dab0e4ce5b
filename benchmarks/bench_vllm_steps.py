"""Where a decode step's time goes when vLLM serves SmolLM2-135M on the CPU: its linear layers (every
call of a linear method's ``apply``: the 30 layers' projections and the LM head) against the rest
(attention, norms, rotary embeddings, sampling, the engine's bookkeeping), per token at batch 1.

vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager, its worker on one core, so each
step is timed from one first-layer call to the next and each ``apply`` call is timed inside it. For
a torchq folder the steps alternate between the plugin's ``apply`` (``torchq.dispatch.DirectLinear``)
and ``F.linear`` on the same quantized weight, so the two ways of calling the kernels are compared on
interleaved steps of one model (this VM's speed drifts by up to 2x over minutes; whole runs of
``bench_vllm.py`` cannot resolve a few percent). The folders are ``bench_vllm.py``'s (written once
under ``$TORCHQ_CACHE/vllm-bench``). Run it in vLLM's environment:

    .venv-vllm/bin/python benchmarks/bench_vllm_steps.py --configs int4-g32,nf4,int8wo,int8dq --json steps.json
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _measure(folder: str, tokens: int, rounds: int, max_len: int = 512) -> dict:
    """In this process: serve ``folder`` and time its decode steps and linear calls."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    import torch.nn.functional as F
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from torchq.vllm.method import TorchqLinearMethod

    clock = time.perf_counter
    steps: list[tuple[int, float, float]] = []  # (mode, step seconds, seconds in apply)
    now = {"mode": 0, "first": None, "start": None, "inside": 0.0, "torchq": False}

    def timed(original, alternative=None):
        def apply(self, layer, x, bias=None):
            if now["first"] is None:
                now["first"] = layer
            if layer is now["first"] and x.shape[0] == 1:  # a decode step begins
                t = clock()
                if now["start"] is not None:
                    steps.append((now["mode"], t - now["start"], now["inside"]))
                now["start"], now["inside"] = t, 0.0
                now["mode"] ^= 1 if now["torchq"] else 0  # torchq folders alternate (whichever layer comes first)
            if alternative is not None:
                now["torchq"] = True
            t = clock()
            if now["mode"] == 1 and alternative is not None:  # (float layers run as they are)
                y = alternative(x, layer.weight, bias)
            else:
                y = original(self, layer, x, bias)
            now["inside"] += clock() - t
            return y
        return apply

    TorchqLinearMethod.apply = timed(TorchqLinearMethod.apply, F.linear)
    UnquantizedLinearMethod.apply = timed(UnquantizedLinearMethod.apply)
    UnquantizedEmbeddingMethod.apply = timed(UnquantizedEmbeddingMethod.apply)
    llm = LLM(model=folder, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_len, enforce_eager=True)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    for r in range(rounds + 1):
        if r == 1:
            steps.clear()  # the first generate warms up
        now["start"] = None  # a prefill and a pause between generates are not a step
        llm.generate([{"prompt_token_ids": list(range(100 + r, 116 + r))}], params, use_tqdm=False)
    out = {}  # "direct": the methods' own apply (vLLM's for float layers); "f.linear": torchq's layers through F.linear
    for mode, name in ((0, "direct"), (1, "f.linear")):
        mine = [s for s in steps if s[0] == mode]
        if mine:
            out[name] = {"step_ms": statistics.median(s[1] for s in mine) * 1e3,
                         "linears_ms": statistics.median(s[2] for s in mine) * 1e3, "steps": len(mine)}
    return out


def _folders(configs: list[str], with_float: bool) -> list[tuple[str, Path]]:
    from bench_vllm import _float_folder, _torchq_folder

    rows = [("float bf16", _float_folder("bfloat16"))] if with_float else []
    return rows + [(f"torchq {c} +head", _torchq_folder(c, "quantized")) for c in configs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="int4-g32,nf4,int8wo,int8dq", help="comma-separated torchq config names")
    ap.add_argument("--no-float", action="store_true", help="skip the float bf16 row")
    ap.add_argument("--folder", help="measure this served folder only (instead of bench_vllm.py's)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per generate call")
    ap.add_argument("--rounds", type=int, default=4, help="generate calls measured (after one warm-up)")
    ap.add_argument("--max-len", type=int, default=512, help="vLLM's max_model_len")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this folder, print JSON
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.one:
        print("STEPS_RESULT " + json.dumps(_measure(args.one, args.tokens, args.rounds, args.max_len)), flush=True)
        return 0
    jobs = ([("folder", Path(args.folder))] if args.folder
            else _folders([c for c in args.configs.split(",") if c], not args.no_float))
    rows = []
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for name, folder in jobs:
        proc = subprocess.run([sys.executable, __file__, "--one", str(folder), "--tokens", str(args.tokens),
                               "--rounds", str(args.rounds), "--max-len", str(args.max_len)], capture_output=True, text=True, timeout=1800, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("STEPS_RESULT ")]
        if proc.returncode or not lines:
            print(f"{name}: failed (exit {proc.returncode}): {proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append({"model": name, "folder": str(folder), **json.loads(lines[-1].removeprefix("STEPS_RESULT "))})
    print(f"{'served (bf16, eager, in-process)':34} {'step ms':>8} {'linears ms':>10} {'rest ms':>8} "
          f"{'linears, F.linear ms':>20} {'direct / F.linear':>17}")
    for r in rows:
        d, f = r["direct"], r.get("f.linear")
        cells = (f"{f['linears_ms']:>20.2f} {d['linears_ms'] / f['linears_ms']:>17.3f}" if f else f"{'-':>20} {'-':>17}")
        print(f"{r['model']:34} {d['step_ms']:>8.2f} {d['linears_ms']:>10.2f} {d['step_ms'] - d['linears_ms']:>8.2f} {cells}")
    print(f"medians over decode steps ({args.rounds} x {args.tokens} tokens, torchq rows' steps alternating between the "
          f"two calls); linears: every linear method's apply, LM head included")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "tokens": args.tokens, "rounds": args.rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
