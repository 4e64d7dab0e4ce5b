"""The native NF4 / FP4 CPU kernels (csrc/lut4_linear*) against their pure-PyTorch references.

* one-hot activations make every output an exact weight value: the unpacking, nibble order,
  codebooks and (double-quantized) absmax are checked bit for bit, on every ISA this CPU has;
* random activations: within the error bound of fp32 accumulation, for every activation dtype,
  M on both sides of each path switch, odd N, every block size, 1 and 2 threads;
* the reference path runs (and says so once) without the library.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchq
from torchq import native, prefill
from torchq.backends.native_cpu import library as native_library
from torchq.backends.native_cpu import lut4
from torchq.blockwise import double_dequantize, double_quantize
from torchq.ops.blockwise import BLOCK_SIZES

ops = torch.ops.torchq
NATIVE = native.status().available
needs_native = pytest.mark.skipif(not NATIVE, reason=f"native library not built: {native.status().reason}")
# every ISA up to the active one: the CPU's best, or the cap TORCHQ_NATIVE_ISA sets (so a run capped
# at avx2 tests what an AVX2-only CPU runs, and never lifts the cap)
ISAS = [] if not NATIVE else [isa for isa in native_library.ISA_NAMES if native_library.ISA_NAMES.index(isa) <= native_library.ISA_NAMES.index(native.status().isa)]
U32 = 2.0**-24
OUT_ROUNDING = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def forced_tiles(fast_bf16: bool):
    """Within the block, bf16 prefill takes bf16 (True) or fp32 (False) tiles (see torchq.prefill);
    the ``fast_bf16`` fixture does the same for a whole test."""
    return mock.patch.object(prefill, "FAST_BF16_MATMUL", fast_bf16)


def weight(n: int, k: int, block: int, quant_type: str, nested: bool, seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * scale
    w[0, :block] = 0.0  # an all-zero block
    packed, absmax = ops.quantize_4bit(w, block, quant_type, torch.uint8)
    packed = packed.reshape(n, k // 2)
    args = dict(absmax=absmax, nested_codes=None, nested_absmax=None, nested_offset=None)
    if nested:
        codes, absmax2, offset = double_quantize(absmax)
        args = dict(absmax=None, nested_codes=codes, nested_absmax=absmax2, nested_offset=offset)
        absmax = double_dequantize(codes, absmax2, offset)
    dense = ops.dequantize_4bit(packed, absmax, block, quant_type, [n, k], torch.float32)
    return packed, args, dense


def run(x, packed, args, n, k, block, quant_type, bias=None):
    return ops.blockwise_4bit_linear(x, packed, args["absmax"], args["nested_codes"], args["nested_absmax"],
                                     args["nested_offset"], [n, k], block, quant_type, bias)


def test_status_names_the_library_or_the_reason():
    s = native.status()
    assert str(s).startswith("native CPU kernels: ")
    if os.environ.get("TORCHQ_REQUIRE_NATIVE") == "1":  # CI: the install must have built it
        assert s.available, str(s)
    if s.available:
        assert s.isa in native_library.ISA_NAMES and s.path and s.path.endswith(".so")
    else:
        assert s.reason


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["absmax", "nested"])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 70], ids=lambda m: f"M{m}")
def test_one_hot_rows_give_the_exact_weights(isa, quant_type, nested, m):
    n, k, block = 37, 256, 64
    packed, args, dense = weight(n, k, block, quant_type, nested)
    cols = torch.randint(0, k, (m,))
    x = torch.zeros(m, k)
    x[torch.arange(m), cols] = 1.0
    y = run(x, packed, args, n, k, block, quant_type)
    assert torch.equal(y, dense[:, cols].T)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("block", BLOCK_SIZES)
def test_one_hot_every_block_size(isa, block):
    n, k = 5, max(block, 64) * 2
    packed, args, dense = weight(n, k, block, "nf4", nested=True, seed=block, scale=1e-3)
    cols = torch.tensor([0, 1, block - 1, block, k - 1])
    x = torch.zeros(len(cols), k)
    x[torch.arange(len(cols)), cols] = 1.0
    assert torch.equal(run(x, packed, args, n, k, block, "nf4"), dense[:, cols].T)


@needs_native
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_native_dequantize_matches_the_reference(isa, bf16):
    n, k, block = 19, 192, 32
    packed, args, dense = weight(n, k, block, "fp4", nested=True)
    dtype = torch.bfloat16 if bf16 else torch.float32
    out = torch.empty(n - 3, k, dtype=dtype)
    w = lut4.blockwise_4bit_native_weight(packed.reshape(-1), lut4.TABLES["fp4"], None, args["nested_codes"], args["nested_absmax"],
                             args["nested_offset"], n, k, block)
    native_library.dequantize_rows(w, 3, n, out)
    assert torch.equal(out, dense[3:].to(dtype))


def error_bound(x: torch.Tensor, dense: torch.Tensor, bias, dtype, terms: torch.Tensor | None = None) -> torch.Tensor:
    """Per-output bound: fp32 accumulation over K terms (any order), the weights' rounding to
    bf16/fp16 where a path computes in the input dtype, the rounding of x @ W.T to bf16 before the
    bias is added (bf16 tiles + GEMM), and the output's rounding (relative, plus one subnormal step
    for outputs below the dtype's normal range). ``terms``: the magnitude of each weight's terms
    where a path sums them separately (the lut4 decode path's (c + d) s and z), else |dense|."""
    k = x.shape[-1]
    mag = x.double().abs() @ (dense.double().abs() if terms is None else terms.double()).T
    exact = x.double() @ dense.double().T + (0 if bias is None else bias.double())
    weight_rounding = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    subnormal = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # absolute rounding step below the normal range
    gemm_rounding = 2.0**-8 if dtype == torch.bfloat16 else 0.0
    return (k + 2) * U32 * mag + (weight_rounding + gemm_rounding) * mag + OUT_ROUNDING[dtype] * exact.abs() * 2 + subnormal, exact


def assert_within_bound(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias, dtype, terms: torch.Tensor | None = None) -> None:
    """``y`` (the kernel's [M, N] output) is within :func:`error_bound` of the exact product."""
    bound, exact = error_bound(x, dense, bias, dtype, terms)
    err = (y.double() - exact).abs()
    # an exact value within the bound of the dtype's largest finite value may round to inf
    overflow = y.isinf() & (torch.sign(y.double()) == torch.sign(exact)) & (exact.abs() + bound >= torch.finfo(dtype).max)
    err = torch.where(overflow, 0.0, err)
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}, bound there {float(bound.flatten()[err.argmax()]):.3g}"


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    groups=st.integers(1, 4),
    block=st.sampled_from([32, 64, 128]),
    m=st.sampled_from([1, 2, 3, 4, 5, 8, 66]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    quant_type=st.sampled_from(["nf4", "fp4"]),
    nested=st.booleans(),
    with_bias=st.booleans(),
    magnitude=st.sampled_from([1e-6, 1.0, 1e3]),
    seed=st.integers(0, 2**16),
    fast_bf16=st.booleans(),
)
def test_random_inputs_within_the_accumulation_bound(n, groups, block, m, dtype, quant_type, nested, with_bias, magnitude, seed, fast_bf16):
    k = groups * block
    packed, args, dense = weight(n, k, block, quant_type, nested, seed=seed, scale=magnitude)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    with forced_tiles(fast_bf16):  # both tile dtypes of bf16 prefill, whatever this CPU has
        y = run(x, packed, args, n, k, block, quant_type, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_within_bound(y, x, dense, bias, dtype)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("m", [1, 3, 9, 80])
def test_thread_counts_and_isas_agree_with_the_bound(isa, threads, m):
    n, k, block = 131, 512, 64
    packed, args, dense = weight(n, k, block, "nf4", nested=True)
    x = torch.randn(m, k)
    y = run(x, packed, args, n, k, block, "nf4")
    bound, exact = error_bound(x, dense, None, torch.float32)
    assert bool(((y.double() - exact).abs() <= bound).all())


@needs_native
@pytest.mark.parametrize("fast_bf16", [False, True], ids=["fp32tiles", "bf16tiles"], indirect=True)
def test_bf16_prefill_is_as_accurate_as_the_reference(fast_bf16):
    n, k, block = 96, 1024, 64
    packed, args, dense = weight(n, k, block, "nf4", nested=True)
    x = torch.randn(100, k, dtype=torch.bfloat16)
    y = run(x, packed, args, n, k, block, "nf4").double()
    with native.disabled():
        ref = run(x, packed, args, n, k, block, "nf4").double()
    exact = x.double() @ dense.double().T
    assert (y - exact).norm() <= 1.05 * (ref - exact).norm()


@needs_native
def test_gemv_4bit_uses_the_kernel_and_matches_its_reference():
    n, k, block = 48, 256, 64
    packed, args, dense = weight(n, k, block, "nf4", nested=False)
    x = torch.randn(1, k)
    from torchq.blockwise import codebook
    from torchq.ops.blockwise import gemv_4bit_reference

    y = ops.gemv_4bit(x, packed.reshape(-1, 1), [n, k], args["absmax"], codebook("nf4"), block)
    ref = gemv_4bit_reference(x, packed.reshape(-1, 1), [n, k], args["absmax"], codebook("nf4"), block)
    bound, exact = error_bound(x, dense, None, torch.float32)
    assert bool(((y.double() - exact).abs() <= bound).all())
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)


