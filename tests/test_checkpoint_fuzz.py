"""Fuzzing the checkpoint loaders: corrupted, truncated and tampered checkpoints never crash the
interpreter, never hang, and never load a silently wrong tensor.

Two formats are attacked:

* ``save_quantized`` safetensors files, loaded with ``load_quantized`` into a model built on the
  meta device, a float model, or an already-quantized model. Every outcome must be either a
  :class:`torchq.CheckpointError` that names the file, with the target model exactly as it was
  (same tensor objects, same bytes, meta tensors still meta), or a successful load whose every
  state-dict tensor is what the file says (checked by an independent reference decoder written
  below -- own safetensors parser, numpy bit unpacking, strict validation -- not torchq's codec;
  values are compared through ``PlainForm.dequantize``, the reference meaning of every layout) -- and, for corruptions that cannot change meaning
  (random byte flips, truncation), bit-identical to the saved model, outputs included.
* ``torch.save`` state dicts, loaded with ``torch.load(weights_only=True)``: quantized weights are
  rebuilt by ``torchq._rebuild_quantized_tensor``, which must reject corrupted ones.

Header mutations come in two flavours: with the header CRC left stale (the CRC check must catch
them) and with ``torchq_crc32`` (and, for data tampering, the part CRCs) recomputed, so the
deeper validation -- versions, dtypes, shapes, code ranges, finite scales, key sets -- is what
stands between the file and the model. A tampered-but-CRC-consistent file is a *different valid
checkpoint*: loading it may succeed, and then the result must match what the file describes.

Bugs this fuzzing found (spec numbers that were not strict ints, an unhashable saved layout
type, unknown spec fields) have named regression tests below.

Hangs: every load runs under a SIGALRM guard (a Python-level hang raises) and a faulthandler
backstop (a hang in C code kills the process with a traceback instead of stalling CI), and the
hypothesis ``deadline`` fails slow examples.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import io
import itertools
import json
import math
import re
import signal
import threading
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save
from torch import nn

import torchq
from torchq import AffineQuantizedTensor, CheckpointError, PlainForm, QuantSpec

# -- the models and configs under test ------------------------------------------------------------
CONFIGS: dict[str, tuple[Any, torch.dtype]] = {
    "int4_g32": (lambda: torchq.int4_weight_only(group_size=32), torch.bfloat16),
    "intx3": (lambda: torchq.intx_weight_only(bits=3), torch.bfloat16),
    "intx5_sym_packed": (
        lambda: torchq.intx_weight_only(
            bits=5, group_size=None, mapping_type=torchq.MappingType.SYMMETRIC, layout=torchq.layouts.PackedBitsLayout()
        ),
        torch.float32,
    ),
    "int8": (lambda: torchq.int8_weight_only(), torch.float32),
    "int8_dyn": (lambda: torchq.int8_dynamic_activation_int8_weight(), torch.bfloat16),
}
CONFIG_NAMES = sorted(CONFIGS)
TARGETS = ("meta", "float", "quantized", "quantized_other")
QUANTIZED_KEYS = ("0.weight", "2.weight", "4.weight")

FUZZ = dict(deadline=3000, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HANG_S = 30  # a single load taking this long is a hang


def build(dtype: torch.dtype, *, seed: int = 0, meta: bool = False, widths=(64, 96, 40, 24)) -> nn.Sequential:
    """Odd-ish sizes: 96x64 and 40x96 with bias, 24x40 without (a partial 32-wide group)."""
    a, b, c, d = widths
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("meta") if meta else contextlib.nullcontext():
            m = nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c), nn.ReLU(), nn.Linear(c, d, bias=False))
    return m.to(dtype)


def run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.FallbackWarning)  # PackedBitsLayout has no kernel: dequantize fallback
        return model(x)


def quantized(cfg_name: str, *, seed: int = 0) -> nn.Sequential:
    make, dtype = CONFIGS[cfg_name]
    m = build(dtype, seed=seed)
    torchq.quantize_(m, make())
    return m


@dataclass(repr=False)
class Saved:
    """One quantized model and its two checkpoints."""

    name: str
    dtype: torch.dtype
    model: nn.Module
    st_path: Path
    st_bytes: bytes
    pt_bytes: bytes
    x: torch.Tensor
    y: torch.Tensor

    def __repr__(self) -> str:
        return f"<saved {self.name}>"


class SavedSet(dict):
    def __repr__(self) -> str:  # keeps hypothesis' falsifying-example reports short
        return f"<saved checkpoints {sorted(self)}>"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt_fuzz")


@pytest.fixture(scope="module")
def saved(workdir) -> dict[str, Saved]:
    out = SavedSet()
    for name in CONFIG_NAMES:
        m = quantized(name)
        dtype = CONFIGS[name][1]
        path = workdir / f"{name}.safetensors"
        torchq.save_quantized(m, path)
        buf = io.BytesIO()
        torch.save(m.state_dict(), buf)
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
        y = run(m, x)
        out[name] = Saved(name, dtype, m, path, path.read_bytes(), buf.getvalue(), x, y)
        # Warm up (first loads/kernels pay one-off costs that should not count against deadlines).
        for kind in TARGETS:
            torchq.load_quantized(make_target(out[name], kind), path)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    return out


def make_target(s: Saved, kind: str) -> nn.Module:
    if kind == "meta":
        return build(s.dtype, meta=True)
    if kind == "float":
        return build(s.dtype, seed=1)
    if kind == "quantized":
        return quantized(s.name, seed=1)
    if kind == "quantized_other":  # quantized differently from the checkpoint: entries are replaced
        m = build(s.dtype, seed=1)
        torchq.quantize_(m, torchq.int8_weight_only() if s.name.startswith("int4") else torchq.int4_weight_only(group_size=32))
        return m
    raise AssertionError(kind)


# -- comparing model states ----------------------------------------------------------------------
def _raw(t: torch.Tensor) -> tuple:
    t = t.detach().cpu().contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return (t.dtype, tuple(t.shape), data)


def fingerprint(t: torch.Tensor) -> dict:
    """Everything observable about one state-dict tensor, as comparable values (bytes, not floats)."""
    fp: dict[str, Any] = {"type": type(t).__name__, "dtype": t.dtype, "shape": tuple(t.shape),
                          "requires_grad": t.requires_grad}
    if isinstance(t, AffineQuantizedTensor):
        p = t.to_plain()
        fp.update(
            kind="aqt", device=p.device.type, transposed=t.transposed, label=t.label, spec=t.spec.to_json(),
            layout=t.quant_layout.to_json(), act_quant=None if t.act_quant is None else t.act_quant.to_json(),
            config=None if t.config is None else t.config.to_json(),
            codes=_raw(p.codes), scale=_raw(p.scale), zero_point=None if p.zero_point is None else _raw(p.zero_point),
            values=_raw(t.dequantize()),
        )
    elif t.device.type == "meta":
        fp.update(kind="meta")
    else:
        fp.update(kind="float", device=t.device.type, values=_raw(t))
    return fp


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def state(model: nn.Module, *, ids: bool) -> dict[str, dict]:
    out = {}
    for name, t in model_tensors(model).items():
        fp = fingerprint(t)
        if ids:
            fp["id"] = id(t)
        out[name] = fp
    return out


def assert_same_state(got: dict[str, dict], want: dict[str, dict], what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: state-dict keys {sorted(got)} != {sorted(want)}"
    for name in want:
        diff = sorted(k for k in set(got[name]) | set(want[name]) if got[name].get(k) != want[name].get(k))
        assert not diff, f"{what}: {name!r} differs in {diff}"


# -- safetensors files as (header, data) -----------------------------------------------------------
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}


class StFile:
    """A safetensors file opened for surgery: 8-byte little-endian header length, JSON header, data."""

    def __init__(self, blob: bytes) -> None:
        n = int.from_bytes(blob[:8], "little")
        self.header: dict = json.loads(blob[8 : 8 + n])
        self.data = bytearray(blob[8 + n :])

    @property
    def meta(self) -> dict:
        return self.header["__metadata__"]

    def tq(self) -> dict:
        return json.loads(self.meta["torchq"])

    def set_tq(self, tq: dict | str, *, fix_crc: bool = True) -> None:
        text = tq if isinstance(tq, str) else json.dumps(tq, sort_keys=True, separators=(",", ":"))
        self.meta["torchq"] = text
        if fix_crc:
            self.meta["torchq_crc32"] = str(zlib.crc32(text.encode()))

    def keys(self) -> list[str]:
        return [k for k in self.header if k != "__metadata__"]

    def span(self, key: str) -> tuple[int, int]:
        s, e = self.header[key]["data_offsets"]
        return s, e

    def tensor(self, key: str) -> torch.Tensor:
        """A copy of one stored tensor, decoded without safetensors/torchq."""
        entry = self.header[key]
        dtype, shape = _ST_DTYPES[entry["dtype"]], entry["shape"]
        s, e = self.span(key)
        if e == s:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data[s:e]), dtype=dtype).reshape(shape)

    def put(self, key: str, t: torch.Tensor) -> None:
        """Overwrite a tensor's bytes in place (same byte size)."""
        s, e = self.span(key)
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert len(raw) == e - s
        self.data[s:e] = raw

    def fix_data_crc(self, key: str) -> None:
        """Recompute the torchq CRC of one stored tensor (a float entry or a quantized part) and the header CRC."""
        tq = self.tq()
        crc = zlib.crc32(self.data[slice(*self.span(key))])
        if key in tq["float"]:
            tq["float"][key]["crc32"] = crc
        else:
            name, part = key.rsplit(":", 1)
            tq["quantized"][name]["parts"][part]["crc32"] = crc
        self.set_tq(tq)

    def to_bytes(self) -> bytes:
        h = json.dumps(self.header).encode()
        h += b" " * (8 - len(h) % 8)  # at least one byte of the whitespace padding safetensors allows
        return len(h).to_bytes(8, "little") + h + bytes(self.data)


