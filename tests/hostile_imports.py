"""Fuzz cases for torchq's import doors, run in a child process under a memory cap (see
tests/test_import_fuzz.py, which starts ``python tests/hostile_imports.py DOOR EXAMPLES``).

Each door starts from a small valid file written by the format's own tools (gguf-py's
``GGUFWriter``; the compressed-tensors package's compressor; transformers' ``save_pretrained`` of a
torchq model) and hypothesis mutates it: byte flips (mostly in the header), truncation, header
fields set to extreme values, hostile config entries, swapped tensor dtypes, NaN scales. Every
case must end in a :class:`torchq.CheckpointError` whose message names the file, or in a correct
load; the model passed in must be unchanged after an error; each case's peak resident memory
(VmHWM, reset before the case) may exceed the resident memory before it by at most
:data:`MEMORY_BUDGET`; a case that runs past :data:`HANG_SECONDS` fails (a hang, not a slow
machine). The whole process runs under ``RLIMIT_AS`` so that a memory bomb fails the case rather
than the machine. Exit status 0 when every case passed; the per-case times and memory are printed.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import resource
import shutil
import signal
import struct
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchq

MEMORY_BUDGET = 256 << 20
HANG_SECONDS = 60
ADDRESS_SPACE_MARGIN = 3 << 30  # RLIMIT_AS above the address space in use at the start
stats: list[tuple[str, str, float, int]] = []  # (door, outcome, seconds, peak bytes over the start)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def cap_address_space() -> None:
    limit = _status("VmSize") + ADDRESS_SPACE_MARGIN
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"a case ran past {HANG_SECONDS} s")


def run_case(door: str, path: Path, load, check_loaded, model_state=None) -> str:
    """Run ``load()``; a CheckpointError must name ``path`` (its file or folder name); a load must pass
    ``check_loaded(result)``; ``model_state()`` (if given) must be the same before and after an error."""
    before = model_state() if model_state is not None else None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM, the peak resident memory
    start_rss = _status("VmRSS")
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_SECONDS)
    t0 = time.perf_counter()
    outcome = "loaded"
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            result = load()
    except torchq.CheckpointError as e:
        outcome = "refused"
        message = str(e)
        assert path.name in message or str(path) in message, f"the error does not name {path}: {message}"
        if model_state is not None:
            after = model_state()
            assert after.keys() == before.keys() and all(after[k] is v for k, v in before.items()), \
                f"the model changed on error: {message}"
    finally:
        signal.alarm(0)
        seconds = time.perf_counter() - t0
        peak = _status("VmHWM") - start_rss
        stats.append((door, outcome, seconds, peak))
        if os.environ.get("TORCHQ_FUZZ_VERBOSE"):
            print(f"{door} {path.name}: {outcome} in {seconds:.2f} s, {peak / 2**20:.1f} MB", flush=True)
    assert peak <= MEMORY_BUDGET, f"the case took {peak / 2**20:.0f} MB over its start ({outcome})"
    if outcome == "loaded":
        check_loaded(result)
    return outcome


def finite_parameters(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        value = p.dequantize(torch.float32) if isinstance(p, torchq.AffineQuantizedTensor) else p
        if value.is_floating_point():
            assert bool(torch.isfinite(value).all()), f"{name} was loaded with NaN/inf values"


def hypothesis_settings(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, print_blob=True,
                    derandomize=os.environ.get("HYPOTHESIS_PROFILE") == "ci",
                    suppress_health_check=list(HealthCheck))


EXTREME_U64 = st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 255, 256, 1 << 16, 1 << 31, (1 << 32) - 1, 1 << 32,
                               1 << 40, 1 << 60, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]) | st.integers(0, (1 << 64) - 1)


# -- GGUF: torchq.hf.from_gguf (and read_gguf under it) --------------------
GGUF_TENSORS = {"attn_q": ("Q4_0", 64, 64), "attn_k": ("Q8_0", 32, 64), "attn_v": ("Q4_1", 32, 64), "attn_output": ("F16", 64, 64),
                "ffn_gate": ("Q4_0", 128, 64), "ffn_up": ("Q5_0", 128, 64), "ffn_down": ("Q4_0", 64, 128)}


def write_gguf(path: Path, *, block_count: int = 2, head_count: int = 2, alignment: int | None = None,
               embedding: int = 64, nan: str | None = None, bf16: bool = False, extra: dict | None = None) -> None:
    """A 2-block Llama GGUF (hidden 64, 2 heads, 1 KV head, vocab 32, tied F32 embedding, a 32-token
    tokenizer list) with Q4_0 / Q8_0 / Q4_1 / Q5_0 / F16 projections; ``nan``: put a NaN into the
    first block scale of tensor ``nan`` (or its first value for a float tensor); ``bf16``: the F16
    projections as BF16; ``extra``: more u32 keys."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(embedding)
    w.add_block_count(block_count)
    w.add_feed_forward_length(128)
    w.add_head_count(head_count)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(32)
    w.add_vocab_size(32)
    w.add_token_list([f"<t{i}>" for i in range(32)])
    w.add_token_scores([0.0] * 32)
    w.add_token_types([1] * 32)
    if alignment is not None:
        w.add_uint32("general.alignment", alignment)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value)  # not add_custom_alignment: it refuses the hostile values

    def add(name: str, kind: str, n: int, k: int) -> None:
        x = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        qt = getattr(gguf.GGMLQuantizationType, kind)
        data = x.astype(np.float16) if kind == "F16" else x if kind == "F32" else gguf.quants.quantize(x, qt)
        if name == nan:
            data = data.copy()
            flat = data.reshape(-1)
            if kind in ("F16", "F32"):
                flat[0] = np.nan
            else:  # the first block's d: two fp16 bytes at its start
                flat[0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
        if bf16 and kind == "F16":  # BF16: the high halves of the fp32 values, as bytes
            data = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
            qt, kind = gguf.GGMLQuantizationType.BF16, "BF16"
        w.add_tensor(name, data, raw_dtype=None if kind in ("F16", "F32") else qt)

    add("token_embd.weight", "F32", 32, 64)
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(64, np.float32))
        for short, (kind, n, k) in GGUF_TENSORS.items():
            add(f"blk.{i}.{short}.weight", kind, n, k)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _gguf_header_end(raw: bytes) -> int:
    from torchq.interop.gguf_file import GGUFFile

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(raw)
        f.flush()
        with GGUFFile(f.name) as g:
            return g.data_start


