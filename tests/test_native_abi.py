"""The weight struct shared by the native library and Python (csrc/weight_abi.h, torchq/backends/native_cpu/abi.py).

* the library's self-description (``tq_weight_abi``, ``tq_weight_size``) is what the header
  declares and what Python's ctypes.Structure lays out;
* a library whose description or ABI version differs is refused with the reason in
  ``torchq.native.status()`` ("stale build: reinstall") and never called;
* a struct whose fields contradict each other makes the library return BAD_ARGUMENT
  (a RuntimeError in Python), never a crash.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_native_blockwise import needs_native

import torchq
from torchq.backends.native_cpu import abi as native_abi
from torchq.backends.native_cpu import library as native_library
from torchq.backends.native_cpu import lut4
from torchq.blockwise import double_quantize

pytestmark = needs_native
ROOT = Path(__file__).resolve().parents[1]
N, K = 8, 128


def header_fields() -> list[tuple[str, str]]:
    """(name, kind) of every X(...) entry of csrc/weight_abi.h's field list, in order."""
    text = (ROOT / "csrc" / "weight_abi.h").read_text()
    block = text[text.index("#define TQ_WEIGHT_FIELDS(X)"): text.index("struct tq_weight {")]
    return re.findall(r"X\((\w+), [^,]+, (TQ_KIND_\w+)\)", block)


def test_the_library_describes_the_struct_the_header_declares_and_python_lays_out():
    lib = native_library.library()
    assert lib.tq_abi_version() == native_library.ABI_VERSION == 17
    fields, size = native_abi.describe(lib)
    kinds = {"TQ_KIND_I32": 0, "TQ_KIND_I64": 1, "TQ_KIND_F32": 2, "TQ_KIND_PTR": 3}
    assert [(f.name, f.kind) for f in fields] == [(name, kinds[kind]) for name, kind in header_fields()]
    struct = native_library.weight_struct()
    assert ctypes.sizeof(struct) == size
    for f in fields:
        assert getattr(struct, f.name).offset == f.offset, f.name
        assert getattr(struct, f.name).size == ctypes.sizeof(native_abi.KINDS[f.kind][1]), f.name
    assert {f.name: f.kind for f in fields if f.name in native_abi.FIELDS} == native_abi.FIELDS


class StaleLibrary:
    """The real library with some exports replaced (a stand-in for an older build)."""

    def __init__(self, **replaced):
        self._replaced = replaced

    def __getattr__(self, name):
        if name in self._replaced:
            return self._replaced[name]
        return getattr(native_library.library(), name)


def _described_as(monkeypatch, change) -> None:
    fields, size = native_abi.describe(native_library.library())
    monkeypatch.setattr(native_abi, "describe", lambda lib: change(list(fields), size))


def _moved(fields, size, name, by):
    return [dataclasses.replace(f, offset=f.offset + by) if f.name == name else f for f in fields], size


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda fields, size: _moved(fields, size, "scales", 8), r"field 'scales' is at byte \d+, ctypes lays it out at \d+"),
        (lambda fields, size: ([f for f in fields if f.name != "nested_offset"], size), r"lacks the field 'nested_offset'"),
        (lambda fields, size: ([dataclasses.replace(f, kind=2) if f.name == "act_qmin" else f for f in fields], size),
         r"field 'act_qmin' is float32, torchq fills int32"),
        (lambda fields, size: (fields, size + 8), r"has \d+ bytes, ctypes lays out \d+"),
    ],
    ids=["offset", "missing", "kind", "size"],
)
def test_a_library_describing_another_struct_is_refused(monkeypatch, change, reason):
    _described_as(monkeypatch, change)
    struct, why = native_library.validate(native_library.library(), "_native.so")
    assert struct is None
    assert re.search(rf"^_native\.so: its weight struct.*{reason} \(stale build: reinstall\)$", why), why


def test_a_library_of_another_abi_version_or_without_an_entry_point_is_refused():
    old = StaleLibrary(tq_abi_version=lambda: 3)
    assert native_library.validate(old, "_native.so") == (
        None, f"_native.so has ABI 3, this torchq needs {native_library.ABI_VERSION} (stale build: reinstall)")
    missing = StaleLibrary(tq_linear=None)
    assert native_library.validate(missing, "_native.so") == (None, "_native.so lacks tq_linear (stale build: reinstall)")


STALE_CHILD = """
import ctypes, json
real = ctypes.CDLL
called = []
class Recorder:  # an entry point that records a call instead of running it
    def __init__(self, name):
        self.name = name
    def __call__(self, *args):
        called.append(self.name)
        return 1
class Stale:  # the library as an ABI-3 build would describe itself
    def __init__(self, lib):
        self.lib = lib
    def __getattr__(self, name):
        if name == "tq_abi_version":
            return lambda: 3
        return Recorder(name) if name in ("tq_linear", "tq_dequantize_rows") else getattr(self.lib, name)
def load(path, *args, **kwargs):
    lib = real(path, *args, **kwargs)
    return Stale(lib) if "torchq/_native" in str(path) else lib
ctypes.CDLL = load
import warnings
import torch, torchq
status = torchq.native.status()
m = torch.nn.Sequential(torch.nn.Linear(64, 8))
torchq.quantize_(m, torchq.nf4_weight_only(block_size=32))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    m(torch.randn(1, 64))
print(json.dumps({"available": status.available, "reason": status.reason, "called": called,
                  "warned": [str(w.message) for w in caught if "pure-PyTorch reference" in str(w.message)]}))
"""