def st_rewrite(blob: bytes, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None) -> bytes:
    """The same file with tensors dropped/added and the torchq header left as it was."""
    f = StFile(blob)
    tensors = {k: f.tensor(k) for k in f.keys() if k not in drop}
    tensors.update(add or {})
    return st_save(tensors, metadata=dict(f.meta))


# -- the reference decoder: what a file *says*, independent of torchq's codec --------------------
class MustReject(AssertionError):
    """The checkpoint is invalid, yet the loader accepted it."""


def _require(cond: bool, why: str) -> None:
    if not cond:
        raise MustReject(why)


def _strict_int(v: Any) -> bool:
    return type(v) is int


_FLOAT_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.float64}


def dtype_named(name: Any) -> torch.dtype | None:
    """The torch dtype a JSON dtype name means (torch's aliases count: "float" is float32, "half" float16)."""
    d = getattr(torch, name, None) if isinstance(name, str) else None
    return d if isinstance(d, torch.dtype) else None
_CODE_DTYPES = {torch.uint8, torch.int8}


def unpack_reference(packed: torch.Tensor, bits: int, k: int) -> np.ndarray:
    """One big-endian bit stream per row: value j is stream bits [j*bits, (j+1)*bits)."""
    a = packed.numpy()
    stream = np.unpackbits(a, axis=1)[:, : k * bits].reshape(a.shape[0], k, bits).astype(np.int64)
    return (stream << np.arange(bits - 1, -1, -1, dtype=np.int64)).sum(-1)


@dataclass
class RefWeight:
    shape: tuple[int, int]  # logical
    dtype: torch.dtype
    transposed: bool
    spec: dict
    codes: np.ndarray
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    act_quant: Any
    label: Any