def _u64_at(raw: bytearray, where: int, value: int) -> None:
    raw[where:where + 8] = struct.pack("<Q", value)


def _after(raw: bytes, name: bytes) -> int:
    """The offset just past the first GGUF string ``name`` (its 8-byte length and bytes)."""
    i = raw.find(struct.pack("<Q", len(name)) + name)
    assert i >= 0, name
    return i + 8 + len(name)


GGUF_FIELDS = ["tensor_count", "kv_count", "token list length", "a token's length", "n_dims", "ne0", "ne1", "type", "offset",
               "block_count"]


def gguf_mutation():
    flip = st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 255), st.booleans())
    truncate = st.tuples(st.just("truncate"), st.floats(0, 1), st.just(0), st.just(False))
    field = st.tuples(st.just("field"), st.sampled_from(GGUF_FIELDS), EXTREME_U64, st.sampled_from(list(GGUF_TENSORS)))
    meta = st.tuples(st.just("meta"), st.sampled_from(["block_count", "head_count", "alignment", "embedding", "nan"]),
                     st.sampled_from([0, 1, 3, 5, 7, 64, 20000, 10**9]), st.sampled_from([*GGUF_TENSORS, "token_embd"]))
    return st.one_of(flip, truncate, field, meta)


def mutate_gguf(base: bytes, header_end: int, m, folder: Path) -> Path:
    what, a, b, c = m
    path = folder / "case.gguf"
    raw = bytearray(base)
    if what in ("flip", "truncate"):  # flips mostly in the header: that is where sizes live
        raw = _damage(raw, m, header_end)
    elif what == "field":
        if a == "tensor_count":
            _u64_at(raw, 8, b)
        elif a == "kv_count":
            _u64_at(raw, 16, b)
        elif a == "token list length":
            _u64_at(raw, _after(raw, b"tokenizer.ggml.tokens") + 8, b)  # past the u32 type and u32 element type
        elif a == "a token's length":
            _u64_at(raw, _after(raw, b"tokenizer.ggml.tokens") + 16, b)
        elif a == "block_count":
            at = _after(raw, b"llama.block_count") + 4
            raw[at:at + 4] = struct.pack("<I", b & 0xFFFFFFFF)
        else:
            at = _after(raw, f"blk.1.{c}.weight".encode())  # n_dims u32, ne u64 x2, type u32, offset u64
            if a == "n_dims":
                raw[at:at + 4] = struct.pack("<I", b & 0xFFFFFFFF)
            elif a == "ne0":
                _u64_at(raw, at + 4, b)
            elif a == "ne1":
                _u64_at(raw, at + 12, b)
            elif a == "type":
                raw[at + 20:at + 24] = struct.pack("<I", b % 48)
            else:
                _u64_at(raw, at + 24, b)
    else:  # metadata written by gguf-py with a hostile value
        kwargs = {"nan": c} if a == "nan" else {a: b}
        write_gguf(path, **kwargs)
        return path
    path.write_bytes(bytes(raw))
    return path


