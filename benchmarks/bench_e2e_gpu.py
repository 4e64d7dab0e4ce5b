"""End to end on an NVIDIA GPU through transformers: a random-weight Llama-3-8B-shaped model built
from its config (no download), bf16 against every torchq config, with bitsandbytes NF4 as a peer
when it is installed.

The model: ``LlamaForCausalLM`` with Llama-3-8B's shapes (hidden 4096, intermediate 14336, 32
query / 8 key-value heads, vocab 128256, bf16) and ``--layers`` layers (default 8, to fit the
time; the per-layer work is the real model's), random weights (seed 0). Each config's copy is
made with ``torchq.quantize_`` (the embedding and ``lm_head`` stay bf16, as every config leaves them).

Measurements (``--rounds`` rounds, every config once per round, median):

* ``decode b1`` / ``decode b16``: tok/s of greedy ``generate`` at batch 1 and 16 (all sequences'
  tokens: the throughput), ``--new-tokens`` tokens forced (``min_new_tokens``), eager, dynamic
  cache, a 16-token prompt; the whole ``generate`` call timed, its prefill included;
* ``compiled b1``: the same at batch 1 with a static cache and transformers' compiled decode step
  (``--compile``; compile time reported, not timed);
* ``prefill``: ms of one forward over ``--prefill-tokens`` (512) tokens, last position's logits;
* ``peak GiB``: peak CUDA memory of the config's copy during its measurements.

``x bf16`` is bf16's time / this (>1 = faster). A config that fails to quantize or run gets a row
that says why. ``--device cpu --layers 1 --tiny`` runs the script on a small model on the CPU (a
smoke test of the script, not of the GPU kernels).

    python benchmarks/bench_e2e_gpu.py --json e2e_gpu.json
    python benchmarks/bench_e2e_gpu.py --configs int4-g128,nf4 --layers 4 --compile
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch

import torchq

CONFIGS: dict[str, Callable[[], torchq.QuantConfig]] = {
    "int4-g128": lambda: torchq.int4_weight_only(group_size=128),
    "int4-g128-native": lambda: torchq.Int4WeightOnlyConfig(group_size=128, layout=torchq.layouts.Int4NativeLayout()),
    "int4-g32": lambda: torchq.int4_weight_only(group_size=32),
    "nf4": torchq.nf4_weight_only,
    "int8wo": torchq.int8_weight_only,
    "int8dq": torchq.int8_dynamic_activation_int8_weight,
    "int4a8": lambda: torchq.config_from_name("int4a8-g32"),
    "fp8dq-row": lambda: torchq.config_from_name("fp8dq-row"),
    "fp8wo": torchq.float8_weight_only,
}
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
            max_position_embeddings=1024, tie_word_embeddings=False)


def build_model(layers: int, tiny: bool, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**(TINY if tiny else LLAMA3_8B), num_hidden_layers=layers, torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    for p in model.parameters():  # small random weights: activations stay in range over the layers
        p.data.normal_(0, 0.02)
    return model.eval()


def bnb_nf4(model):
    """bitsandbytes' Linear4bit (NF4, bf16 compute) in place of every decoder Linear, or a reason string."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes not installed"
    import bitsandbytes as bnb

    q = copy.deepcopy(model)
    for _, mod in list(q.model.layers.named_modules()):
        for child, lin in list(mod.named_children()):
            if isinstance(lin, torch.nn.Linear):
                new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=torch.bfloat16,
                                        quant_type="nf4")
                new.weight = bnb.nn.Params4bit(lin.weight.data.cpu(), requires_grad=False, quant_type="nf4")
                setattr(mod, child, new.to(lin.weight.device))
    return q


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_call(model, batch: int, new_tokens: int, device: torch.device, compiled: bool) -> Callable[[], float]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, 16), generator=gen).to(device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if compiled:
        kwargs.update(cache_implementation="static")

    def run() -> float:
        sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, **kwargs)
        sync(device)
        return batch * new_tokens / (time.perf_counter() - t)

    return run