def reference_weight(rec: Any, parts: dict[str, torch.Tensor], name: str) -> RefWeight:
    """Decode a quantized-weight record + its part tensors, or raise MustReject if the loader must
    refuse it. Deliberately strict: only exact JSON ints/bools/strings are meaningful."""
    _require(isinstance(rec, dict), f"{name}: record is not an object")
    _require(rec.get("format") == "torchq.aqt" and rec.get("version") == 1 and _strict_int(rec.get("version")),
             f"{name}: format/version")
    shape = rec.get("shape")
    _require(isinstance(shape, list) and len(shape) == 2 and all(_strict_int(s) and s > 0 for s in shape), f"{name}: shape")
    n, k = shape
    _require(dtype_named(rec.get("dtype")) in _FLOAT_DTYPES, f"{name}: dtype {rec.get('dtype')!r}")
    _require(isinstance(rec.get("transposed"), bool), f"{name}: transposed")
    spec = rec.get("spec")
    _require(isinstance(spec, dict) and set(spec) == {"block_size", "quant_min", "quant_max", "zero_point_domain"}, f"{name}: spec")
    qmin, qmax, block, domain = spec["quant_min"], spec["quant_max"], spec["block_size"], spec["zero_point_domain"]
    _require(_strict_int(qmin) and _strict_int(qmax) and qmin < qmax, f"{name}: spec range {qmin!r}, {qmax!r}")
    _require((-128 <= qmin < 0 and qmax <= 127) or (0 <= qmin and qmax <= 255), f"{name}: spec range not 8-bit")
    _require(domain in ("none", "int", "float"), f"{name}: domain {domain!r}")
    _require(domain != "none" or (qmax + qmin + 1) // 2 == 0, f"{name}: domain none needs a centred range")
    _require(isinstance(block, list) and len(block) == 2 and all(_strict_int(b) and b > 0 for b in block), f"{name}: block")
    code_dtype = torch.int8 if qmin < 0 else torch.uint8
    bits = max(1, math.ceil(math.log2(qmax - qmin + 1)))
    grid = [-(-n // block[0]), -(-k // block[1])]
    encoding = rec.get("codes_encoding")
    if encoding == "bitstream":
        _require(bits <= 7, f"{name}: bitstream with {bits} bits")
        want = {"codes": (torch.uint8, [n, -(-k // 8) * bits])}
    else:
        _require(encoding == "bytes", f"{name}: encoding {encoding!r}")
        want = {"codes": (code_dtype, [n, k])}
    want["scale"] = (None, grid)
    if domain != "none":
        want["zero_point"] = (None, grid)
    rparts = rec.get("parts")
    _require(isinstance(rparts, dict) and set(rparts) == set(want) == set(parts), f"{name}: part names")
    for pname, (dtype, pshape) in want.items():
        p, t = rparts[pname], parts[pname]
        _require(isinstance(p, dict) and p.get("shape") == pshape == list(t.shape), f"{name}: {pname} shape")
        _require(dtype_named(p.get("dtype")) == t.dtype, f"{name}: {pname} dtype {p.get('dtype')!r} vs {t.dtype}")
        _require(dtype is None or t.dtype == dtype, f"{name}: {pname} must be {dtype}")
        crc = p.get("crc32")
        _require(crc is not None and crc == zlib.crc32(_raw(t)[2]), f"{name}: {pname} crc32 (required)")
        _require(t.is_contiguous() and t.storage_offset() == 0
                 and t.untyped_storage().nbytes() == t.numel() * t.element_size(), f"{name}: {pname} own storage")
    scale, zero = parts["scale"], parts.get("zero_point")
    _require(scale.is_floating_point(), f"{name}: scale dtype")
    _require(bool(torch.isfinite(scale.float()).all()), f"{name}: non-finite scale")
    if zero is not None:
        _require(zero.is_floating_point() == (domain == "float") and zero.dtype != torch.bool, f"{name}: zero_point dtype")
        if zero.is_floating_point():
            _require(bool(torch.isfinite(zero.float()).all()), f"{name}: non-finite zero_point")
    if encoding == "bitstream":
        codes = unpack_reference(parts["codes"], bits, k) + qmin
    else:
        codes = parts["codes"].numpy().astype(np.int64)
    _require(bool(((codes >= qmin) & (codes <= qmax)).all()), f"{name}: codes outside [{qmin}, {qmax}]")
    logical = (k, n) if rec["transposed"] else (n, k)
    return RefWeight(logical, dtype_named(rec["dtype"]), rec["transposed"], spec, codes, scale, zero,
                     rec.get("act_quant"), rec.get("label"))


def assert_matches_reference(w: torch.Tensor, ref: RefWeight, name: str) -> None:
    assert isinstance(w, AffineQuantizedTensor), f"{name}: loaded a {type(w).__name__}, the file holds a quantized weight"
    assert tuple(w.shape) == ref.shape and w.dtype == ref.dtype and w.transposed == ref.transposed, name
    assert w.spec.to_json() == ref.spec, f"{name}: spec {w.spec.to_json()} != file {ref.spec}"
    act = ref.act_quant
    if isinstance(act, dict):  # activation_from_json fills omitted fields with their defaults
        act = {"quant_min": -127, "quant_max": 127, "eps": 1e-5, **act}
    assert (None if w.act_quant is None else w.act_quant.to_json()) == act, f"{name}: act_quant"
    assert w.label == ref.label, f"{name}: label"
    p = w.to_plain()
    assert np.array_equal(p.codes.to(torch.int64).numpy(), ref.codes), f"{name}: codes differ from the file"
    assert _raw(p.scale) == _raw(ref.scale), f"{name}: scale differs from the file"
    assert (p.zero_point is None) == (ref.zero_point is None), name
    if ref.zero_point is not None:
        assert _raw(p.zero_point) == _raw(ref.zero_point), f"{name}: zero_point differs from the file"
    expect = PlainForm(torch.from_numpy(ref.codes).to(p.codes.dtype), ref.scale, ref.zero_point, QuantSpec.from_json(ref.spec))
    values = expect.dequantize(ref.dtype)
    assert _raw(w.dequantize()) == _raw(values.t() if ref.transposed else values), f"{name}: dequantized values"


def assert_loaded_as_file_says(model: nn.Module, blob: bytes, target_state: dict[str, dict]) -> None:
    """After a successful load, every model tensor is exactly what the (possibly tampered) file describes."""
    f = StFile(blob)
    tq = json.loads(f.meta["torchq"])
    _require(str(zlib.crc32(f.meta["torchq"].encode())) == f.meta.get("torchq_crc32"), "header crc32")
    _require(isinstance(tq, dict) and tq.get("format") == "torchq.checkpoint" and tq.get("version") == 1
             and _strict_int(tq.get("version")), "file format/version")
    qrecs, floats, aliases = tq.get("quantized"), tq.get("float"), tq.get("aliases")
    _require(all(isinstance(x, dict) for x in (qrecs, floats, aliases)), "header sections")
    stored = set(f.keys())
    expected = set(floats) | {f"{n}:{p}" for n, r in qrecs.items() for p in (r.get("parts") or {})}
    _require(expected == stored, f"stored tensors {sorted(stored ^ expected)} do not match the header")
    tensors = model_tensors(model)
    ckpt_names = set(qrecs) | set(floats) | set(aliases)
    _require(ckpt_names == set(tensors), f"strict load with key sets {sorted(ckpt_names ^ set(tensors))} differing")
    for name, t in tensors.items():
        src = aliases.get(name, name)
        _require(isinstance(src, str) and (src in qrecs or src in floats), f"{name}: alias to nothing")
        if src in qrecs:
            parts = {p: f.tensor(f"{src}:{p}") for p in qrecs[src].get("parts") or {}}
            assert_matches_reference(t, reference_weight(qrecs[src], parts, src), name)
            continue
        entry, raw = floats[src], f.tensor(src)
        _require(isinstance(entry, dict) and entry.get("shape") == list(raw.shape)
                 and dtype_named(entry.get("dtype")) == raw.dtype, f"{src}: float entry")
        _require(entry.get("crc32") is not None and entry["crc32"] == zlib.crc32(_raw(raw)[2]), f"{src}: crc32 (required)")
        assert not isinstance(t, AffineQuantizedTensor) and t.device.type == "cpu", name
        before = target_state[name]
        in_place = before["kind"] == "float"
        assert t.dtype == (before["dtype"] if in_place else raw.dtype), f"{name}: dtype"
        assert _raw(t) == _raw(raw.to(t.dtype)), f"{name}: values differ from the file"


# -- running one load ------------------------------------------------------------------------------
class Hang(BaseException):  # BaseException: no loader `except Exception` may swallow it
    pass


@contextlib.contextmanager
def no_hang(seconds: float = HANG_S):
    """Raise Hang if the block runs longer than ``seconds`` (Python-level), and kill the process
    with a traceback (faulthandler) if it is stuck in C code for three times that."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise Hang(f"load did not finish within {seconds}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds * 3, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        faulthandler.cancel_dump_traceback_later()


_counter = itertools.count()


def _event(what: str) -> None:
    if currently_in_test_context():
        event(what)


def _gist(msg: str, path: Path) -> str:
    """The kind of an error, for hypothesis' statistics (--hypothesis-show-statistics)."""
    msg = msg.replace(str(path), "F")
    msg = re.sub(r"'[^']*'", "'…'", msg)
    msg = re.sub(r"0x[0-9a-f]+", "0xH", msg)
    msg = re.sub(r"\d+", "N", msg)
    return msg[:70]


def write(workdir: Path, blob: bytes) -> Path:
    path = workdir / f"fuzz-{next(_counter)}.safetensors"
    path.write_bytes(blob)
    return path


def load_and_check(s: Saved, blob: bytes, target: str, workdir: Path, *, same_as_saved: bool) -> str:
    """Load ``blob`` into a fresh ``target`` model and check the outcome (see module doc).

    ``same_as_saved``: the file cannot legitimately mean anything but the saved model (byte flips,
    truncation), so a successful load must reproduce it exactly. Returns "rejected" or "loaded"."""
    model = make_target(s, target)
    before = state(model, ids=True)
    path = write(workdir, blob)
    try:
        with no_hang():
            torchq.load_quantized(model, path)
    except CheckpointError as e:
        assert str(path) in str(e), f"error does not name the file: {e}"
        assert_same_state(state(model, ids=True), before, f"model changed by a failed load ({e})")
        _event(f"rejected: {_gist(str(e), path)}")
        return "rejected"
    finally:
        path.unlink()
    try:
        assert_loaded_as_file_says(model, blob, before)
    except MustReject as e:
        raise AssertionError(f"loader accepted an invalid checkpoint: {e}") from None
    assert not any(t.device.type == "meta" for t in model_tensors(model).values())
    _event("loaded")
    if same_as_saved:
        assert_same_state(state(model, ids=False), state(s.model, ids=False), "a corrupted file loaded with different tensors")
        assert torch.equal(run(model, s.x), s.y), "a corrupted file loaded with different outputs"
    return "loaded"


# -- strategies ------------------------------------------------------------------------------------
configs = st.sampled_from(CONFIG_NAMES)
targets = st.sampled_from(TARGETS)


def draw_flips(data, blob: bytes, *, safetensors: bool = True) -> bytes:
    """Xor one to four bytes, anywhere / (safetensors:) in the length prefix, JSON header or tensor data."""
    n_header = 8 + int.from_bytes(blob[:8], "little")
    regions = ["anywhere", "header", "header", "data", "prefix"] if safetensors else ["anywhere"]
    region = data.draw(st.sampled_from(regions), label="region")
    lo, hi = {"anywhere": (0, len(blob)), "header": (8, n_header), "data": (n_header, len(blob)), "prefix": (0, 8)}[region]
    out = bytearray(blob)
    for pos, mask in data.draw(st.lists(st.tuples(st.integers(lo, hi - 1), st.integers(1, 255)), min_size=1, max_size=4),
                               label="flips"):
        out[pos] ^= mask
    return bytes(out)


def draw_truncation(data, blob: bytes) -> bytes:
    n_header = 8 + int.from_bytes(blob[:8], "little")
    cut = data.draw(st.one_of(st.integers(0, len(blob) - 1), st.integers(max(0, n_header - 16), min(len(blob) - 1, n_header + 16))),
                    label="length")
    return blob[:cut]


_FIELD_NAMES = ["format", "version", "shape", "dtype", "transposed", "spec", "layout", "act_quant", "config", "label",
                "codes_encoding", "parts", "codes", "scale", "zero_point", "crc32", "block_size", "quant_min", "quant_max",
                "zero_point_domain", "type", "quantized", "float", "aliases", "shard", "user", "eps", "0.weight", "2.weight",
                "4.weight", "0.bias", "2.bias", "x"]
_STRINGS = ["float32", "bfloat16", "float16", "float64", "half", "double", "long", "int8", "uint8", "int16", "int32", "int64",
            "bool", "complex64", "float8_e4m3fn", "Tensor", "__class__", "", "none", "int", "float", "bogus", "bitstream", "bytes", "packed",
            "torchq.aqt", "torchq.checkpoint", "per_token_int8", "plain", "int4_cpu", "packed_bits", "nope",
            "Int4WeightOnlyConfig", "IntxWeightOnlyConfig", "Int8WeightOnlyConfig", "0", "2", "0.weight", "0.bias",
            "asymmetric", "symmetric", "QuantConfig"]
_HUGE = "\x00huge\x00"  # serialized as the JSON number 1e400, which Python parses to inf

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2, -1, 2**31, 2**32, 2**63]),
    st.floats(), st.sampled_from([0.5, 1e-300, 15.0, 1e308, _HUGE]), st.sampled_from(_STRINGS),
    st.text(st.characters(codec="utf-8"), max_size=6),
)
json_values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=3), c, max_size=3),
    max_leaves=6,
)


def json_paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += json_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += json_paths(v, prefix + (i,))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(obj, path[:-1])[path[-1]] = value
    return obj


def _tweak(data, old: Any) -> Any:
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return data.draw(st.sampled_from([old + 1, old - 1, old + 2, -old, 2 * old, old + 2**32, float(old), str(old), old + 0.5,
                                          bool(old), _HUGE]))
    if isinstance(old, float):
        return data.draw(st.sampled_from([-old, old * 2, 0.0, float("nan"), float("inf"), _HUGE, int(old) if math.isfinite(old) else 0]))
    if isinstance(old, str):
        return data.draw(st.sampled_from(_STRINGS) | st.sampled_from([old + "x", old[:-1], old.upper(), " " + old]))
    if isinstance(old, list):
        return data.draw(st.sampled_from([old[:-1], old + old[-1:], old[::-1], old + [0], [old]]))
    if isinstance(old, dict) and old:
        key = data.draw(st.sampled_from(sorted(old)))
        new = dict(old)
        new[data.draw(st.sampled_from(_FIELD_NAMES), label="renamed")] = new.pop(key)
        return new
    return data.draw(json_values)


def mutate_json(data, obj: Any) -> Any:
    """One to three random edits at random depths: replace, tweak, delete or add a field."""
    obj = copy.deepcopy(obj)
    for _ in range(data.draw(st.integers(1, 3), label="n_edits")):
        path = data.draw(st.sampled_from(json_paths(obj)), label="path")
        op = data.draw(st.sampled_from(["tweak", "tweak", "replace", "delete", "add"]), label="op")
        node = _get(obj, path)
        if op == "tweak":
            obj = _set(obj, path, _tweak(data, node))
        elif op == "replace":
            obj = _set(obj, path, data.draw(json_values, label="value"))
        elif op == "delete" and path:
            parent = _get(obj, path[:-1])
            del parent[path[-1]]
        elif op == "add" and isinstance(node, dict):
            node[data.draw(st.sampled_from(_FIELD_NAMES) | st.text(max_size=4), label="key")] = data.draw(json_values, label="value")
        elif op == "add" and isinstance(node, list):
            node.insert(data.draw(st.integers(0, len(node))), data.draw(json_values, label="value"))
    return obj


def dump_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=False, allow_nan=True).replace(json.dumps(_HUGE), "1e400")


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def draw_header_mutation(data, blob: bytes) -> tuple[bytes, bool]:
    """The file with a semantically mutated torchq header; returns ``(blob, crc_fixed)``."""
    f = StFile(blob)
    text = dump_json(mutate_json(data, f.tq()))
    if data.draw(st.booleans(), label="raw_char_edit"):  # also break the JSON text itself
        i = data.draw(st.integers(0, len(text) - 1))
        text = text[:i] + data.draw(st.characters(codec="utf-8")) + text[i + 1 :]
    fix_crc = data.draw(st.sampled_from([True, True, True, False]), label="fix_crc")
    f.set_tq(text, fix_crc=fix_crc)
    return f.to_bytes(), fix_crc