def gguf_door(examples: int, folder: Path) -> None:
    from torchq.hf import from_gguf

    write_gguf(folder / "base.gguf")
    base = (folder / "base.gguf").read_bytes()
    header_end = _gguf_header_end(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = from_gguf(folder / "base.gguf")
    shapes = {n: tuple(p.shape) for n, p in reference.named_parameters()}

    def check(model) -> None:
        assert {n: tuple(p.shape) for n, p in model.named_parameters()} == shapes
        finite_parameters(model)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(torch.tensor([[1, 2, 3]]))

    @hypothesis_settings(examples)
    @given(gguf_mutation())
    def case(m) -> None:
        path = mutate_gguf(base, header_end, m, folder)
        run_case("gguf", path, lambda: from_gguf(path), check)

    case()


# -- compressed-tensors: torchq.interop.compressed_tensors.load_compressed_tensors ----------------
def ct_base(folder: Path) -> tuple[dict, dict]:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_compressed_tensors import build

    tensors, cfg, _ = build(16, 64, "pack-quantized", torch.bfloat16, 1, prefix="layer", num_bits=4, symmetric=False,
                            strategy="group", group_size=32)
    tensors["norm.weight"] = torch.ones(64)
    tensors["layer.bias"] = torch.zeros(16)
    return tensors, cfg


class CTModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 16)
        self.norm = torch.nn.LayerNorm(64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.norm(x))


HOSTILE_PATTERNS = ["re:(.|.)*Z", "re:(a+)+$", "re:(a|aa)*b", "re:(.*a){30}", "re:(", "re:(a)\\1", "re:(?=layer)layer",
                    "re:" + "a" * 5000, "re:(?:a{1000}){1000}", "re:.*layer"]
CT_EDITS = {
    "targets": st.sampled_from(HOSTILE_PATTERNS).map(lambda p: ("targets", [p])),
    "ignore": st.sampled_from(HOSTILE_PATTERNS).map(lambda p: ("ignore", [p])),
    "num_bits": st.sampled_from([0, 1, 3, 9, -1, "4", None, 1 << 40, 4.5]).map(lambda v: ("num_bits", v)),
    "group_size": st.sampled_from([0, -1, 7, 10**12, None, 64, 16]).map(lambda v: ("group_size", v)),
    "strategy": st.sampled_from(["bogus", "tensor", "channel", "block", "tensor_group", None]).map(lambda v: ("strategy", v)),
    "symmetric": st.sampled_from([True, "yes", None]).map(lambda v: ("symmetric", v)),
    "format": st.sampled_from(["float-quantized", "dense", "naive-quantized", 7, None]).map(lambda v: ("format", v)),
    "config_groups": st.sampled_from([{}, [], "x", None]).map(lambda v: ("config_groups", v)),
}
CT_SWAPS = ["norm.weight:int64", "norm.weight:bool", "norm.weight:float64", "norm.weight:float8", "norm.weight:nan",
            "layer.weight_scale:nan", "layer.weight_scale:inf", "layer.weight_scale:zero", "layer.weight_zero_point:huge",
            "layer.weight_packed:short", "layer.weight_shape:huge", "layer.weight_shape:negative", "layer.bias:int32",
            "norm.weight:shape"]


