"""Statistics (absmax) in fp32, bf16 or fp16 for the ops that read them: ``dequantize_4bit``,
``gemv_4bit``, ``gemm_4bit`` (plain and double-quantized), ``dequantize_blockwise`` and their
``.out`` overloads, fakes and native CPU kernels.

The contract (``torchq/ops/blockwise.py``): a bf16 / fp16 statistic is widened to fp32 (exact),
then the fp32 arithmetic runs: ``code[nibble] * absmax`` in fp32, one cast to the output dtype.
Checked against a formula written here, against the same call with the widened fp32 tensor, the
native kernel against the reference bit for bit (one-hot activations make each output one
weight), and, when bitsandbytes is installed, against bitsandbytes' own ops on inputs from its
real ``quantize_4bit``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.library import opcheck

import torchq  # noqa: F401  (registers torch.ops.torchq.*)
from torchq import native
from torchq.backends.native_cpu import library as native_library
from torchq.backends.native_cpu import lut4
from torchq.blockwise import codebook, double_quantize, dynamic_map
from torchq.ops.blockwise import bnb_cpu_packed_to_standard, is_bnb_cpu_packed

ops = torch.ops.torchq
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
HALVES = [torch.bfloat16, torch.float16]
ROOT = Path(__file__).resolve().parents[1]
needs_native = pytest.mark.skipif(not native.status().available, reason=f"native library not built: {native.status().reason}")


def ids(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def quantized(n: int, k: int, blocksize: int, quant_type: str, storage=torch.uint8, seed: int = 0, scale: float = 1.0):
    """``(packed, fp32 absmax)`` of a random ``[n, k]`` weight (torchq's quantize_4bit: bitsandbytes' bytes)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * scale
    return ops.quantize_4bit(w, blocksize, quant_type, storage)


def weight_formula(packed: torch.Tensor, absmax: torch.Tensor, blocksize: int, quant_type: str, shape) -> torch.Tensor:
    """The contract written out: nibbles (high first) -> fp32 code values, times fp32(absmax) per
    block of the flattened tensor, in fp32."""
    n = 1
    for s in shape:
        n *= s
    b = packed.reshape(-1).view(torch.uint8).long()
    nibbles = torch.stack([b >> 4, b & 15], dim=1).reshape(-1)[:n]
    values = codebook(quant_type)[nibbles]
    scale = absmax.reshape(-1).to(torch.float32).repeat_interleave(blocksize)[:n]
    return (values * scale).reshape(shape)


def nested(absmax: torch.Tensor, stat_dtype: torch.dtype) -> dict:
    """gemm_4bit's double-quantized arguments for ``absmax``, the per-256 statistics in ``stat_dtype``."""
    codes, absmax2, offset = double_quantize(absmax)
    return {"absmax": absmax2.to(stat_dtype), "absmax_8bit": codes, "absmax_code": dynamic_map(), "absmax_offset": offset}