# -- safetensors fuzz ------------------------------------------------------------------------------
def _fuzz_byte_flips(saved, workdir, data):
    s = saved[data.draw(configs, label="config")]
    blob = draw_flips(data, s.st_bytes)
    load_and_check(s, blob, data.draw(targets, label="target"), workdir, same_as_saved=True)


@settings(max_examples=120, **FUZZ)
@given(data=st.data())
def test_fuzz_safetensors_byte_flips(saved, workdir, data):
    _fuzz_byte_flips(saved, workdir, data)


@pytest.mark.slow
@settings(max_examples=1000, **FUZZ)
@given(data=st.data())
def test_fuzz_safetensors_byte_flips_long(saved, workdir, data):
    _fuzz_byte_flips(saved, workdir, data)


@settings(max_examples=60, **FUZZ)
@given(data=st.data())
def test_fuzz_safetensors_truncation(saved, workdir, data):
    s = saved[data.draw(configs, label="config")]
    blob = draw_truncation(data, s.st_bytes)
    assert load_and_check(s, blob, data.draw(targets, label="target"), workdir, same_as_saved=True) == "rejected"


def _fuzz_header(saved, workdir, data):
    s = saved[data.draw(configs, label="config")]
    blob, crc_fixed = draw_header_mutation(data, s.st_bytes)
    new_text, old_text = StFile(blob).meta["torchq"], StFile(s.st_bytes).meta["torchq"]
    outcome = load_and_check(s, blob, data.draw(targets, label="target"), workdir, same_as_saved=_same_json(new_text, old_text))
    if not crc_fixed and new_text != old_text:
        assert outcome == "rejected", "an edited header with a stale crc32 was accepted"