def ct_mutation():
    flip = st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(0, 255), st.booleans())
    truncate = st.tuples(st.just("truncate"), st.floats(0, 1), st.just(0), st.just(False))
    edit = st.tuples(st.just("config"), st.sampled_from(list(CT_EDITS)).flatmap(lambda k: CT_EDITS[k]), st.just(0), st.just(False))
    swap = st.tuples(st.just("swap"), st.sampled_from(CT_SWAPS), st.just(0), st.just(False))
    return st.one_of(flip, truncate, edit, swap)


def _swap(tensors: dict, what: str) -> dict:
    name, how = what.split(":")
    t = dict(tensors)
    v = t[name]
    if how in ("int64", "int32", "bool"):
        t[name] = v.to(getattr(torch, how))
    elif how == "float64":
        t[name] = v.to(torch.float64)
    elif how == "float8":
        t[name] = v.to(torch.float8_e4m3fn)
    elif how in ("nan", "inf"):
        v = v.clone()
        v.view(-1)[0] = float(how)
        t[name] = v
    elif how == "zero":
        t[name] = torch.zeros_like(v)
    elif how == "huge":
        t[name] = torch.full_like(v, torch.iinfo(v.dtype).max if not v.is_floating_point() else 1e30)
    elif how == "negative":
        t[name] = -v
    elif how == "short":
        t[name] = v.reshape(-1)[: v.numel() // 2].clone()
    elif how == "shape":
        t[name] = torch.ones(32)
    return t


def ct_door(examples: int, folder: Path) -> None:
    from torchq.interop.compressed_tensors import load_compressed_tensors

    tensors, cfg = ct_base(folder)
    reference = CTModel()
    load_compressed_tensors(reference, _write_ct(folder / "base", tensors, cfg), dtype=torch.float32)
    expected = {n: (p.dequantize(torch.float32) if isinstance(p, torchq.AffineQuantizedTensor) else p.detach())
                for n, p in reference.named_parameters()}

    @hypothesis_settings(examples)
    @given(ct_mutation())
    def case(m) -> None:
        what, a, b, c = m
        case_dir = folder / "case"
        shutil.rmtree(case_dir, ignore_errors=True)
        t, conf = dict(tensors), json.loads(json.dumps(cfg))
        if what == "config":
            key, value = a
            if key in ("targets",):
                conf["config_groups"]["group_0"]["targets"] = value
            elif key == "ignore":
                conf["ignore"] = value
            elif key in ("format", "config_groups"):
                conf[key] = value
            else:
                conf["config_groups"]["group_0"]["weights"][key] = value
        elif what == "swap":
            t = _swap(t, a)
        path = _write_ct(case_dir, t, conf)
        if what in ("flip", "truncate"):
            _damage_safetensors(case_dir / "model.safetensors", m)
        model = CTModel()
        model.train(False)

        def state():
            return dict(model.state_dict(keep_vars=True))

        def check(m) -> None:
            finite_parameters(m)
            for n, p in m.named_parameters():  # a load is only correct with the same values (flips may hit padding)
                value = p.dequantize(torch.float32) if isinstance(p, torchq.AffineQuantizedTensor) else p.detach()
                assert value.shape == expected[n].shape, n
            m(torch.randn(2, 64))

        run_case("compressed-tensors", path, lambda: load_compressed_tensors(model, path, dtype=torch.float32), check, state)

    case()


def _damage(raw: bytearray, m, header_end: int) -> bytearray:
    """A flip (``("flip", position, byte, in the header?)``) or a truncation (``("truncate", fraction, ...)``) of ``raw``."""
    what, a, b, c = m
    if what == "truncate":
        return raw[:int(a * (len(raw) - 1))]
    pos = a % (header_end if c else len(raw))
    raw[pos] = b if raw[pos] != b else b ^ 0xFF
    return raw


def _damage_safetensors(f: Path, m) -> None:
    raw = bytearray(f.read_bytes())
    f.write_bytes(bytes(_damage(raw, m, 8 + struct.unpack("<Q", bytes(raw[:8]))[0])))


def _write_ct(folder: Path, tensors: dict, cfg: dict) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"quantization_config": cfg}))
    return folder