def prefill_call(model, tokens: int, device: torch.device) -> Callable[[], float]:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2)).to(device)

    def run() -> float:
        sync(device)
        t = time.perf_counter()
        with torch.inference_mode():
            model(ids, logits_to_keep=1)
        sync(device)
        return (time.perf_counter() - t) * 1e3

    return run


def measure(name: str, model, args, device: torch.device) -> dict:
    row: dict = {"config": name}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    calls = {"decode b1": decode_call(model, 1, args.new_tokens, device, False),
             "decode b16": decode_call(model, 16, args.new_tokens, device, False),
             "prefill": prefill_call(model, args.prefill_tokens, device)}
    if args.compile:
        model.generation_config.compile_config = None  # transformers' default compile config with the static cache
        calls["compiled b1"] = decode_call(model, 1, args.new_tokens, device, True)
    for key, call in calls.items():
        try:
            t = time.perf_counter()
            call()  # warm-up (and compilation)
            row[f"{key} warmup s"] = time.perf_counter() - t
            row[key] = statistics.median(call() for _ in range(args.rounds))
        except Exception as e:  # a config that cannot run this: the row says why, the others go on
            row[key] = None
            row[f"{key} error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(f"# {name} {key}: {row[f'{key} error']}", file=sys.stderr)
    row["peak GiB"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return row


COLUMNS = ("decode b1", "decode b16", "compiled b1", "prefill")


def format_table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["config"] == "bf16"), None)
    head = ["config"] + [c for key in COLUMNS for c in (key + (" tok/s" if key != "prefill" else " ms"), "x bf16")] + ["peak GiB"]
    lines = [head]
    for r in rows:
        line = [r["config"]]
        for key in COLUMNS:
            v = r.get(key)
            b = base.get(key) if base else None
            line.append("-" if v is None else f"{v:.1f}")
            if v is None or not b:
                line.append("-")
            else:
                line.append(f"{(b / v if key == 'prefill' else v / b):.2f}x")
        line.append("-" if r.get("peak GiB") is None else f"{r['peak GiB']:.2f}")
        lines.append(line)
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(v).rjust(w) if i else str(v).ljust(w) for i, (v, w) in enumerate(zip(row, widths))) for row in lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also decode at batch 1 with a static cache, compiled")
    ap.add_argument("--peers", default="bitsandbytes", help="bitsandbytes, or none")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model (smoke runs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e_gpu: no CUDA device (--device cpu --tiny for a smoke run)", file=sys.stderr)
        return 2
    unknown = [c for c in args.configs.split(",") if c and c not in CONFIGS]
    if unknown:
        print(f"bench_e2e_gpu: --configs: unknown {unknown}; expected some of {list(CONFIGS)}", file=sys.stderr)
        return 2
    base = build_model(args.layers, args.tiny, device)
    rows = [measure("bf16", base, args, device)]
    print(format_table(rows), flush=True)
    for name in [c for c in args.configs.split(",") if c]:
        model = copy.deepcopy(base)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torchq.quantize_(model.model.layers, CONFIGS[name]())
        except Exception as e:
            rows.append({"config": name, "error": f"{type(e).__name__}: {e}"[:200]})
            print(f"# {name}: quantize_ failed: {rows[-1]['error']}", file=sys.stderr)
            continue
        rows.append(measure(name, model, args, device))
        del model
        gc.collect()
        print(format_table(rows), flush=True)
    if "bitsandbytes" in args.peers.split(","):
        peer = bnb_nf4(base) if device.type == "cuda" else "bitsandbytes: CUDA only here"
        if isinstance(peer, str):
            rows.append({"config": "bnb-nf4", "error": peer})
        else:
            rows.append(measure("bnb-nf4", peer, args, device))
    print("# final")
    print(format_table(rows))
    for r in rows:
        if "error" in r:
            print(f"# {r['config']}: {r['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
                       "layers": args.layers, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