@settings(max_examples=150, **FUZZ)
@given(data=st.data())
def test_fuzz_safetensors_header_mutations(saved, workdir, data):
    _fuzz_header(saved, workdir, data)


@pytest.mark.slow
@settings(max_examples=2000, **FUZZ)
@given(data=st.data())
def test_fuzz_safetensors_header_mutations_long(saved, workdir, data):
    _fuzz_header(saved, workdir, data)


def _fuzz_tampered_data(saved, workdir, data):
    """Change a stored tensor's bytes and recompute its CRC (and the header CRC): the file is
    consistent, so range/finiteness checks decide; a load must match the file exactly."""
    s = saved[data.draw(configs, label="config")]
    f = StFile(s.st_bytes)
    key = data.draw(st.sampled_from(sorted(f.keys())), label="tensor")
    t = f.tensor(key)
    flat = t.reshape(-1).view(torch.uint8).clone()
    for pos, mask in data.draw(st.lists(st.tuples(st.integers(0, flat.numel() - 1), st.integers(1, 255)), min_size=1, max_size=3)):
        flat[pos] ^= mask
    f.put(key, flat)
    f.fix_data_crc(key)
    load_and_check(s, f.to_bytes(), data.draw(targets, label="target"), workdir, same_as_saved=False)


@settings(max_examples=80, **FUZZ)
@given(data=st.data())
def test_fuzz_safetensors_tampered_data_with_valid_crcs(saved, workdir, data):
    _fuzz_tampered_data(saved, workdir, data)


@pytest.mark.slow
@settings(max_examples=800, **FUZZ)
@given(data=st.data())
def test_fuzz_safetensors_tampered_data_with_valid_crcs_long(saved, workdir, data):
    _fuzz_tampered_data(saved, workdir, data)


# -- torch.save fuzz -------------------------------------------------------------------------------
def _walk(obj: Any, depth: int = 0):
    """Every AffineQuantizedTensor inside a loaded object (dicts, lists, tuples)."""
    if isinstance(obj, AffineQuantizedTensor):
        yield obj
    elif depth < 20 and isinstance(obj, dict):
        for v in obj.values():
            yield from _walk(v, depth + 1)
    elif depth < 20 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _walk(v, depth + 1)


def _aqt_fp(t: AffineQuantizedTensor) -> dict:
    fp = fingerprint(t)
    for k in ("type", "requires_grad", "layout"):  # the pickle's is_param flag is not CRC-protected
        fp.pop(k)
    return fp