@needs_native
def test_gemv_4bit_with_blocks_crossing_rows_runs_the_reference_and_says_so():
    n, k, block = 6, 96, 64  # blocks run over the flattened weight, across rows
    w = torch.randn(n, k)
    packed, absmax = ops.quantize_4bit(w, block, "nf4", torch.uint8)
    from torchq.blockwise import codebook
    from torchq.ops.blockwise import gemv_4bit_reference

    x = torch.randn(1, k)
    with pytest.warns(native.NativeMissingWarning, match="blocks cross rows"):
        y = ops.gemv_4bit(x, packed, [n, k], absmax, codebook("nf4"), block)
    assert torch.equal(y, gemv_4bit_reference(x, packed, [n, k], absmax, codebook("nf4"), block))


@needs_native
def test_non_contiguous_weight_tensors_are_read_correctly():
    n, k, block = 16, 128, 64
    packed, args, dense = weight(n, k, block, "nf4", nested=False)
    strided = torch.empty(n, k, dtype=torch.uint8)[:, ::2]
    strided.copy_(packed)  # same values, non-contiguous
    absmax = torch.empty(args["absmax"].numel() * 2)[::2]
    absmax.copy_(args["absmax"])
    x = torch.randn(2, k)
    y = run(x, strided, dict(args, absmax=absmax), n, k, block, "nf4")
    assert torch.equal(y, run(x, packed, args, n, k, block, "nf4"))


