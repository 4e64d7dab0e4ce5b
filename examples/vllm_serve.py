"""Greedy generation and timings of a model folder served by vLLM (``vllm.LLM``), one folder per
process: vLLM starts worker processes of its own, and a fresh process per folder frees them.

    python -m examples.vllm_serve FOLDER --prompts '[[1, 5, 9]]' --tokens 32 [--tp 2] [--eager] [--bench]

prints one JSON line: ``{"tokens": [[ids], ...], "load_s": ...}`` (each prompt generated on its
own, so every matrix product has the shapes transformers' ``generate`` gives it: the prompt, then
one token at a time), and with ``--bench`` decode tokens/s at batch 1 and 16 and the time to first
token of a 256-token prompt. ``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 (GiB) here: vLLM's CPU
backend otherwise reserves most of the machine's memory for its KV cache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _llm(folder: str, tp: int, dtype: str, max_len: int | None, eager: bool):
    from vllm import LLM

    return LLM(model=folder, skip_tokenizer_init=True, dtype=dtype, max_model_len=max_len, enforce_eager=eager,
               tensor_parallel_size=tp, seed=0, max_num_seqs=16)


def _params(tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, detokenize=False, ignore_eos=True)


def generate(llm, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy continuations, one prompt at a time."""
    out = []
    for p in prompts:
        res = llm.generate([{"prompt_token_ids": list(p)}], _params(tokens), use_tqdm=False)
        out.append(list(res[0].outputs[0].token_ids))
    return out


def bench(llm, vocab: int, repeats: int = 3) -> dict[str, float]:
    """Decode tokens/s at batch 1 and 16 (64 new tokens after an 8-token prompt; the best of
    ``repeats``) and the time to first token of a 256-token prompt (median)."""
    import statistics

    def prompt(i: int, n: int) -> list[int]:
        return [(7 + 131 * i + 17 * j) % vocab for j in range(n)]

    out: dict[str, float] = {}
    for batch in (1, 16):
        prompts = [{"prompt_token_ids": prompt(i, 8)} for i in range(batch)]
        llm.generate(prompts, _params(4), use_tqdm=False)  # warm-up
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            llm.generate(prompts, _params(64), use_tqdm=False)
            best = max(best, batch * 64 / (time.perf_counter() - t))
        out[f"tok_s_b{batch}"] = best
    ttft = []
    for r in range(repeats + 1):
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt(100 + r, 256)}], _params(1), use_tqdm=False)
        ttft.append(time.perf_counter() - t)
    out["ttft_256_s"] = statistics.median(ttft[1:])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--prompts", default="[]", help="JSON list of token-id lists")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-len", type=int, default=0, help="0: the model's own")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (vLLM's enforce_eager): starts faster")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size for --bench prompts")
    ap.add_argument("--repeats", type=int, default=3, help="--bench: timed runs of each measurement")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t = time.perf_counter()
    llm = _llm(args.folder, args.tp, args.dtype, args.max_len or None, args.eager)
    result: dict = {"load_s": time.perf_counter() - t}
    result["tokens"] = generate(llm, json.loads(args.prompts), args.tokens)
    if args.bench:
        result.update(bench(llm, args.vocab, args.repeats))
    sys.stdout.write("VLLM_RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