def one_hot_rows(k: int, m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cols = torch.linspace(0, k - 1, m).round().long()
    return torch.eye(k, dtype=dtype)[cols], cols


# -- the reference's arithmetic ---------------------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 140), blocksize=st.sampled_from([32, 64, 128, 256]),
       quant_type=st.sampled_from(["nf4", "fp4"]), stat=st.sampled_from(FLOATS), out=st.sampled_from(FLOATS),
       storage=st.sampled_from([torch.uint8, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_dequantize_4bit_widens_absmax_exactly(rows, cols, blocksize, quant_type, stat, out, storage, seed):
    n = rows * cols
    if storage != torch.uint8 and ((n + 1) // 2) % 2:
        storage = torch.uint8  # bf16 storage needs an even number of packed bytes
    packed, absmax = quantized(rows, cols, blocksize, quant_type, storage, seed, scale=1e3 if seed % 2 else 1.0)
    stats = absmax.to(stat)
    got = ops.dequantize_4bit(packed, stats, blocksize, quant_type, [rows, cols], out)
    assert got.dtype == out and torch.equal(got, weight_formula(packed, stats, blocksize, quant_type, [rows, cols]).to(out))
    assert torch.equal(got, ops.dequantize_4bit(packed, stats.float(), blocksize, quant_type, [rows, cols], out))
    buf = torch.full((rows, cols), float("nan"), dtype=out)
    assert ops.dequantize_4bit.out(packed, stats, blocksize, quant_type, [rows, cols], out, buf) is None
    assert torch.equal(buf, got)


@pytest.mark.parametrize("out", FLOATS, ids=ids)
@pytest.mark.parametrize("stat", FLOATS, ids=ids)
def test_dequantize_blockwise_widens_absmax_exactly(stat, out):
    x = torch.randn(5, 77, generator=torch.Generator().manual_seed(4)) * 7
    code = dynamic_map()
    q, absmax = ops.quantize_blockwise(x, code, 64)
    stats = absmax.to(stat)
    got = ops.dequantize_blockwise(q, stats, code, 64, out)
    want = (code[q.reshape(-1).long()] * stats.float().repeat_interleave(64)[: x.numel()]).reshape(x.shape).to(out)
    assert torch.equal(got, want)
    assert torch.equal(got, ops.dequantize_blockwise(q, stats.float(), code, 64, out))
    buf = torch.empty_like(got)
    ops.dequantize_blockwise.out(q, stats, code, 64, out, buf)
    assert torch.equal(buf, got)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("a_dtype", FLOATS, ids=ids)
@pytest.mark.parametrize("stat", FLOATS, ids=ids)
@pytest.mark.parametrize("n, k, blocksize", [(24, 128, 64), (9, 96, 64)])  # K = 96: blocks cross rows
def test_matmul_references_widen_absmax_exactly(stat, a_dtype, quant_type, n, k, blocksize):
    packed, absmax = quantized(n, k, blocksize, quant_type, seed=2)
    stats = absmax.to(stat)
    code = codebook(quant_type)
    a = torch.randn(2, 3, k, generator=torch.Generator().manual_seed(3)).to(a_dtype)
    bias = torch.randn(n).to(a_dtype)
    w = weight_formula(packed, stats, blocksize, quant_type, [n, k]).to(a_dtype)
    with native.disabled():
        gemv = ops.gemv_4bit(a, packed, [n, k], stats, code, blocksize)
        assert torch.equal(gemv, F.linear(a, w))
        assert torch.equal(gemv, ops.gemv_4bit(a, packed, [n, k], stats.float(), code, blocksize))
        out = torch.empty_like(gemv)
        ops.gemv_4bit.out(a, packed, [n, k], stats, code, blocksize, out)
        assert torch.equal(out, gemv)
        gemm = ops.gemm_4bit(a, packed, [n, k], stats, blocksize, quant_type, bias=bias)
        assert torch.equal(gemm, F.linear(a, w, bias))
        # double-quantized: the per-256 statistics in stat, the offset in stat too (a checkpoint's)
        args = nested(absmax, stat)
        args["absmax_offset"] = args["absmax_offset"].to(stat)
        got = ops.gemm_4bit(a, packed, [n, k], args.pop("absmax"), blocksize, quant_type, **args)
        wide = nested(absmax, stat)
        wide["absmax_offset"] = wide["absmax_offset"].to(stat).float()
        scale = dynamic_map()[wide["absmax_8bit"].long()] * wide["absmax"].float().repeat_interleave(256)[: absmax.numel()] + wide["absmax_offset"]
        assert torch.equal(got, F.linear(a, weight_formula(packed, scale, blocksize, quant_type, [n, k]).to(a_dtype)))
        assert torch.equal(got, ops.gemm_4bit(a, packed, [n, k], wide.pop("absmax").float(), blocksize, quant_type, **wide))


# -- the native CPU kernel: it runs, and it is the reference bit for bit ---------------------------------
def spy_native(monkeypatch) -> list:
    calls: list = []
    real = lut4._native_linear

    def spy(*args, **kwargs):
        calls.append(args[2:3])  # the table
        return real(*args, **kwargs)

    monkeypatch.setattr(lut4, "_native_linear", spy)
    return calls


@needs_native
@pytest.mark.parametrize("op", ["gemv", "gemm", "gemm_nested"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("a_dtype", FLOATS, ids=ids)
@pytest.mark.parametrize("stat", FLOATS, ids=ids)
def test_native_kernel_runs_and_equals_the_reference(monkeypatch, stat, a_dtype, quant_type, op):
    n, k, blocksize = 40, 256, 64
    packed, absmax = quantized(n, k, blocksize, quant_type, seed=5, scale=3.0)
    code = codebook(quant_type)

    def call(a, stats_dtype):
        if op == "gemv":
            return ops.gemv_4bit(a, packed, [n, k], absmax.to(stats_dtype), code, blocksize)
        if op == "gemm":
            return ops.gemm_4bit(a, packed, [n, k], absmax.to(stats_dtype), blocksize, quant_type)
        args = nested(absmax, stats_dtype)
        return ops.gemm_4bit(a, packed, [n, k], args.pop("absmax"), blocksize, quant_type, **args)

    calls = spy_native(monkeypatch)
    for m in (1, 5):
        x, _ = one_hot_rows(k, m, a_dtype)
        got = call(x, stat)
        with native.disabled():
            want = call(x, stat)
        assert torch.equal(got, want), f"m={m}"
    assert len(calls) == 2  # both calls ran the native kernel, none the reference
    # random activations: the kernel's result is the same as for the statistics widened to fp32 first
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6)).to(a_dtype)
    if op == "gemm_nested":
        args = nested(absmax, stat)
        widened = ops.gemm_4bit(x, packed, [n, k], args.pop("absmax").float(), blocksize, quant_type, **args)
    elif op == "gemv":
        widened = ops.gemv_4bit(x, packed, [n, k], absmax.to(stat).float(), code, blocksize)
    else:
        widened = ops.gemm_4bit(x, packed, [n, k], absmax.to(stat).float(), blocksize, quant_type)
    assert torch.equal(call(x, stat), widened)
    assert len(calls) == 4


# -- opcheck, fakes, refusals ---------------------------------------------------------------------------
def op_calls(stat: torch.dtype) -> dict:
    """(overload, args, kwargs) of every op that reads statistics, the statistics in ``stat``."""
    n, k = 16, 128
    packed, absmax = quantized(n, k, 64, "nf4", seed=7)
    s = absmax.to(stat)
    x = torch.randn(1, 1, k, dtype=torch.bfloat16)
    q, qabsmax = ops.quantize_blockwise(torch.randn(3, 40), dynamic_map(), 64)
    nest = nested(absmax, stat)
    return {
        "dequantize_4bit": (ops.dequantize_4bit.default, (packed, s, 64, "nf4", [n, k], torch.float16), {}),
        "dequantize_4bit.out": (ops.dequantize_4bit.out, (packed, s, 64, "nf4", [n, k], torch.float16, torch.empty(n, k, dtype=torch.float16)), {}),
        "gemv_4bit": (ops.gemv_4bit.default, (x, packed, [n, k], s, codebook("nf4"), 64), {}),
        "gemv_4bit.out": (ops.gemv_4bit.out, (x, packed, [n, k], s, codebook("nf4"), 64, torch.empty(1, 1, n, dtype=torch.bfloat16)), {}),
        "gemm_4bit": (ops.gemm_4bit.default, (x, packed, [n, k], s, 64, "nf4"), {"bias": torch.randn(n, dtype=torch.bfloat16)}),
        "gemm_4bit nested": (ops.gemm_4bit.default, (x, packed, [n, k], nest.pop("absmax"), 64, "nf4"), nest),
        "dequantize_blockwise": (ops.dequantize_blockwise.default, (q, qabsmax.to(stat), dynamic_map(), 64, torch.float32), {}),
        "dequantize_blockwise.out": (ops.dequantize_blockwise.out, (q, qabsmax.to(stat), dynamic_map(), 64, torch.float32, torch.empty(3, 40)), {}),
    }


@pytest.mark.parametrize("name", list(op_calls(torch.float32)))
@pytest.mark.parametrize("stat", HALVES, ids=ids)
def test_opcheck_with_half_statistics(stat, name):
    op, args, kwargs = op_calls(stat)[name]
    opcheck(op, args, kwargs)


@pytest.mark.parametrize("name", list(op_calls(torch.float32)))
@pytest.mark.parametrize("bad", [torch.float64, torch.int32])
def test_other_statistic_dtypes_are_refused_by_kernel_and_fake(bad, name):
    op, args, kwargs = op_calls(torch.float32)[name]
    index = 3 if name.startswith("gemv") or name.startswith("gemm") else 1
    args = list(args)
    args[index] = args[index].to(bad)
    pattern = rf"absmax: expected fp32 with \d+ entries \(.*bf16 or fp16 also accepted\), got {bad}"
    with pytest.raises(ValueError, match=pattern):
        op(*args, **kwargs)
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(ValueError, match=pattern):
        op(*meta, **{key: v.to("meta") if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()})


def test_maps_stay_fp32():
    # code / absmax_code are value maps, not statistics: bitsandbytes' fakes and kernels take fp32 only
    op, args, kwargs = op_calls(torch.bfloat16)["gemm_4bit nested"]
    with pytest.raises(ValueError, match="absmax_code: expected the 256 fp32 values"):
        op(*args, **dict(kwargs, absmax_code=kwargs["absmax_code"].to(torch.bfloat16)))
    op, args, _ = op_calls(torch.bfloat16)["gemv_4bit"]
    with pytest.raises(ValueError, match="code: expected the 16 fp32 values"):
        op(*args[:4], args[4].to(torch.bfloat16), args[5])


@pytest.mark.parametrize("stat", HALVES, ids=ids)
def test_compiled_calls_equal_eager(stat):
    n, k = 24, 128
    packed, absmax = quantized(n, k, 32, "fp4", seed=8)
    s = absmax.to(stat)
    nest = nested(absmax, stat)
    s2 = nest.pop("absmax")
    x = torch.randn(3, k, dtype=torch.float16)

    def fn(a):
        return (ops.gemv_4bit(a, packed, [n, k], s, codebook("fp4"), 32), ops.gemm_4bit(a, packed, [n, k], s2, 32, "fp4", **nest),
                ops.dequantize_4bit(packed, s, 32, "fp4", [n, k], torch.bfloat16))

    for got, want in zip(torch.compile(fn, fullgraph=True, backend="aot_eager")(x), fn(x), strict=True):
        assert torch.equal(got, want)


# -- against bitsandbytes' own ops (inputs from its real quantize_4bit) -------------------------------------
def bnb_inputs(n: int, k: int, blocksize: int, quant_type: str, w_dtype: torch.dtype, storage=torch.uint8):
    bnb = pytest.importorskip("bitsandbytes")  # noqa: F841  (registers torch.ops.bitsandbytes)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(11)).to(w_dtype)
    return torch.ops.bitsandbytes.quantize_4bit(w, blocksize, quant_type, storage)


def bnb_default_kernel(op: str):
    """bitsandbytes' pure-PyTorch ("default") kernel of ``op``: what its CPU backend runs for
    ``gemv_4bit`` on CPUs without AVX512-BF16, called directly even where this machine's
    bitsandbytes registered its AVX512-BF16 CPU kernel (that one reads another weight layout)."""
    overload = getattr(torch.ops.bitsandbytes, op).default
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return lambda *args: overload.redispatch(keys, *args)


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["u8", "bf16-storage"])
@pytest.mark.parametrize("out", FLOATS, ids=ids)
@pytest.mark.parametrize("stat", FLOATS, ids=ids)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_dequantize_4bit_equals_bitsandbytes(quant_type, stat, out, storage):
    packed, absmax = bnb_inputs(64, 128, 64, quant_type, out, storage)
    s = absmax.to(stat)
    theirs = torch.ops.bitsandbytes.dequantize_4bit(packed, s, 64, quant_type, [64, 128], out)
    assert torch.equal(ops.dequantize_4bit(packed, s, 64, quant_type, [64, 128], out), theirs)


@pytest.mark.slow
@pytest.mark.parametrize("stat, quant_type", [(torch.bfloat16, "nf4"), (torch.float16, "fp4")], ids=["bf16-nf4", "fp16-fp4"])
def test_dequantize_4bit_odd_shape_equals_bitsandbytes(stat, quant_type):
    # an odd last dimension: bitsandbytes' CPU kernel falls back to its default backend (torch.compile'd)
    packed, absmax = bnb_inputs(7, 63, 64, quant_type, torch.bfloat16)
    s = absmax.to(stat)
    theirs = torch.ops.bitsandbytes.dequantize_4bit(packed, s, 64, quant_type, [7, 63], torch.bfloat16)
    assert torch.equal(ops.dequantize_4bit(packed, s, 64, quant_type, [7, 63], torch.bfloat16), theirs)


@pytest.mark.parametrize("a_dtype", FLOATS, ids=ids)
@pytest.mark.parametrize("stat", FLOATS, ids=ids)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_matmuls_equal_bitsandbytes(quant_type, stat, a_dtype):
    """The references bit for bit (bitsandbytes' default gemv / gemm: its dequantize_4bit, then
    F.linear in A's dtype); the native kernel bit for bit on one-hot rows, and on random rows within
    the bound of its fp32 accumulation (one rounding of the weights to A's dtype and two of the
    output, plus K + 2 fp32 roundings, times sum |x| |w|)."""
    n, k, blocksize = 64, 256, 64
    packed, absmax = bnb_inputs(n, k, blocksize, quant_type, a_dtype)
    s = absmax.to(stat)
    import bitsandbytes.functional as bnbf

    code = bnbf.get_4bit_type(quant_type, device="cpu")
    bias = torch.randn(n).to(a_dtype)
    x = torch.randn(1, 1, k, generator=torch.Generator().manual_seed(12)).to(a_dtype)
    gemv_bnb = bnb_default_kernel("gemv_4bit")(x, packed, [n, k], s, code, blocksize)
    gemm_bnb = torch.ops.bitsandbytes.gemm_4bit(x, packed, [n, k], s, blocksize, quant_type, bias=bias)
    with native.disabled():
        assert torch.equal(ops.gemv_4bit(x, packed, [n, k], s, code, blocksize), gemv_bnb)
        assert torch.equal(ops.gemm_4bit(x, packed, [n, k], s, blocksize, quant_type, bias=bias), gemm_bnb)
    hot, _ = one_hot_rows(k, 4, a_dtype)
    assert torch.equal(ops.gemv_4bit(hot, packed, [n, k], s, code, blocksize), bnb_default_kernel("gemv_4bit")(hot, packed, [n, k], s, code, blocksize))
    w = torch.ops.bitsandbytes.dequantize_4bit(packed, s.float(), blocksize, quant_type, [n, k], torch.float32).double()
    mag = x.double().abs() @ w.abs().T
    eps = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[a_dtype]
    bound = ((0 if a_dtype == torch.float32 else eps) + 2 * eps + (k + 2) * 2.0**-24) * mag + torch.finfo(a_dtype).smallest_normal
    assert bool(((ops.gemv_4bit(x, packed, [n, k], s, code, blocksize).double() - gemv_bnb.double()).abs() <= bound).all())


@pytest.mark.parametrize("a_dtype", FLOATS, ids=ids)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_double_quantized_gemm_equals_bitsandbytes(quant_type, a_dtype):
    bnb = pytest.importorskip("bitsandbytes")
    n, k = 64, 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(13)).to(a_dtype)
    packed, qs = bnb.functional.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=True)
    x = torch.randn(2, 2, k, generator=torch.Generator().manual_seed(14)).to(a_dtype)
    args = (x, packed, [n, k], qs.state2.absmax, 64, quant_type)
    kwargs = {"absmax_8bit": qs.absmax, "absmax_code": qs.state2.code, "absmax_offset": qs.offset}
    theirs = torch.ops.bitsandbytes.gemm_4bit(*args, **kwargs)
    with native.disabled():
        assert torch.equal(ops.gemm_4bit(*args, **kwargs), theirs)
    # the offset as a pre-quantized checkpoint may hold it (bitsandbytes' own regression test's case)
    for half in HALVES:
        off = dict(kwargs, absmax_offset=qs.offset.to(half))
        with native.disabled():
            assert torch.equal(ops.gemm_4bit(*args, **off), torch.ops.bitsandbytes.gemm_4bit(*args, **off))


# -- the peer runner (benchmarks/peer_bnb_ops.py) ------------------------------------------------------------
def peer_module():
    spec = importlib.util.spec_from_file_location("peer_bnb_ops", ROOT / "benchmarks" / "peer_bnb_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_peer_runner_renames_every_op_but_quantize_4bit():
    mod = peer_module()
    text = ("import torch\nimport bitsandbytes\nfrom tests.helpers import TRUE_FALSE\n"
            "torch.ops.bitsandbytes.quantize_4bit.default(A, 64, 'nf4', s)\n"
            "torch.ops.bitsandbytes.gemv_4bit.default(A, B)\nopcheck(torch.ops.bitsandbytes.gemv_4bit.default, ())\n"
            "torch.ops.bitsandbytes.dequantize_4bit.out(A)\nbitsandbytes.functional.quantize_4bit(B)\n")
    out, renamed = mod.rename_namespace(text)
    assert "torch.ops.bitsandbytes.quantize_4bit.default(A" in out and out.count("torch.ops.bitsandbytes") == 1
    assert out.count("torch.ops.torchq.gemv_4bit.default") == 2 and "torch.ops.torchq.dequantize_4bit.out" in out
    assert dict(renamed) == {"gemv_4bit": 2, "dequantize_4bit": 1}
    assert "import bitsandbytes\nimport torchq" in out and "bitsandbytes.functional.quantize_4bit(B)" in out
    with pytest.raises(ValueError, match="import bitsandbytes"):
        mod.rename_namespace("import torch\n")
    rows = [{"nodeid": "tests/test_ops.py::TestA::test_x[a]", "outcome": o} for o in ("passed", "failed", "skipped", "xfailed")]
    summary = mod.summarize(rows + [{"nodeid": "tests/test_ops.py::TestB::test_y", "outcome": "passed"}])
    assert summary["TestA"]["runnable"] == 2 and summary["TestA"]["xfailed"] == 1 and summary["total"]["passed"] == 2
    assert "TestB" in mod.format_table(summary)


@pytest.mark.slow
def test_peer_runner_runs_bitsandbytes_gemv_tests(tmp_path):
    pytest.importorskip("bitsandbytes")
    mod = peer_module()
    if not mod.DEFAULT_SOURCE.exists():
        pytest.skip(f"no bitsandbytes source at {mod.DEFAULT_SOURCE}")
    path = tmp_path / "peer.json"
    assert mod.main(["--json", str(path), "--", "-k", "test_gemv_4bit and nf4 and 64"]) == 0
    import json

    result = json.loads(path.read_text())
    assert result["summary"]["total"]["passed"] == 6 and result["summary"]["total"]["failed"] == 0


@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("path", ["native", "reference"])
def test_gemv_reads_bitsandbytes_cpu_packed_layout(monkeypatch, path, quant_type, blocksize):
    """bitsandbytes' test_gemv_4bit on AVX512-BF16 CPUs repacks the weight with its own
    ``_convert_weight_packed_for_cpu`` (B ``[N, K/2]`` in runs of 32 rows, absmax bf16 ``[K/bs, N]``):
    torchq's gemv_4bit reads it as the same codes and statistics, so the product equals the
    standard layout's bit for bit (the same arithmetic), not the product of misread bytes."""
    bnb = pytest.importorskip("bitsandbytes")
    if path == "reference":
        monkeypatch.setattr(native_library, "library", lambda: None)
    n, k = 96, 256
    packed, absmax = bnb_inputs(n, k, blocksize, quant_type, torch.bfloat16)
    code = bnb.functional.get_4bit_type(quant_type, device="cpu", blocksize=blocksize)
    state = bnb.functional.QuantState(absmax=absmax, shape=torch.Size([n, k]), dtype=torch.bfloat16, blocksize=blocksize,
                                      code=code, quant_type=quant_type)
    cpu_packed, state = bnb.functional._convert_weight_packed_for_cpu(packed.clone(), state)
    assert is_bnb_cpu_packed(cpu_packed, [n, k], state.absmax, blocksize)
    assert not is_bnb_cpu_packed(packed, [n, k], absmax, blocksize)
    a = torch.randn(3, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    standard = ops.gemv_4bit(a, packed, [n, k], state.absmax.t().reshape(-1), code, blocksize)
    assert torch.equal(ops.gemv_4bit(a, cpu_packed, [n, k], state.absmax, code, blocksize), standard)
    b, s = bnb_cpu_packed_to_standard(cpu_packed, [n, k], state.absmax)
    assert torch.equal(b, packed.reshape(-1)) and torch.equal(s, absmax.to(torch.bfloat16))