def test_disabled_runs_the_reference_exactly():
    n, k, block = 16, 128, 64
    packed, args, dense = weight(n, k, block, "nf4", nested=True)
    x = torch.randn(3, k, dtype=torch.bfloat16)
    with native.disabled():
        assert not native.available()
        y = run(x, packed, args, n, k, block, "nf4")
    assert torch.equal(y, torch.nn.functional.linear(x, dense.to(torch.bfloat16)))


def test_without_the_library_the_reference_runs_and_warns_once():
    code = """
import warnings, torch, torchq
from torchq import native
assert not native.status().available and "TORCHQ_NATIVE=0" in native.status().reason, native.status()
m = torch.nn.Linear(128, 8)
torchq.quantize_(m, torchq.nf4_weight_only())
x = torch.randn(2, 128)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y1, y2 = m(x), m(x)
hits = [w for w in caught if issubclass(w.category, native.NativeMissingWarning)]
assert len(hits) == 1 and "blockwise_4bit_linear" in str(hits[0].message), [str(w.message) for w in caught]
w = m.weight.dequantize(torch.float32)
assert torch.equal(y1, torch.nn.functional.linear(x, w, m.bias)), "reference path"
print("ok")
"""
    env = dict(os.environ, TORCHQ_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@needs_native
def test_concurrent_callers_and_a_forked_child():
    n, k, block = 256, 512, 64
    packed, args, dense = weight(n, k, block, "nf4", nested=True)
    x = torch.randn(2, k)
    want = run(x, packed, args, n, k, block, "nf4")
    results = []

    def worker():
        for _ in range(20):
            results.append(torch.equal(run(x, packed, args, n, k, block, "nf4"), want))

    ts = [threading.Thread(target=worker) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert len(results) == 60 and all(results)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child gets a fresh thread pool (the parent's threads do not exist here)
        ok = torch.equal(run(x, packed, args, n, k, block, "nf4"), want)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1" and status == 0


@pytest.mark.parametrize("nested", [False, True])
def test_opcheck_and_gradients(nested):
    n, k, block = 24, 128, 64
    packed, args, dense = weight(n, k, block, "nf4", nested)
    x = torch.randn(3, k, requires_grad=True)
    bias = torch.randn(n, requires_grad=True)
    torch.library.opcheck(ops.blockwise_4bit_linear.default,
                          (x, packed, args["absmax"], args["nested_codes"], args["nested_absmax"], args["nested_offset"],
                           [n, k], block, "nf4", bias))
    y = run(x, packed, args, n, k, block, "nf4", bias)
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.allclose(x.grad, grad @ dense, rtol=1e-5, atol=1e-5)
    assert torch.allclose(bias.grad, grad.sum(0))


def test_bad_arguments_are_named():
    n, k, block = 8, 128, 64
    packed, args, _ = weight(n, k, block, "nf4", nested=False)
    x = torch.randn(2, k)
    with pytest.raises(ValueError, match="x: expected last dimension K=128"):
        run(torch.randn(2, 64), packed, args, n, k, block, "nf4")
    with pytest.raises(ValueError, match="absmax: expected fp32 with 16 entries"):
        run(x, packed, dict(args, absmax=args["absmax"][:3]), n, k, block, "nf4")
    with pytest.raises(ValueError, match="blocksize"):
        run(x, packed, args, n, k, 48, "nf4")
    with pytest.raises(TypeError, match="x: expected fp32, bf16 or fp16"):
        run(x.double(), packed, args, n, k, block, "nf4")
    with pytest.raises(ValueError, match="packed: expected uint8 with 512 bytes"):
        run(x, packed[:4], args, n, k, block, "nf4")


def test_quantized_model_reports_the_kernel():
    m = torch.nn.Linear(256, 64)
    torchq.quantize_(m, torchq.nf4_weight_only())
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchq.FallbackWarning)
        y = m(torch.randn(1, 256))
    assert y.shape == (1, 64)
    assert torchq.explain(m, torch.randn(1, 256)).kernels() == {"weight": "blockwise_4bit_linear"}


# The scaled dot path's table kind (csrc/lut4_linear.h): NF4 / FP4 in blocks of a multiple of 64,
# bf16 activations, 1-16 rows; each 128 positions' weights looked up as the reference's bf16 values.


def avx512_bf16_runs() -> bool:
    """Whether the AVX512_BF16 kernels (the dot paths, the dot-product GEMM) serve calls here: the
    CPU has the instruction and the active ISA is AVX-512 (else only their emulations run)."""
    st = native.status()
    return "avx512_bf16" in st.features and st.isa == "avx512"


def _scaled_dot_calls(fn, *args):
    """fn(*args) and how many lut4 calls took the scaled dot path (either kind) in it."""
    before = native_library.lut4_scaled_dot_calls()
    out = fn(*args)
    return out, native_library.lut4_scaled_dot_calls() - before


def _bf16_weight_bound(y: torch.Tensor, x: torch.Tensor, w_bf16: torch.Tensor, bias) -> None:
    """``y`` within fp32 accumulation (any order) of x @ w_bf16.T (+ bias), rounded once to bf16:
    the table kind's products are the reference's exactly, only their sum's order differs."""
    k = x.shape[-1]
    exact = x.double() @ w_bf16.double().T + (0 if bias is None else bias.double())
    mag = x.double().abs() @ w_bf16.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = (k + 2) * U32 * mag + 2.0**-8 * exact.abs() + torch.finfo(torch.bfloat16).smallest_normal * 2.0**-7
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error {float(err.max()):.3g}, bound there {float(bound.flatten()[err.argmax()]):.3g}"


def _assert_one_hot(got: torch.Tensor, want: torch.Tensor, flushes: bool) -> None:
    """got == want, but where ``flushes`` a subnormal wanted value may come out 0."""
    if not flushes:
        assert torch.equal(got, want)
        return
    subnormal = (want != 0) & (want.abs() < 2.0**-126)
    assert torch.equal(got[~subnormal], want[~subnormal])
    assert bool(((got[subnormal] == want[subnormal]) | (got[subnormal] == 0)).all())


def _edge_absmax_weight(n: int, k: int, block: int, quant_type: str, seed: int):
    """weight() (plain absmax) with rows whose absmax the table kind refuses (inf, NaN, subnormal,
    just below 2^-40, above 2^100: their tiles take the table path) or takes (0, 2^-40, 2^100)."""
    packed, args, _ = weight(n, k, block, quant_type, nested=False, seed=seed)
    absmax = args["absmax"].clone().reshape(n, k // block)
    edges = ((3, float("inf")), (17, float("nan")), (30, 1e-40), (31, 0.0), (32, 2.0**-40), (33, 2.0**-40 * (1 - 2.0**-24)),
             (40, 2.0**100), (44, 2.0**101))
    for row, v in edges:
        absmax[row, 1 % absmax.shape[1]] = v
    absmax = absmax.reshape(-1)
    dense = ops.dequantize_4bit(packed, absmax, block, quant_type, [n, k], torch.float32)
    return packed, dict(args, absmax=absmax), dense


@needs_native
@pytest.mark.parametrize("mode", ["on", "emulated"])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("weights", ["edges", "nested"])
@pytest.mark.parametrize("block,k", [(64, 576), (64, 640), (128, 1152), (256, 512), (64, 3200)])
def test_table_dot_one_hot_bound_and_fallbacks(mode, threads, quant_type, weights, block, k):
    """bf16 activations, 1..16 rows, NF4 / FP4: the scaled dot path's table kind (on AVX512_BF16
    CPUs, or its body on emulated instructions anywhere) serves the call; K = 576 and 640 end in a
    half chunk (one block of 64 on 256-bit halves), 3200 runs the activation rows in chunks of 4
    and the weight rows in blocks; N = 45 ends in partial tiles, and its 405 nested blocks cross a
    256-block group of the double-quantized absmax inside a tile. One-hot rows give exactly the
    reference's bf16 weights; random rows with a bias stay within fp32 accumulation of the
    reference's products; rows whose absmax is inf, NaN, subnormal, below 2^-40 or above 2^100 take
    the table path (the reference's non-finite outputs), as do calls with activations below 2^-59
    or inf / NaN, the table kind switched off, and the decode paths' switch off."""
    runs = mode == "emulated" or avx512_bf16_runs()
    n = 45
    if weights == "nested":
        packed, args, dense = weight(n, k, block, quant_type, nested=True, seed=k + block)
    else:
        packed, args, dense = _edge_absmax_weight(n, k, block, quant_type, seed=k + block)
    w_bf16 = dense.to(torch.bfloat16)
    finite = dense.isfinite().all(1)
    with native_library.bf16_amx("off"), native_library.bf16_dp_gemm("off"), native_library.lut4_table_dot("on"), \
            native_library.lut4_scaled_dot(mode):
        for m in (1, 2, 3, 5, 9, 16):
            gen = torch.Generator().manual_seed(m + k)
            cols = torch.cat([torch.tensor([0, k - 1, block, block - 1, 64, 63]), torch.randint(0, k, (m,), generator=gen)])[:m]
            one_hot = torch.zeros(m, k, dtype=torch.bfloat16)
            one_hot[torch.arange(m), cols] = 1.0
            # without the path, 5+ rows take dequantized tiles + torch.mm, which may flush subnormal weights
            flushes = not runs and m >= 5
            got, calls = _scaled_dot_calls(run, one_hot, packed, args, n, k, block, quant_type)
            assert calls == runs, m
            _assert_one_hot(got[:, finite], w_bf16[finite][:, cols].T, flushes)
            tiny, calls = _scaled_dot_calls(run, one_hot * 2.0**-70, packed, args, n, k, block, quant_type)
            assert calls == 0
            _assert_one_hot(tiny[:, finite], (dense[finite][:, cols].T * 2.0**-70).to(torch.bfloat16), flushes)  # the table path's fp32 weights
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            bias = torch.randn(n, generator=gen).to(torch.bfloat16)
            y, calls = _scaled_dot_calls(run, x, packed, args, n, k, block, quant_type, bias)
            assert calls == runs
            if runs and weights == "nested":  # every tile on the path: the reference's products, summed in another order
                _bf16_weight_bound(y, x, w_bf16.float(), bias)
            else:  # the table path's fp32 weights (here, or the refused rows' tiles)
                assert_within_bound(y[:, finite], x, dense[finite], bias[finite], torch.bfloat16)
            ref = torch.nn.functional.linear(x.double(), dense.double(), bias.double())
            assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
            for switch in (native_library.lut4_table_dot("off"), native_library.lut4_paths(decode=False)):
                with switch:
                    off, calls = _scaled_dot_calls(run, x, packed, args, n, k, block, quant_type, bias)
                assert calls == 0
                assert_within_bound(off[:, finite], x, dense[finite], bias[finite], torch.bfloat16)
            x[0, 1] = float("inf")
            x[m - 1, k - 1] = float("nan")
            y, calls = _scaled_dot_calls(run, x, packed, args, n, k, block, quant_type, bias)
            assert calls == 0
            ref = torch.nn.functional.linear(x.double(), dense.double(), bias.double())
            assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())


@needs_native
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_table_dot_emulated_gives_the_kernels_bits(threads):
    """The emulated body (csrc/lut4_scaled_dot_emulated.cpp: the tables' fp32 products rounded to
    bf16, vpermw's index bits, vdpbf16ps's pair order, the nested absmax decoded lane by lane) gives
    the AVX512_BF16 kernel's bits for every row count, blocks of 64 to 256, K ending 64 positions
    into a chunk, odd N, plain and double-quantized absmax (groups of 256 blocks crossed inside a
    tile), NF4 and FP4, a bias and tiny and huge activations within the path's range."""
    if not avx512_bf16_runs():
        pytest.skip("the CPU has no AVX512_BF16 (or the ISA is capped below AVX-512): no kernel to compare with")
    gen = torch.Generator().manual_seed(5)
    for n, k, block in ((45, 576, 64), (64, 1152, 64), (17, 1152, 128), (33, 640, 64), (8, 512, 256), (300, 192, 64)):
        for quant_type in ("nf4", "fp4"):
            for nested in (False, True):
                packed, args, _ = weight(n, k, block, quant_type, nested, seed=n + k)
                bias = torch.randn(n, generator=gen).to(torch.bfloat16)
                for m in (1, 2, 3, 4, 5, 8, 9, 16):
                    x = torch.randn(m, k, generator=gen)
                    x[0, : k // 4] = (x[0, : k // 4].abs() + 1) * x[0, : k // 4].sign() * 2.0**-50  # tiny, still >= 2^-59
                    x[m - 1, k // 2:] *= 2.0**40
                    x = x.to(torch.bfloat16)
                    outs = []
                    for mode in ("on", "emulated"):
                        with native_library.bf16_amx("off"), native_library.bf16_dp_gemm("off"), native_library.lut4_table_dot("on"), \
                                native_library.lut4_scaled_dot(mode):
                            outs.append(_scaled_dot_calls(run, x, packed, args, n, k, block, quant_type, bias))
                    (on, calls_on), (emulated, calls_emulated) = outs
                    assert calls_on == calls_emulated == 1
                    assert torch.equal(on, emulated), (n, k, block, quant_type, nested, m)


def _table_guard_admits(bits: int) -> bool:
    """The table kind's contract for one absmax (csrc/lut4_linear.h): 0, or of magnitude in
    [2^-40, 2^100]."""
    magnitude = bits & 0x7FFFFFFF
    return magnitude == 0 or 0x2B800000 <= magnitude <= 0x71800000


# float32 bit patterns at the table kind's guard edges: +-0, subnormals, FLT_MIN, 2^-40 and the float
# below it, 2^100 and the float above it, inf, NaNs
TABLE_GUARD_EDGE_BITS = (0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x2B800000, 0xAB800000, 0x2B7FFFFF,
                         0xAB7FFFFF, 0x71800000, 0xF1800000, 0x71800001, 0xF1800001, 0x7F800000, 0xFF800000, 0x7FC00000,
                         0x7F800001, 0xFFFFFFFF, 0x3F800000)


def _floats(bits: list[int]) -> torch.Tensor:
    """float32 values of the given bit patterns (each 0 <= b < 2^32)."""
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


@needs_native
@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(["on", "emulated"]), count=st.integers(0, 70), data=st.data())
def test_table_dot_guard_admits_exactly_zero_and_magnitudes_from_2_minus_40_to_2_100(mode, count, data):
    """The table kind's guard, as the kernel of each mode computes it (the AVX-512 one 16 values at a
    time, masked at the end), on arbitrary bit patterns and the edge patterns at drawn positions."""
    if mode == "on" and not avx512_bf16_runs():
        pytest.skip("no AVX512_BF16 kernel here")
    admitted = data.draw(st.lists(st.integers(0x2B800000, 0x71800000) | st.just(0), min_size=count, max_size=count))
    signs = data.draw(st.lists(st.booleans(), min_size=count, max_size=count))
    bits = [b | (0x80000000 if s else 0) for b, s in zip(admitted, signs)]
    if count:
        for _ in range(data.draw(st.integers(0, 3))):
            at = data.draw(st.integers(0, count - 1))
            bits[at] = data.draw(st.sampled_from(TABLE_GUARD_EDGE_BITS) | st.integers(0, 0xFFFFFFFF))
    with native_library.lut4_scaled_dot(mode):
        got = native_library.lut4_table_dot_values_ok(_floats(bits))
    assert got is all(_table_guard_admits(b) for b in bits)


def test_table_dot_guard_rejects_each_edge_pattern_alone_and_checks_its_arguments():
    """Each edge pattern alone at the start, middle and end of 1-33 admitted values, in every mode
    that has a kernel here; None where no kernel runs; a bad argument named."""
    if not NATIVE:
        pytest.skip("native library not built")
    modes = ["emulated"] + (["on"] if avx512_bf16_runs() else [])
    for mode in modes:
        with native_library.lut4_scaled_dot(mode):
            for count in (1, 15, 16, 17, 33):
                for bits in TABLE_GUARD_EDGE_BITS:
                    for at in {0, count // 2, count - 1}:
                        values = [0x3F000000] * count  # 0.5
                        values[at] = bits
                        assert native_library.lut4_table_dot_values_ok(_floats(values)) is _table_guard_admits(bits), (mode, count, hex(bits), at)
            assert native_library.lut4_table_dot_values_ok(torch.ones(0)) is True
            with pytest.raises(ValueError, match="absmax"):
                native_library.lut4_table_dot_values_ok(torch.ones(4, dtype=torch.float64))
    with native_library.lut4_scaled_dot("off"):
        assert native_library.lut4_table_dot_values_ok(torch.ones(4)) is None
    with pytest.raises(TypeError, match="absmax: expected a tensor"):
        native_library.lut4_table_dot_values_ok(None)
    with pytest.raises(ValueError, match="mode: expected one of"):
        with native_library.lut4_table_dot("emulated"):
            pass


@needs_native
def test_table_dot_serves_the_layout_and_reports_its_rows():
    """nf4_weight_only's eager path takes the table kind for 1-16 bf16 rows where it is on (the
    GEMMs of many rows off), not where it is off."""
    lin = torch.nn.Linear(576, 96, bias=True).to(torch.bfloat16)
    torchq.quantize_(lin, torchq.nf4_weight_only())
    with native_library.bf16_amx("off"), native_library.bf16_dp_gemm("off"), native_library.lut4_scaled_dot("emulated"):
        for setting in ("on", "off"):
            with native_library.lut4_table_dot(setting), torch.no_grad():
                for m in (1, 4, 16):
                    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
                    y, calls = _scaled_dot_calls(lin, x)
                    assert calls == (setting == "on"), (setting, m)
                    assert torch.isfinite(y).all()


@needs_native
def test_table_dot_default_is_the_cpu_vendors_and_the_environment_overrides_it():
    """On by default on AMD CPUs (measured faster there), off on others (Intel: slower, as
    vdpbf16ps costs about two FMAs); TORCHQ_NATIVE_TABLE_DOT=0 / 1 at load overrides either way."""
    code = "from torchq.backends.native_cpu import library; print(library.library().tq_set_lut4_table_dot(-1))"

    def setting(value: str | None) -> int:
        env = {k: v for k, v in os.environ.items() if k != "TORCHQ_NATIVE_TABLE_DOT"}
        if value is not None:
            env["TORCHQ_NATIVE_TABLE_DOT"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in f.read()
    assert setting(None) == int(amd)
    assert setting("1") == 1 and setting("0") == 0