# -- torchq folders: transformers' from_pretrained(folder) with quant_method "torchq" ---------------
def torchq_base(folder: Path) -> Path:
    import transformers

    import torchq.hf

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder / "float")
    m = transformers.AutoModelForCausalLM.from_pretrained(folder / "float", quantization_config=torchq.hf.TorchqConfig("int4-g32"))
    m.save_pretrained(folder / "base")
    return folder / "base"


TQ_CONFIG_EDITS = [("version", 99), ("version", 0), ("version", "1"), ("version", None), ("format", "other"),
                   ("quant", "int3-bogus"), ("layout", {"type": "nope"}), ("quant", {"plan": {"re:(.|.)*Z": "int8wo"}})]
TQ_HEADER_EDITS = ["record shape", "part shape", "part dtype", "float dtype", "float shape", "version", "format", "codes short",
                   "scale nan", "float int64"]


def tq_mutation():
    flip = st.tuples(st.just("flip"), st.integers(0, 1 << 24), st.integers(0, 255), st.booleans())
    truncate = st.tuples(st.just("truncate"), st.floats(0, 1), st.just(0), st.just(False))
    config = st.tuples(st.just("config"), st.sampled_from(TQ_CONFIG_EDITS), st.just(0), st.just(False))
    header = st.tuples(st.just("header"), st.sampled_from(TQ_HEADER_EDITS), st.integers(0, 15), st.just(False))
    return st.one_of(flip, truncate, config, header)