def test_status_says_a_stale_library_is_refused_and_it_is_never_called():
    proc = subprocess.run([sys.executable, "-c", STALE_CHILD], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["available"]
    assert re.search(rf"has ABI 3, this torchq needs {native_library.ABI_VERSION} \(stale build: reinstall\)$", result["reason"]), result["reason"]
    assert result["called"] == []
    assert result["warned"] and "stale build: reinstall" in result["warned"][0]


# -- the library checks the struct's consistency ---------------------------------------------------------


def _weights() -> dict[str, native_library.NativeWeight]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g)
    packed, absmax = torch.ops.torchq.quantize_4bit(w, 64, "nf4", torch.uint8)
    codes, absmax2, offset = double_quantize(absmax)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    return {
        "lut4": lut4.blockwise_4bit_native_weight(packed.reshape(-1), lut4.TABLES["nf4"], absmax, None, None, None, N, K, 64),
        "lut4_nested": lut4.blockwise_4bit_native_weight(packed.reshape(-1), lut4.TABLES["nf4"], None, codes, absmax2, offset, N, K, 64),
        "int8": native_library.int8_weight("int8_weight_linear", q, torch.rand(N) + 0.5, N, K),
        "int8_dynamic": native_library.int8_weight("int8_weight_linear", q, torch.rand(N) + 0.5, N, K).dynamic(-127, 127, 1e-5),
        "lut4_int8act": lut4.blockwise_4bit_native_weight(packed.reshape(-1), lut4.TABLES["nf4"], absmax, None, None, None, N, K,
                                                          64).int8_activations(),
    }


def _altered(weight: native_library.NativeWeight, **changes) -> native_library.NativeWeight:
    fields = {name: getattr(weight.struct, name) for name, _ in weight.struct._fields_}
    return native_library.NativeWeight(weight.op, weight._tensors, **(fields | changes))


BAD_FIELDS = {
    "lut4": [dict(packed=None), dict(codebook=None), dict(scales=None), dict(row_length=K + 64 + 32), dict(block=48),
             dict(block=16, row_length=K), dict(round_mul=3), dict(round_add=-1), dict(format=0), dict(format=9),
             dict(n=0), dict(k=0), dict(k=K + 1), dict(row_length=K + 64), dict(codes=1)],
    "lut4_nested": [dict(nested_offset=None), dict(nested_map=None), dict(nested_codes=None), dict(nested_absmax=None),
                    dict(scales=1)],
    "int8": [dict(codes=None), dict(scales=None), dict(row_length=K + 1), dict(packed=1), dict(format=native_abi.FORMAT_LUT4)],
    "int8_dynamic": [dict(act_qmin=-128), dict(act_qmax=128), dict(act_qmin=5, act_qmax=5), dict(act_denom=0.0),
                     dict(act_eps=float("nan")), dict(nested_map=1)],
    # int8 activations: the lut4 checks, and a non-affine (NF4) table with shifts or zeros has no integer form
    "lut4_int8act": [dict(packed=None), dict(scales=None), dict(block=48), dict(codes=1), dict(row_length=K + 64),
                     dict(nested_map=1), dict(format=5)],
}
CASES = [(kind, i) for kind, bad in BAD_FIELDS.items() for i in range(len(bad))]


@pytest.mark.parametrize(("kind", "case"), CASES, ids=[f"{k}-{'-'.join(BAD_FIELDS[k][i])}" for k, i in CASES])
def test_an_inconsistent_weight_struct_is_a_bad_argument(kind, case):
    good = _weights()[kind]
    bad = _altered(good, **BAD_FIELDS[kind][case])
    lib = native_library.library()
    x, out, tile = torch.randn(2, 2 * K), torch.empty(2, 2 * N), torch.empty(2 * N, 2 * K)  # room for any claimed size
    assert lib.tq_linear(good.address, x.data_ptr(), 0, 2, None, out.data_ptr(), 1) == 0
    assert lib.tq_linear(bad.address, x.data_ptr(), 0, 2, None, out.data_ptr(), 1) == 1
    assert lib.tq_dequantize_rows(bad.address, 0, 1, tile.data_ptr(), 0, 1) == 1
    if (bad.n, bad.k, bad.row_length) == (good.n, good.k, good.row_length):
        with pytest.raises(RuntimeError, match=r"failed with status 1 \(1: bad argument"):
            native_library.run_linear(bad, torch.randn(2, K), None)
        with pytest.raises(RuntimeError, match=r"dequantize failed with status 1"):
            native_library.dequantize_rows(bad, 0, 1, torch.empty(1, bad.row_length))