def _fuzz_torch_save(saved, data):
    # torch's zip reader does not verify the CRCs of storages, so a flipped byte in a float tensor
    # (a bias) loads silently changed: that is torch.load's domain, not torchq's. What torchq owns --
    # quantized weights, rebuilt by torchq._rebuild_quantized_tensor from a CRC-checked record and
    # CRC-checked parts -- must be rejected or bit-identical; and nothing but an Exception may escape.
    s = saved[data.draw(configs, label="config")]
    if data.draw(st.booleans(), label="flip"):
        blob = draw_flips(data, s.pt_bytes, safetensors=False)
    else:
        blob = s.pt_bytes[: data.draw(st.integers(0, len(s.pt_bytes) - 1), label="length")]
    try:
        with no_hang(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 67": a flipped protocol byte
            out = torch.load(io.BytesIO(blob), weights_only=True)
    except Exception as e:  # any ordinary exception is a clean refusal
        _event(f"torch.load raised {type(e).__name__}" + (f": {_gist(str(e), Path('F'))}" if isinstance(e, CheckpointError) else ""))
        return
    originals = {t.label: t for t in model_tensors(s.model).values() if isinstance(t, AffineQuantizedTensor)}
    _event("torch.load returned")
    for w in _walk(out):
        assert w.label in originals, f"a quantized tensor with an unknown label {w.label!r} came back"
        orig = originals[w.label]
        assert w.to_plain().equal(orig.to_plain()), f"quantized weight {w.label!r} came back changed"
        assert torch.equal(w.dequantize(), orig.dequantize())
        assert_same_state({"w": _aqt_fp(w)}, {"w": _aqt_fp(orig)}, "torch.load of a corrupted file")


@settings(max_examples=100, **FUZZ)
@given(data=st.data())
def test_fuzz_torch_save_corruption(saved, data):
    _fuzz_torch_save(saved, data)


@pytest.mark.slow
@settings(max_examples=1000, **FUZZ)
@given(data=st.data())
def test_fuzz_torch_save_corruption_long(saved, data):
    _fuzz_torch_save(saved, data)


def _reduce_args(w: AffineQuantizedTensor) -> list:
    fn, args = w.__reduce_ex__(2)
    assert fn is torchq._rebuild_quantized_tensor
    return list(args)


def _fuzz_pickle_record(saved, data):
    """Call the pickle rebuild function with a mutated record (CRC recomputed or not) and mutated parts."""
    s = saved[data.draw(configs, label="config")]
    key = data.draw(st.sampled_from(QUANTIZED_KEYS), label="weight")
    version, text, crc, parts, is_param = _reduce_args(model_tensors(s.model)[key])
    record = json.loads(text)
    parts = {k: v.clone() for k, v in parts.items()}
    what = data.draw(st.sampled_from(["record", "record", "parts", "version"]), label="what")
    fixed = True
    if what == "record":
        text = dump_json(mutate_json(data, record))
        fixed = data.draw(st.sampled_from([True, True, False]), label="fix_crc")
        crc = zlib.crc32(text.encode()) if fixed else crc
    elif what == "parts":
        pname = data.draw(st.sampled_from(sorted(parts)), label="part")
        op = data.draw(st.sampled_from(["flip", "flip_fix_crc", "drop", "dtype", "reshape"]), label="op")
        t = parts[pname]
        if op.startswith("flip"):
            flat = t.reshape(-1).view(torch.uint8)
            flat[data.draw(st.integers(0, flat.numel() - 1))] ^= data.draw(st.integers(1, 255))
            if op == "flip_fix_crc":
                record["parts"][pname]["crc32"] = zlib.crc32(_raw(t)[2])
                text = json.dumps(record)
                crc = zlib.crc32(text.encode())
        elif op == "drop":
            del parts[pname]
        elif op == "dtype":
            parts[pname] = t.to(data.draw(st.sampled_from([torch.float32, torch.float16, torch.int8, torch.uint8, torch.int32])))
        else:
            parts[pname] = t.reshape(-1) if data.draw(st.booleans()) else t.t()
    else:
        version = data.draw(st.sampled_from([0, 2, 3, -1, 2**40, "1", None, 1.0, True]))
    try:
        with no_hang():
            w = torchq._rebuild_quantized_tensor(version, text, crc, parts, is_param)
    except CheckpointError:
        return
    assert fixed, "a record with a stale crc32 was accepted"
    try:
        ref = reference_weight(json.loads(text), parts, key)
    except MustReject as e:
        raise AssertionError(f"_rebuild_quantized_tensor accepted an invalid record/parts: {e}") from None
    assert_matches_reference(w, ref, key)


@settings(max_examples=120, **FUZZ)
@given(data=st.data())
def test_fuzz_pickle_rebuild_record(saved, data):
    _fuzz_pickle_record(saved, data)


@pytest.mark.slow
@settings(max_examples=2000, **FUZZ)
@given(data=st.data())
def test_fuzz_pickle_rebuild_record_long(saved, data):
    _fuzz_pickle_record(saved, data)


# -- named cases -----------------------------------------------------------------------------------
def expect_error(s: Saved, blob: bytes, target: str, workdir: Path, *needles: str) -> str:
    """Load must fail with a CheckpointError containing every needle; the model stays as it was."""
    model = make_target(s, target)
    before = state(model, ids=True)
    path = write(workdir, blob)
    with no_hang(), pytest.raises(CheckpointError) as info:
        torchq.load_quantized(model, path)
    msg = str(info.value)
    for needle in (str(path), *needles):
        assert needle in msg, f"{needle!r} not in error message: {msg}"
    assert_same_state(state(model, ids=True), before, "model changed by a failed load")
    if target == "meta":
        assert all(t.device.type == "meta" for t in model_tensors(model).values())
    path.unlink()
    return msg


@pytest.mark.parametrize("cfg", CONFIG_NAMES)
@pytest.mark.parametrize("target", TARGETS)
def test_clean_checkpoint_loads_exactly(saved, workdir, cfg, target):
    """The oracle's baseline: an untouched file loads bit-identically into every kind of model."""
    s = saved[cfg]
    assert load_and_check(s, s.st_bytes, target, workdir, same_as_saved=True) == "loaded"


def test_whitespace_padding_flip_loads_exactly(saved, workdir):
    s = saved["int4_g32"]
    blob = bytearray(StFile(s.st_bytes).to_bytes())
    n_header = 8 + int.from_bytes(blob[:8], "little")
    assert blob[n_header - 1 : n_header] == b" ", "expected space padding after the JSON header"
    blob[n_header - 1] ^= ord(" ") ^ ord("\n")
    assert load_and_check(s, bytes(blob), "meta", workdir, same_as_saved=True) == "loaded"


@pytest.mark.parametrize("target", TARGETS)
def test_truncated_file(saved, workdir, target):
    s = saved["int4_g32"]
    n_header = 8 + int.from_bytes(s.st_bytes[:8], "little")
    for cut in (0, 5, 8, n_header // 2, n_header, n_header + 10, len(s.st_bytes) - 1):
        expect_error(s, s.st_bytes[:cut], target, workdir)


@pytest.mark.parametrize("target", TARGETS)
def test_header_crc_mismatch(saved, workdir, target):
    s = saved["intx3"]
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["float"]["0.bias"]["crc32"] ^= 1
    f.set_tq(tq, fix_crc=False)
    expect_error(s, f.to_bytes(), target, workdir, "torchq header is corrupted", "crc32 mismatch")
    f = StFile(s.st_bytes)
    f.meta["torchq_crc32"] = str(int(f.meta["torchq_crc32"]) ^ 4)
    expect_error(s, f.to_bytes(), target, workdir, "torchq header is corrupted")


@pytest.mark.parametrize("target", TARGETS)
def test_unknown_file_format_version(saved, workdir, target):
    s = saved["int8"]
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["version"] = 2
    f.set_tq(tq)
    expect_error(s, f.to_bytes(), target, workdir, "checkpoint format version 2", "upgrade")
    for bad in (0, -1, "1", True, 1.0, None):
        tq["version"] = bad
        f.set_tq(tq)
        expect_error(s, f.to_bytes(), target, workdir, "version")


def test_unknown_file_format(saved, workdir):
    s = saved["int8"]
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["format"] = "someone.else"
    f.set_tq(tq)
    expect_error(s, f.to_bytes(), "meta", workdir, "someone.else")


@pytest.mark.parametrize("target", TARGETS)
def test_record_version_too_new(saved, workdir, target):
    s = saved["int4_g32"]
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["quantized"]["2.weight"]["version"] = 2
    f.set_tq(tq)
    expect_error(s, f.to_bytes(), target, workdir, "'2.weight'", "version 2", "upgrade")


@pytest.mark.parametrize("target", TARGETS)
def test_part_dtype_differs_between_header_and_data(saved, workdir, target):
    s = saved["int4_g32"]
    # (a) the torchq record says float16, the stored scale is bfloat16
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["quantized"]["0.weight"]["parts"]["scale"]["dtype"] = "float16"
    f.set_tq(tq)
    expect_error(s, f.to_bytes(), target, workdir, "'0.weight'", "'scale'", "bfloat16", "float16")
    # (b) the safetensors entry says F16 (same size), the torchq record says bfloat16
    f = StFile(s.st_bytes)
    f.header["0.weight:scale"]["dtype"] = "F16"
    expect_error(s, f.to_bytes(), target, workdir, "'0.weight'", "'scale'", "float16", "bfloat16")
    # (c) codes stored as int8 where a bitstream must be uint8
    f = StFile(s.st_bytes)
    f.header["2.weight:codes"]["dtype"] = "I8"
    expect_error(s, f.to_bytes(), target, workdir, "'2.weight'", "'codes'", "int8", "uint8")
    # (d) a float entry: stored bfloat16, header says float16
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["float"]["2.bias"]["dtype"] = "float16"
    f.set_tq(tq)
    expect_error(s, f.to_bytes(), target, workdir, "'2.bias'", "bfloat16", "float16")


@pytest.mark.parametrize("target", TARGETS)
def test_shape_mismatch(saved, workdir, target):
    s = saved["int4_g32"]
    # (a) the stored codes have another shape (same bytes) than the record's part
    f = StFile(s.st_bytes)
    f.header["0.weight:codes"]["shape"] = f.header["0.weight:codes"]["shape"][::-1]
    expect_error(s, f.to_bytes(), target, workdir, "'0.weight'", "'codes'", "[32, 96]", "[96, 32]")
    # (b) the record's logical shape disagrees with its parts
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["quantized"]["0.weight"]["shape"] = [96, 128]
    f.set_tq(tq)
    expect_error(s, f.to_bytes(), target, workdir, "'0.weight'", "'codes'", "[96, 32]", "[96, 64]")
    # (c) consistent record and parts, but another shape than the model (a transposed record)
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["quantized"]["0.weight"]["transposed"] = True
    f.set_tq(tq)
    expect_error(s, f.to_bytes(), target, workdir, "'0.weight'", "[96, 64]", "[64, 96]")
    # (d) a float entry whose header shape disagrees with the stored tensor
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["float"]["0.bias"]["shape"] = [48, 2]
    f.set_tq(tq)
    expect_error(s, f.to_bytes(), target, workdir, "'0.bias'")


@pytest.mark.parametrize("target", TARGETS)
def test_codes_out_of_range_bytes(saved, workdir, target):
    """int8 dynamic-activation weights use [-127, 127]: a stored -128 (with consistent CRCs) is refused."""
    s = saved["int8_dyn"]
    f = StFile(s.st_bytes)
    codes = f.tensor("2.weight:codes")
    codes[3, 5] = -128
    f.put("2.weight:codes", codes)
    f.fix_data_crc("2.weight:codes")
    expect_error(s, f.to_bytes(), target, workdir, "'2.weight'", "codes outside [-127, 127]")


@pytest.mark.parametrize("cfg", ["int4_g32", "intx3", "intx5_sym_packed"])
@pytest.mark.parametrize("target", TARGETS)
def test_codes_out_of_range_bitstream(saved, workdir, cfg, target):
    """A record whose range holds fewer than 2^bits codes (quant_max tampered, CRC recomputed):
    bitstream values above the range are refused, not wrapped or clamped."""
    s = saved[cfg]
    spec = model_tensors(s.model)["0.weight"].spec
    assert int(model_tensors(s.model)["0.weight"].to_plain().codes.max()) == spec.quant_max  # the top code is used
    f = StFile(s.st_bytes)
    tq = f.tq()
    rec = tq["quantized"]["0.weight"]
    new_max = spec.quant_max - 1 if spec.quant_min >= 0 else spec.quant_max
    new_min = spec.quant_min if spec.quant_min >= 0 else spec.quant_min + 1  # keep symmetric specs centred
    if spec.quant_min < 0:  # symmetric: drop the bottom code instead, which the data also uses
        assert int(model_tensors(s.model)["0.weight"].to_plain().codes.min()) == spec.quant_min
    rec["spec"]["quant_min"], rec["spec"]["quant_max"] = new_min, new_max
    f.set_tq(tq)
    expect_error(s, f.to_bytes(), target, workdir, "'0.weight'", f"codes outside [{new_min}, {new_max}]")


@pytest.mark.parametrize("target", TARGETS)
def test_nonfinite_scale_or_zero_point(saved, workdir, target):
    s = saved["int4_g32"]
    for key, value, needle in (("0.weight:scale", float("nan"), "scale contains NaN/inf"),
                               ("2.weight:scale", float("inf"), "scale contains NaN/inf"),
                               ("4.weight:zero_point", float("-inf"), "zero_point contains NaN/inf")):
        f = StFile(s.st_bytes)
        t = f.tensor(key)
        t[0, 0] = value
        f.put(key, t)
        f.fix_data_crc(key)
        expect_error(s, f.to_bytes(), target, workdir, f"'{key.split(':')[0]}'", needle)


@pytest.mark.parametrize("target", TARGETS)
def test_corrupted_data_is_refused(saved, workdir, target):
    """One flipped bit in codes / scale / zero point / a float tensor: the CRC names the tensor and part."""
    s = saved["intx3"]
    for key in ("0.weight:codes", "2.weight:scale", "4.weight:zero_point", "2.bias"):
        f = StFile(s.st_bytes)
        s0, _ = f.span(key)
        f.data[s0 + 1] ^= 0x04
        name, _, part = key.partition(":")
        expect_error(s, f.to_bytes(), target, workdir, f"'{name}'", *([f"'{part}'"] if part else []), "corrupted")


@pytest.mark.parametrize("target", TARGETS)
def test_missing_key(saved, workdir, target):
    s = saved["int8"]
    path = workdir / "missing.safetensors"
    torchq.save_quantized({k: v for k, v in s.model.state_dict().items() if k != "2.bias"}, path)
    expect_error(s, path.read_bytes(), target, workdir, "missing from the checkpoint", "'2.bias'")
    torchq.save_quantized({k: v for k, v in s.model.state_dict().items() if k != "4.weight"}, path)
    expect_error(s, path.read_bytes(), target, workdir, "missing from the checkpoint", "'4.weight'")


@pytest.mark.parametrize("target", TARGETS)
def test_unexpected_key(saved, workdir, target):
    s = saved["int8"]
    path = workdir / "unexpected.safetensors"
    sd = dict(s.model.state_dict())
    sd["5.weight"] = torch.zeros(3, 3)
    torchq.save_quantized(sd, path)
    expect_error(s, path.read_bytes(), target, workdir, "not in the model", "'5.weight'")
    sd = dict(s.model.state_dict())
    sd["9.weight"] = sd["0.weight"].clone()  # a quantized one
    torchq.save_quantized(sd, path)
    expect_error(s, path.read_bytes(), target, workdir, "not in the model", "'9.weight'")


@pytest.mark.parametrize("target", TARGETS)
def test_stored_tensors_do_not_match_header(saved, workdir, target):
    s = saved["int4_g32"]
    blob = st_rewrite(s.st_bytes, drop=("0.weight:scale",))
    expect_error(s, blob, target, workdir, "do not match the torchq header", "'0.weight:scale'")
    blob = st_rewrite(s.st_bytes, add={"stowaway": torch.ones(4)})
    expect_error(s, blob, target, workdir, "do not match the torchq header", "'stowaway'")


@pytest.mark.parametrize("target", TARGETS)
def test_checkpoint_of_a_different_model(saved, workdir, target):
    s = saved["int4_g32"]
    other = build(s.dtype, widths=(64, 80, 40, 24))
    torchq.quantize_(other, CONFIGS["int4_g32"][0]())
    path = workdir / "other.safetensors"
    torchq.save_quantized(other, path)
    msg = expect_error(s, path.read_bytes(), target, workdir, "[96, 64]", "[80, 64]", "another model")
    assert "'0.weight'" in msg or "'0.bias'" in msg


def test_float_checkpoint_into_quantized_model(saved, workdir):
    s = saved["int8"]
    path = workdir / "float.safetensors"
    torchq.save_quantized(build(s.dtype), path)
    expect_error(s, path.read_bytes(), "quantized", workdir, "'0.weight'", "is quantized in the model", "float tensor")


@pytest.mark.parametrize("target", TARGETS)
def test_invalid_json_behind_a_valid_crc(saved, workdir, target):
    s = saved["int8_dyn"]
    f = StFile(s.st_bytes)
    for text in ("{", "[1, 2]", '{"format": "torchq.checkpoint", "version": NaN}', '{"a": ' * 100_000, ""):
        f.set_tq(text)
        expect_error(s, f.to_bytes(), target, workdir, "torchq header")




@pytest.mark.parametrize("field, value", [
    ("quant_max", "1e400"), ("quant_min", "-1e400"), ("block_size", "[1, 1e400]"),
    ("quant_max", '"15"'), ("quant_max", "15.9"), ("block_size", "[1.0, 32]"),
])
def test_spec_numbers_must_be_ints(saved, workdir, field, value):
    """A spec holds JSON ints; anything else (behind a valid CRC) must be a CheckpointError naming the tensor."""
    s = saved["int4_g32"]
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["quantized"]["0.weight"]["spec"][field] = "@@"
    f.set_tq(json.dumps(tq).replace('"@@"', value))
    expect_error(s, f.to_bytes(), "meta", workdir, "'0.weight'")


def test_spec_numbers_must_be_ints_pickle(saved):
    args = _reduce_args(model_tensors(saved["int8"].model)["0.weight"])
    args[1] = args[1].replace('"quant_max":127', '"quant_max":1e400')
    args[2] = zlib.crc32(args[1].encode())
    with pytest.raises(CheckpointError, match="'0'"):
        torchq._rebuild_quantized_tensor(*args)


@pytest.mark.parametrize("value", [[], {}, ["plain"]])
def test_saved_layout_with_unhashable_type(saved, workdir, value):
    """The saved layout is only a hint: a malformed one is ignored and the device's best layout is
    used, with the same values (never a TypeError)."""
    s = saved["int8"]
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["quantized"]["2.weight"]["layout"] = {"type": value}
    f.set_tq(tq)
    model = make_target(s, "meta")
    path = write(workdir, f.to_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.LoadWarning)
        torchq.load_quantized(model, path)
    w, ref = model[2].weight, s.model[2].weight
    assert w.quant_layout == torchq.choose_layout(ref.spec, w.tensor_impl.shape, ref.to_plain().scale.dtype, "cpu")
    assert w.to_plain().equal(ref.to_plain())


def test_spec_with_unknown_fields_is_refused(saved, workdir):
    s = saved["int4_g32"]
    f = StFile(s.st_bytes)
    tq = f.tq()
    tq["quantized"]["0.weight"]["spec"]["zero_point_offset"] = 3  # a field from some future format
    f.set_tq(tq)
    expect_error(s, f.to_bytes(), "meta", workdir, "'0.weight'")


# -- named cases: torch.save pickles ---------------------------------------------------------------
def test_pickle_record_version_too_new(saved):
    args = _reduce_args(model_tensors(saved["intx3"].model)["0.weight"])
    args[0] = 2
    with pytest.raises(CheckpointError, match="upgrade"):
        torchq._rebuild_quantized_tensor(*args)
    record = json.loads(args[1])
    record["version"] = 2
    args[0], args[1] = 1, json.dumps(record)
    args[2] = zlib.crc32(args[1].encode())
    with pytest.raises(CheckpointError, match=r"'0'.*version 2.*upgrade"):
        torchq._rebuild_quantized_tensor(*args)


def test_pickle_record_crc_mismatch(saved):
    args = _reduce_args(model_tensors(saved["int4_g32"].model)["2.weight"])
    args[1] = args[1].replace('"transposed":false', '"transposed":true')
    with pytest.raises(CheckpointError, match="crc32 mismatch"):
        torchq._rebuild_quantized_tensor(*args)


def test_pickle_codes_out_of_range(saved):
    args = _reduce_args(model_tensors(saved["int8_dyn"].model)["0.weight"])
    record, parts = json.loads(args[1]), {k: v.clone() for k, v in args[3].items()}
    parts["codes"][0, 0] = -128
    record["parts"]["codes"]["crc32"] = zlib.crc32(_raw(parts["codes"])[2])
    args[1] = json.dumps(record)
    args[2], args[3] = zlib.crc32(args[1].encode()), parts
    with pytest.raises(CheckpointError, match=r"'0'.*codes outside \[-127, 127\]"):
        torchq._rebuild_quantized_tensor(*args)


@pytest.mark.parametrize("part", ["codes", "scale", "zero_point"])
def test_torch_load_of_corrupted_quantized_storage(saved, part):
    """End to end through torch.load: one flipped byte in a quantized weight's storage is refused."""
    s = saved["intx3"]
    w = model_tensors(s.model)["2.weight"]
    raw = _raw(_reduce_args(w)[3][part])[2]
    blob = bytearray(s.pt_bytes)
    at = blob.find(raw)
    assert at >= 0 and blob.find(raw, at + 1) < 0
    blob[at + len(raw) // 2] ^= 0x01
    with pytest.raises(CheckpointError, match=rf"'2'.*'{part}'.*corrupted"):
        torch.load(io.BytesIO(bytes(blob)), weights_only=True)


def test_torch_load_round_trip_is_exact(saved):
    for s in saved.values():
        out = torch.load(io.BytesIO(s.pt_bytes), weights_only=True)
        want = {k: fingerprint(v) for k, v in s.model.state_dict().items()}
        assert_same_state({k: fingerprint(v) for k, v in out.items()}, want, s.name)