def _rewrite_header(f: Path, edit: str, which: int) -> None:
    """Change the torchq header (and the tensors it describes) of ``f`` consistently, CRCs recomputed,
    so that only torchq's own semantic checks can refuse it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from torchq.checkpoint import codec

    with safe_open(str(f), "pt") as h:
        meta, tensors = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}
    header = json.loads(meta["torchq"])
    names = sorted(header["quantized"])
    name = names[which % len(names)]
    rec = header["quantized"][name]
    floats = sorted(header["float"])
    fname = floats[which % len(floats)]
    if edit == "record shape":
        rec["shape"] = [rec["shape"][0] // 2, rec["shape"][1]]
        for part, p in rec["parts"].items():
            key = f"{name}:{part}"
            if tensors[key].dim() and tensors[key].shape[0] == p["shape"][0] and p["shape"][0] > 1:
                tensors[key] = tensors[key][: p["shape"][0] // 2].clone()
                p["shape"] = list(tensors[key].shape)
                p["crc32"] = codec.tensor_crc32(tensors[key])
    elif edit == "part shape":
        key = f"{name}:scale"
        tensors[key] = tensors[key].reshape(-1)[:-1].clone()
        rec["parts"]["scale"].update(shape=list(tensors[key].shape), crc32=codec.tensor_crc32(tensors[key]))
    elif edit == "part dtype":
        key = f"{name}:scale"
        tensors[key] = tensors[key].to(torch.int64)  # (a float64 scale is a consistent file: it loads, with its values)
        rec["parts"]["scale"].update(dtype="int64", crc32=codec.tensor_crc32(tensors[key]))
    elif edit in ("float dtype", "float int64"):
        dt = torch.float64 if edit == "float dtype" else torch.int64
        tensors[fname] = tensors[fname].to(dt)
        header["float"][fname].update(dtype=str(dt).removeprefix("torch."), crc32=codec.tensor_crc32(tensors[fname]))
    elif edit == "float shape":
        tensors[fname] = tensors[fname].reshape(-1)[:-1].clone()
        header["float"][fname].update(shape=list(tensors[fname].shape), crc32=codec.tensor_crc32(tensors[fname]))
    elif edit == "version":
        header["version"] = 99
    elif edit == "format":
        header["format"] = "other"
    elif edit == "codes short":  # (any byte of a 4-bit bit stream is a valid code: no range edit is hostile here)
        key = f"{name}:codes"
        tensors[key] = tensors[key][:, :-1].clone()
        rec["parts"]["codes"].update(shape=list(tensors[key].shape), crc32=codec.tensor_crc32(tensors[key]))
    elif edit == "scale nan":
        key = f"{name}:scale"
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[0] = math.nan
        rec["parts"]["scale"]["crc32"] = codec.tensor_crc32(tensors[key])
    text = codec.dumps(header)
    meta.update(torchq=text, torchq_crc32=str(zlib.crc32(text.encode())))
    save_file(tensors, str(f), metadata=meta)


def torchq_door(examples: int, folder: Path) -> None:
    import transformers

    base = torchq_base(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.AutoModelForCausalLM.from_pretrained(base)
    expected = {n: (p.dequantize(torch.float32) if isinstance(p, torchq.AffineQuantizedTensor) else p.detach())
                for n, p in reference.named_parameters()}

    def check(m) -> None:  # CRC-protected: a load must give the saved values bit for bit
        got = {n: (p.dequantize(torch.float32) if isinstance(p, torchq.AffineQuantizedTensor) else p.detach())
               for n, p in m.named_parameters()}
        assert got.keys() == expected.keys()
        for n, v in got.items():
            assert torch.equal(v, expected[n]), f"{n} loaded with other values"

    @hypothesis_settings(examples)
    @given(tq_mutation())
    def case(m) -> None:
        if os.environ.get("TORCHQ_FUZZ_VERBOSE"):
            print(m, flush=True)
        what, a, b, c = m
        case_dir = folder / "case"
        shutil.rmtree(case_dir, ignore_errors=True)
        shutil.copytree(base, case_dir)
        f = case_dir / "model.safetensors"
        if what in ("flip", "truncate"):
            _damage_safetensors(f, m)
        elif what == "config":
            key, value = a
            conf = json.loads((case_dir / "config.json").read_text())
            conf["quantization_config"][key] = value
            (case_dir / "config.json").write_text(json.dumps(conf))
        else:
            _rewrite_header(f, a, b)
        run_case("torchq folder", case_dir, lambda: transformers.AutoModelForCausalLM.from_pretrained(case_dir), check)

    case()


def hostile_file(case: str, folder: str) -> str:
    """The file of one of issue 34's cases (benchmarks/bench_hostile_files.py), written into ``folder``."""
    path = Path(folder) / (case.replace(" ", "_").replace("^", "").replace("(", "").replace(")", "") + ".gguf")
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 2)
    arch = struct.pack("<Q", 20) + b"general.architecture" + struct.pack("<IQ", 8, 5) + b"llama"
    key = struct.pack("<Q", 21) + b"tokenizer.ggml.scores"
    if case.startswith("u8 array of"):
        count = 1 << 60 if case.endswith("2^60") else 10**6
        raw = head + arch + key + struct.pack("<IIQ", 9, 0, count)
        path.write_bytes(raw + b"\0" * (288 - len(raw)))
    elif case == "block_count 20000":
        write_gguf(path, block_count=20000)
    elif case.startswith("NaN scale"):
        write_gguf(path, nan="blk.0.attn_q.weight")
    elif case == "overlapping tensor data":
        write_gguf(path)
        raw = bytearray(path.read_bytes())
        at = _after(raw, b"blk.0.attn_k.weight") + 4 + 16 + 4
        first = _after(raw, b"blk.0.attn_q.weight") + 4 + 16 + 4
        raw[at:at + 8] = raw[first:first + 8]  # k's data offset = q's
        path.write_bytes(bytes(raw))
    elif case == "truncated file":
        write_gguf(path)
        raw = path.read_bytes()
        path.write_bytes(raw[: len(raw) // 2])
    return str(path)


DOORS = {"gguf": gguf_door, "compressed-tensors": ct_door, "torchq": torchq_door}


def main() -> None:
    door, examples = sys.argv[1], int(sys.argv[2])
    folder = Path(tempfile.mkdtemp(prefix="torchq-fuzz-"))
    try:
        cap_address_space()
        DOORS[door](examples, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    outcomes = {o: sum(1 for s in stats if s[1] == o) for o in ("loaded", "refused")}
    worst_t = max((s[2] for s in stats), default=0.0)
    worst_m = max((s[3] for s in stats), default=0)
    print(f"FUZZ {door}: {len(stats)} cases, {outcomes['loaded']} loaded, {outcomes['refused']} refused; slowest "
          f"{worst_t:.2f} s, most memory {worst_m / 2**20:.1f} MB over the start")


if __name__ == "__main__":
    main()