@pytest.mark.parametrize("change", [dict(round_mul=1), dict(round_add=2), dict(shifts=1), dict(zeros=1)])
def test_int8_activations_refuse_rounded_tables_and_shifted_codebooks(change):
    """Rounded tables are not affine in the code, and an NF4 table with shifts or zeros has no int8
    form: the linear refuses them (before reading a shift or zero); their weight still dequantizes."""
    good = _weights()["lut4_int8act"]
    bad = _altered(good, **change)
    x, out = torch.randn(2, K), torch.empty(2, N)
    lib = native_library.library()
    assert lib.tq_linear(good.address, x.data_ptr(), 0, 2, None, out.data_ptr(), 1) == 0
    assert lib.tq_linear(bad.address, x.data_ptr(), 0, 2, None, out.data_ptr(), 1) == 1
    if "round_mul" in change or "round_add" in change:
        assert lib.tq_dequantize_rows(bad.address, 0, 1, torch.empty(1, K).data_ptr(), 0, 1) == 0


@pytest.mark.parametrize("kind", ["lut4", "int8"])
def test_linear_and_dequantize_arguments_outside_the_struct_are_checked(kind):
    weight = _weights()[kind]
    lib = native_library.library()
    x, out = torch.randn(1, K), torch.empty(1, N)
    assert lib.tq_linear(None, x.data_ptr(), 0, 1, None, out.data_ptr(), 1) == 1  # no weight
    assert lib.tq_linear(weight.address, x.data_ptr(), 3, 1, None, out.data_ptr(), 1) == 1  # unknown dtype
    assert lib.tq_linear(weight.address, x.data_ptr(), 0, 0, None, out.data_ptr(), 1) == 1  # M = 0
    assert lib.tq_linear(weight.address, None, 0, 1, None, out.data_ptr(), 1) == 1
    tile = torch.empty(N, K)
    for n0, n1 in ((0, 0), (3, 2), (-1, 2), (0, N + 1)):
        assert lib.tq_dequantize_rows(weight.address, n0, n1, tile.data_ptr(), 0, 1) == 1, (n0, n1)
    assert lib.tq_dequantize_rows(weight.address, 0, N, None, 0, 1) == 1
    assert lib.tq_dequantize_rows(weight.address, 0, N, tile.data_ptr(), 0, 1) == 0


def test_a_dynamic_weight_takes_no_bias_in_c_and_adds_it_after_rounding():
    weight = _weights()["int8_dynamic"]
    x, bias = torch.randn(3, K, dtype=torch.bfloat16), torch.randn(N, dtype=torch.bfloat16)
    lib = native_library.library()
    out = torch.empty(3, N, dtype=torch.bfloat16)
    b32 = bias.float()
    assert lib.tq_linear(weight.address, x.data_ptr(), 1, 3, b32.data_ptr(), out.data_ptr(), 1) == 1
    assert torch.equal(native_library.run_linear(weight, x, bias), native_library.run_linear(weight, x, None) + bias)


def test_builders_check_every_buffer_against_the_sizes_the_struct_claims():
    weights = _weights()
    tensors = weights["lut4_nested"]._tensors
    packed, table = tensors[0], tensors[1]
    codes, absmax2, offset = tensors[2:5]
    with pytest.raises(ValueError, match=r"nested_offset: expected a contiguous CPU torch.float32 tensor of 1 elements"):
        native_library.lut4_weight("t", N, K, 64, packed, table, nested=(codes, absmax2, offset.to(torch.float64), tensors[5]))
    with pytest.raises(ValueError, match=r"packed: expected a contiguous CPU torch.uint8 tensor of 512 elements"):
        native_library.lut4_weight("t", N, K, 64, packed[:-1], table, scales=torch.ones(N * K // 64))
    with pytest.raises(ValueError, match=r"scales, nested: pass exactly one"):
        native_library.lut4_weight("t", N, K, 64, packed, table)
    with pytest.raises(ValueError, match=r"scales: expected a contiguous CPU torch.float32 tensor of 8 elements"):
        native_library.int8_weight("t", torch.zeros(N * K, dtype=torch.int8), torch.ones(N + 1), N, K)
    with pytest.raises(ValueError, match=r"dynamic activations need an int8 weight-only weight"):
        weights["lut4"].dynamic(-127, 127, 1e-5)


def test_the_nested_offset_is_read_at_every_call():
    """The struct points at the offset tensor: copy_ into it (load_state_dict) changes the next call."""
    weight = _weights()["lut4_nested"]
    offset = weight._tensors[4]
    x = torch.randn(1, K)
    before = native_library.run_linear(weight, x, None)
    offset.add_(1.0)
    assert not torch.equal(native_library.run_linear(weight, x, None), before)


def test_the_native_library_has_no_positional_entry_points():
    assert not [name for name in native_library._SIGNATURES if re.match(r"tq_(int4|int8|blockwise4bit)_", name)]
    assert isinstance(torchq.backends.native_cpu.library.NativeWeight, type)
