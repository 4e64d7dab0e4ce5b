"""Triton kernels (torchq.backends.triton) against the ops' pure-PyTorch references.

Without a GPU they run in triton's CPU interpreter (``TRITON_INTERPRET=1``, set by conftest) on
small shapes: the dequantized weights are checked bit for bit through identity inputs (each
output is then one weight times 1), the products against the reference within fp32 summation
order, and the int8 path bit for bit. With CUDA the same tests run on the GPU, plus dispatch,
torch.compile and larger shapes."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import sqnr
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import torchq
from torchq import ZeroPointDomain as Z
from torchq import native
from torchq.layouts import Int4NativeLayout

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from torchq.backends.triton import (  # noqa: E402
    cuda_rejects,
    dequant_linear,
    factored_dot,
    int8_linear,
    int8_weight,
    stream_gemv,
    tiled_dequant,  # noqa: E402
)
from torchq.layouts.tensor_core_tiled import TensorCoreTiledLayout, pack_tiled  # noqa: E402
from torchq.ops.int4 import tinygemm_dequantize, unpack_nibbles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOATS = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = dict(deadline=None, max_examples=12, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def reference(op, *args):
    """The op's pure-PyTorch reference on the CPU."""
    cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    with native.disabled():
        return op(*cpu)


def on(device, t):
    return None if t is None else t.to(device)


@contextlib.contextmanager
def factored_off():
    """The reference-exact kernels for every row count (the factored kernel is tested on its own bound)."""
    saved = dequant_linear.FACTORED_ROWS
    dequant_linear.FACTORED_ROWS = (0, -1)
    try:
        yield
    finally:
        dequant_linear.FACTORED_ROWS = saved


def int4_args(impl, x, bias=None):
    """The op's arguments for weight ``impl`` (CPU), its tensors moved to x's device."""
    n, k = impl.shape
    d = x.device
    return (x, on(d, impl.packed), on(d, impl.scale), on(d, impl.shift), on(d, impl.zero), [n, k], impl.group_size,
            impl.code_base, *impl.round_kinds, bias)


def nf4_args(impl, x, bias=None):
    spec = impl.spec
    d = x.device
    return (x, on(d, impl.packed), on(d, impl.absmax), on(d, impl.nested_codes), on(d, impl.nested_absmax),
            on(d, impl.nested_offset), list(impl.shape), spec.block_size[1], spec.codebook, bias)


def identity_rows(k: int, m: int, dtype) -> torch.Tensor:
    """``m`` rows picking columns spread over K (row i is e_j): x @ W.T then holds W[:, j]."""
    cols = torch.linspace(0, k - 1, m).round().long()
    return torch.eye(k, dtype=dtype)[cols], cols


# -- exact weights: 4-bit affine -----------------------------------------------------------------
@settings(**SETTINGS)
@given(domain=st.sampled_from([Z.FLOAT, Z.INT, Z.NONE]), x_dtype=st.sampled_from(FLOATS), scale_dtype=st.sampled_from(FLOATS),
       g=st.sampled_from([32, 64, 128, 256, 512]), n=st.integers(1, 70), k=st.integers(1, 300), m=st.sampled_from([5, 17, 70]),
       seed=st.integers(0, 2**31 - 1))
def test_int4_weights_are_the_references_bit_for_bit(domain, x_dtype, scale_dtype, g, n, k, m, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen) * 3)
    cfg = torchq.Int4WeightOnlyConfig(group_size=g if g <= 256 else 256, zero_point_domain=domain, scale_dtype=scale_dtype,
                                      layout=Int4NativeLayout())
    # Weights spread over 1e-4..1e4: the ones a scale dtype cannot quantize are refused (tested
    # elsewhere), and a weight beyond the activation dtype's range turns the reference's one-hot
    # products into inf * 0 = NaN: neither says anything about the kernel.
    w = w.to(scale_dtype)
    assume(bool(torch.isfinite(w).all()))
    try:
        impl = cfg.quantize_weight(w).tensor_impl
    except ValueError as e:
        assume("overflows" not in str(e))
        raise
    assume(bool(torch.isfinite(impl.dequantize(x_dtype)).all()))
    x, cols = identity_rows(k, m, x_dtype)
    with factored_off():
        y = dequant_linear.int4_groupwise_linear(*int4_args(impl, x.to(DEVICE)))
    ref_w = reference(torch.ops.torchq.int4_groupwise_linear, *int4_args(impl, torch.eye(k, dtype=x_dtype)))
    assert y.dtype == x_dtype and y.shape == (m, n)
    assert torch.equal(y.cpu(), ref_w[cols])


# -- the streaming GEMV (M <= 4): within its stated bound of the exact product ----------------------
def exact_int4_weight(impl) -> torch.Tensor:
    """``(u + code_base + shift) · scale + zero`` in float64: the weight before any rounding."""
    n, k = impl.shape
    rep = lambda t: t.double().repeat_interleave(impl.group_size, 1)  # noqa: E731
    w = unpack_nibbles(impl.packed).double() + impl.code_base
    if impl.shift is not None:
        w = w + rep(impl.shift)
    w = w * rep(impl.scale)
    if impl.zero is not None:
        w = w + rep(impl.zero)
    return w[:, :k]


UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # unit roundoff


def edge_input(gen, m: int, k: int, x_dtype, edge: str, fp16_scales: tuple[float, float]) -> torch.Tensor:
    """Random ``[m, k]`` activations in ``x_dtype`` with an edge case: a zero first row
    (``zero_x`` / ``zero_row``), all tiny or all huge (1e-30 / 1e30, fp16: ``fp16_scales``)."""
    x = torch.randn(m, k, generator=gen)
    if edge in ("zero_x", "zero_row"):
        x[0] = 0
    elif edge == "tiny":
        x *= 1e-30 if x_dtype != torch.float16 else fp16_scales[0]
    elif edge == "huge":
        x *= 1e30 if x_dtype != torch.float16 else fp16_scales[1]
    return x.to(x_dtype)


def assert_within_stream_bound(y, x, w_exact, w_ref, bias, arith_units):
    """``y`` (the kernel's) against the exact product on the exact weight: one rounding to x's dtype
    plus fp32 sums; against the reference's weights: the per-weight roundings on top."""
    xd = x.double()
    mag = F.linear(xd.abs(), w_exact.abs()) + (0 if bias is None else bias.double().abs())
    exact = F.linear(xd, w_exact) + (0 if bias is None else bias.double())
    k = x.shape[-1]
    out_tol = UNIT[x.dtype] + (k + 2) * 2.0**-24
    err = (y.double() - exact).abs()
    tiny = torch.finfo(x.dtype).smallest_normal * torch.finfo(x.dtype).eps  # half an ulp below the normal range
    assert (err <= out_tol * mag + tiny).all(), f"max error {(err / mag.clamp_min(1e-300)).max():.3g} x sum|xw| > {out_tol:.3g}"
    ref = F.linear(xd, w_ref.double()) + (0 if bias is None else bias.double())
    ref_tol = out_tol + 3 * arith_units
    assert ((y.double() - ref).abs() <= ref_tol * (F.linear(xd.abs(), w_ref.double().abs()) + mag) + tiny).all()


def int4_case(domain, x_dtype, scale_dtype, g, n, k, m, bias, edge, seed):
    """``(impl, x, bias)``: an Int4NativeLayout weight of random rows spread over magnitudes, in the
    scale dtype (``constant_w``: a constant first row), and edge activations."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    if edge == "constant_w":
        w[0] = 0.75
    w = w.to(scale_dtype)
    cfg = torchq.Int4WeightOnlyConfig(group_size=g, zero_point_domain=domain, scale_dtype=scale_dtype, layout=Int4NativeLayout())
    try:
        impl = cfg.quantize_weight(w).tensor_impl
    except ValueError as e:  # weights a scale dtype cannot quantize are refused (tested elsewhere)
        assume("overflows" not in str(e))
        raise
    x = edge_input(gen, m, k, x_dtype, edge, fp16_scales=(1e-4, 1e2))
    return impl, x, torch.randn(n, generator=gen).to(x_dtype) if bias else None


@settings(**SETTINGS)
@given(domain=st.sampled_from([Z.FLOAT, Z.INT, Z.NONE]), x_dtype=st.sampled_from(FLOATS), scale_dtype=st.sampled_from(FLOATS),
       g=st.sampled_from([32, 64, 128, 256]), n=st.integers(1, 70), k=st.integers(1, 600), m=st.integers(1, 4),
       bias=st.booleans(), edge=st.sampled_from(["none", "zero_x", "constant_w", "tiny", "huge"]), seed=st.integers(0, 2**31 - 1))
def test_stream_gemv_int4_is_within_its_bound(domain, x_dtype, scale_dtype, g, n, k, m, bias, edge, seed):
    impl, x, b = int4_case(domain, x_dtype, scale_dtype, g, n, k, m, bias, edge, seed)
    w_ref = impl.dequantize(x_dtype)
    assume(bool(torch.isfinite(w_ref).all()) and bool(torch.isfinite(F.linear(x.double(), w_ref.double()).to(x_dtype)).all()))
    assert stream_gemv.stream_gemv_fits(impl.packed, m, g)
    y = dequant_linear.int4_groupwise_linear(*int4_args(impl, x.to(DEVICE), on(DEVICE, b)))
    assert y.dtype == x_dtype and y.shape == (m, n)
    arith = max(UNIT[scale_dtype], UNIT[x_dtype])
    assert_within_stream_bound(y.cpu(), x, exact_int4_weight(impl), w_ref, b, arith)


@settings(**SETTINGS)
@given(quant_type=st.sampled_from(["nf4", "fp4"]), nested=st.booleans(), x_dtype=st.sampled_from(FLOATS),
       block=st.sampled_from([32, 64, 256, 1024]), n=st.integers(1, 40), blocks=st.integers(1, 3), m=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
def test_stream_gemv_nf4_is_within_its_bound(quant_type, nested, x_dtype, block, n, blocks, m, seed):
    k = block * blocks
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w[0, :block] = 0  # an all-zero block
    cfg = (torchq.nf4_weight_only if quant_type == "nf4" else torchq.fp4_weight_only)(block_size=block, double_quant=nested)
    impl = cfg.quantize_weight(w).tensor_impl
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    y = dequant_linear.blockwise_4bit_linear(*nf4_args(impl, x.to(DEVICE)))
    w32 = impl.dequantize(torch.float32)  # codebook[u] * absmax in fp32: the weight before the cast to x's dtype
    assert_within_stream_bound(y.cpu(), x, w32.double(), impl.dequantize(x_dtype), None, UNIT[x_dtype])



def run_factored(impl, x, bias, tuning):
    """:func:`factored_dot.factored_dot` on an int4 (Int4NativeLayout) or NF4 / FP4 weight, on DEVICE."""
    n, k = impl.shape
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    packed = dev(impl.packed)
    if hasattr(impl, "code_base"):
        tensors, group, gpr, base, fmt = (dev(impl.scale), dev(impl.shift), dev(impl.zero)), impl.group_size, impl.scale.shape[1], impl.code_base, 0
        opt_a, opt_b = impl.shift is not None, impl.zero is not None
    else:
        from torchq.blockwise.codebooks import codebook, dynamic_map

        nested = impl.nested_codes is not None
        group = impl.spec.block_size[1]
        tensors = (codebook(impl.spec.codebook).to(DEVICE), None if nested else dev(impl.absmax), dev(impl.nested_codes),
                   dev(impl.nested_absmax), dynamic_map().to(DEVICE) if nested else None,
                   dev(impl.nested_offset).reshape(1) if nested else None)
        gpr, base, fmt, opt_a, opt_b = k // group, 0.0, 1, nested, False
        packed = packed.reshape(n, k // 2)
    tensors = tuple(packed if t is None else t for t in (*tensors, None, None, None)[:6])
    x2 = x.to(DEVICE)
    assert factored_dot.factored_dot_fits(x2.dtype, packed, group, k)
    out = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=DEVICE)
    return factored_dot.factored_dot(x2, out, n, k, packed, gpr, group, tensors, base, fmt, opt_a, opt_b, dev(bias), 8, tuning).cpu()


def assert_within_factored_bound(y, x, w, mag_w, bias, block_k):
    """The factored kernel's contract: one rounding to x's dtype, and fp32 sums bounded by
    ``(BLOCK_K + K/BLOCK_K + 8)·2^-24`` times ``Σ|x|·mag_w`` (the factored terms' magnitudes)."""
    xd = x.double()
    exact = F.linear(xd, w) + (0 if bias is None else bias.double())
    k = x.shape[-1]
    fp32 = (block_k + k / block_k + 8) * 2.0**-24 * (F.linear(xd.abs(), mag_w) + (0 if bias is None else bias.double().abs()))
    tiny = torch.finfo(x.dtype).smallest_normal * torch.finfo(x.dtype).eps
    bound = UNIT[x.dtype] * (exact.abs() + fp32) + fp32 + tiny
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"max error / bound {(err / bound).max():.3g}"


TUNINGS = [factored_dot.FactoredTuning(), factored_dot.FactoredTuning(block_m=16, block_n=16, block_k=32, programs_per_sm=64),
           factored_dot.FactoredTuning(block_m=32, block_n=32, block_k=64, programs_per_sm=1, decode=1),
           factored_dot.FactoredTuning(block_m=16, block_n=64, block_k=128, programs_per_sm=8, decode=0)]


@settings(**SETTINGS)
@given(domain=st.sampled_from([Z.FLOAT, Z.INT, Z.NONE]), x_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       scale_dtype=st.sampled_from(FLOATS), g=st.sampled_from([32, 64, 128, 256]), n=st.integers(1, 70), k=st.integers(1, 600),
       m=st.integers(1, 40), bias=st.booleans(), edge=st.sampled_from(["none", "zero_x", "constant_w", "tiny", "huge"]),
       tuning=st.sampled_from(range(len(TUNINGS))), seed=st.integers(0, 2**31 - 1))
def test_factored_dot_int4_is_within_its_bound(domain, x_dtype, scale_dtype, g, n, k, m, bias, edge, tuning, seed):
    impl, x, b = int4_case(domain, x_dtype, scale_dtype, g, n, k, m, bias, edge, seed)
    exact = exact_int4_weight(impl)
    assume(bool(torch.isfinite(F.linear(x.double(), exact).to(x_dtype)).all()))
    y = run_factored(impl, x, b, TUNINGS[tuning])
    assert y.dtype == x_dtype and y.shape == (m, n)
    rep = lambda t: t.double().repeat_interleave(g, 1)[:, :k]  # noqa: E731
    u = unpack_nibbles(impl.packed).double()[:, :k]
    c = impl.code_base + (0 if impl.shift is None else rep(impl.shift))
    biased = (128 if x_dtype == torch.bfloat16 else 1024) if TUNINGS[tuning].decode == 1 else 0  # decode 1 multiplies u + bias
    s_ = rep(impl.scale)
    mag = (u + biased) * s_.abs() + ((c - biased) * s_).abs() + (0 if impl.zero is None else rep(impl.zero).abs())
    assert_within_factored_bound(y, x, exact[:, :k], mag, b, min(TUNINGS[tuning].block_k, g))


@settings(**SETTINGS)
@given(quant_type=st.sampled_from(["nf4", "fp4"]), nested=st.booleans(), x_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       block=st.sampled_from([32, 64, 256, 1024]), n=st.integers(1, 40), blocks=st.integers(1, 3), m=st.integers(1, 40),
       bias=st.booleans(), tuning=st.sampled_from(range(len(TUNINGS))), seed=st.integers(0, 2**31 - 1))
def test_factored_dot_nf4_is_within_its_bound(quant_type, nested, x_dtype, block, n, blocks, m, bias, tuning, seed):
    """Codebook formats: the codebook value rounded once to x's dtype, times the block's absmax in fp32."""
    from torchq.blockwise.codebooks import codebook

    k = block * blocks
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w[0, :block] = 0  # an all-zero block
    cfg = (torchq.nf4_weight_only if quant_type == "nf4" else torchq.fp4_weight_only)(block_size=block, double_quant=nested)
    impl = cfg.quantize_weight(w).tensor_impl
    x = torch.randn(m, k, generator=gen).to(x_dtype)
    b = torch.randn(n, generator=gen).to(x_dtype) if bias else None
    y = run_factored(impl, x, b, TUNINGS[tuning])
    plain = impl.to_plain()
    absmax = plain.scale.double().reshape(n, -1).repeat_interleave(block, 1)
    values = codebook(quant_type).to(x_dtype).double()[plain.codes.long()].reshape(n, k)
    assert_within_factored_bound(y, x, values * absmax, (values * absmax).abs(), b, min(TUNINGS[tuning].block_k, block))


def test_factored_dot_takes_only_what_it_reads_right():
    impl = torchq.Int4WeightOnlyConfig(group_size=32, layout=Int4NativeLayout()).quantize_weight(torch.randn(9, 96)).tensor_impl
    fits = factored_dot.factored_dot_fits
    assert fits(torch.bfloat16, impl.packed, 32, 96) and fits(torch.float16, impl.packed, 32, 96)
    assert not fits(torch.float32, impl.packed, 32, 96)  # fp32 x: the reference-exact kernels
    buf = torch.zeros(impl.packed.numel() + 1, dtype=torch.uint8)
    shifted = buf[1:].view(impl.packed.shape)
    assert not fits(torch.bfloat16, shifted, 32, 96)  # not on a word boundary
    assert not fits(torch.bfloat16, impl.packed, 8, 96) and not fits(torch.bfloat16, impl.packed, 48, 96)


def test_stream_gemv_needs_whole_aligned_words():
    """A packed view that does not start on a 4-byte boundary is not read as words: the other
    kernels take it, with the same weights (the one-row GEMV's are the reference's bit for bit)."""
    impl = torchq.Int4WeightOnlyConfig(group_size=32, layout=Int4NativeLayout()).quantize_weight(torch.randn(9, 96)).tensor_impl
    buf = torch.zeros(impl.packed.numel() + 1, dtype=torch.uint8)
    shifted = buf[1:].view(impl.packed.shape)
    shifted.copy_(impl.packed)
    assert stream_gemv.stream_gemv_fits(impl.packed, 1, 32) and not stream_gemv.stream_gemv_fits(shifted, 1, 32)
    assert not stream_gemv.stream_gemv_fits(impl.packed, stream_gemv.STREAM_MAX_M + 1, 32)
    moved = types.SimpleNamespace(**{f: getattr(impl, f) for f in ("shape", "scale", "shift", "zero", "group_size", "code_base",
                                                                    "round_kinds")}, packed=shifted)
    for m in (1, 3):
        x, cols = identity_rows(96, m, torch.bfloat16)
        y = dequant_linear.int4_groupwise_linear(*int4_args(moved, x.to(DEVICE)))
        assert torch.equal(y.cpu(), impl.dequantize(torch.bfloat16)[:, cols].T)


def test_stream_gemv_slices_add_in_a_fixed_order():
    torch.manual_seed(1)
    impl = torchq.Int4WeightOnlyConfig(group_size=32, layout=Int4NativeLayout()).quantize_weight(torch.randn(24, 1024)).tensor_impl
    x = torch.randn(2, 1024, dtype=torch.bfloat16).to(DEVICE)
    tuning = stream_gemv.StreamTuning(block_n=16, block_kw=8, programs_per_sm=64)  # many K slices
    packed = on(DEVICE, impl.packed)  # also the unused pointer arguments': every pointer on the kernel's device
    params = (on(DEVICE, impl.scale), packed, on(DEVICE, impl.zero), packed, packed, packed)
    run = lambda: stream_gemv.stream_gemv(x, torch.empty(2, 24, dtype=x.dtype, device=DEVICE), 24, 1024, packed,  # noqa: E731
                                          32, 32, params, impl.code_base, 0, False, True, None, 8, tuning)
    first = run()
    assert torch.equal(first, run())
    one = stream_gemv.stream_gemv(x, torch.empty(2, 24, dtype=x.dtype, device=DEVICE), 24, 1024, packed, 32, 32, params,
                                  impl.code_base, 0, False, True, None, 8, stream_gemv.StreamTuning(block_n=32, block_kw=128,
                                                                                                    programs_per_sm=1))
    assert_within_stream_bound(first.cpu(), x.cpu(), exact_int4_weight(impl), impl.dequantize(torch.bfloat16), None, UNIT[torch.bfloat16])
    assert_within_stream_bound(one.cpu(), x.cpu(), exact_int4_weight(impl), impl.dequantize(torch.bfloat16), None, UNIT[torch.bfloat16])


@pytest.mark.parametrize("x_dtype", FLOATS)
@pytest.mark.parametrize("m", [1, 2, 4, 5, 16, 40])
def test_int4_products_match_the_reference(x_dtype, m):
    torch.manual_seed(m)
    n, k = 96, 384  # several K slices: the split-K paths run
    w = torch.randn(n, k, dtype=torch.bfloat16)
    impl = torchq.Int4WeightOnlyConfig(group_size=64, layout=Int4NativeLayout()).quantize_weight(w).tensor_impl
    x = torch.randn(2, m, k, dtype=x_dtype)
    bias = torch.randn(n, dtype=torch.float32)
    y = dequant_linear.int4_groupwise_linear(*int4_args(impl, x.to(DEVICE), bias.to(DEVICE)))
    ref = reference(torch.ops.torchq.int4_groupwise_linear, *int4_args(impl, x.double().to(x_dtype), bias))
    # the streaming GEMV and the factored kernel multiply the exact weight, the other kernels the reference's rounded one
    rounded = F.linear(x.double(), impl.dequantize(torch.float64).to(x_dtype).double(), bias.to(x_dtype).double())
    factored = x_dtype != torch.float32 and dequant_linear.FACTORED_ROWS[0] <= 2 * m <= dequant_linear.FACTORED_ROWS[1]
    on_exact = 2 * m <= stream_gemv.STREAM_MAX_M or factored
    exact = F.linear(x.double(), exact_int4_weight(impl), bias.to(x_dtype).double()) if on_exact else rounded
    assert y.shape == (2, m, n) and y.dtype == x_dtype
    floor = {torch.float32: 120, torch.bfloat16: 45, torch.float16: 60}[x_dtype]
    assert sqnr(exact, y.cpu()) > floor and sqnr(rounded, ref) > floor - 5
    again = dequant_linear.int4_groupwise_linear(*int4_args(impl, x.to(DEVICE), bias.to(DEVICE)))
    assert torch.equal(again, y)  # split-K sums in a fixed order: deterministic


def test_split_k_and_empty_inputs():
    impl = torchq.Int4WeightOnlyConfig(group_size=32, layout=Int4NativeLayout()).quantize_weight(torch.randn(8, 64)).tensor_impl
    y = dequant_linear.int4_groupwise_linear(*int4_args(impl, torch.zeros(0, 64, device=DEVICE)))
    assert y.shape == (0, 8)
    assert dequant_linear._split_k(1, 4096, 128, torch.device("cpu")) > 1
    assert dequant_linear._split_k(10_000, 4096, 128, torch.device("cpu")) == 1


def test_int4_op_arguments_are_checked():
    impl = torchq.Int4WeightOnlyConfig(group_size=32, layout=Int4NativeLayout()).quantize_weight(torch.randn(8, 64)).tensor_impl
    with pytest.raises(ValueError, match="last dimension K=64"):
        dequant_linear.int4_groupwise_linear(*int4_args(impl, torch.zeros(2, 63)))



# -- tinygemm's tiled weights written out (the CUDA op from TINYGEMM_MAX_M rows) ----------------------
@settings(**SETTINGS)
@given(t=st.sampled_from([2, 4, 8]), g=st.sampled_from([32, 64, 128, 256]), domain=st.sampled_from([Z.FLOAT, Z.INT, Z.NONE]),
       n=st.integers(1, 40), k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1))
def test_tiled_dequantize_is_tinygemms_weights_bit_for_bit(t, g, domain, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen) * 3)).to(torch.bfloat16)
    aq = torchq.Int4WeightOnlyConfig(group_size=g, layout=TensorCoreTiledLayout(t), zero_point_domain=domain).quantize_weight(w)
    want = tinygemm_dequantize(aq.packed, aq.scales_and_zeros, g, aq.tensor_impl.padded_shape)
    got = tiled_dequant.tiled_dequantize(aq.packed.to(DEVICE), aq.scales_and_zeros.to(DEVICE), g).cpu()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_tiled_dequantize_rounds_once_where_fp32_would_round_twice():
    """``(q - 8)·s`` exactly on a bf16 tie plus a zero far below fp32's last bit: the exact sum lies
    off the tie, so the one correct rounding differs from rounding to fp32 and then to bf16."""
    s = torch.tensor(1.0078125, dtype=torch.bfloat16)  # 3 * s = 3.0234375: halfway between bf16 neighbours
    codes = torch.full((8, 32), 8, dtype=torch.uint8)
    codes[0, 0] = codes[1, 0] = 11  # q - 8 = 3
    codes[2, 0] = codes[3, 0] = 5  # q - 8 = -3
    sz = torch.zeros(1, 8, 2, dtype=torch.bfloat16)
    sz[0, :, 0] = s
    sz[0, :, 1] = torch.tensor([2.0**-30, -(2.0**-30), 2.0**-30, -(2.0**-30), 0, 0, 0, 0], dtype=torch.bfloat16)
    packed = pack_tiled(codes, 2)
    got = tiled_dequant.tiled_dequantize(packed.to(DEVICE), sz.to(DEVICE), 32).cpu()
    want = tinygemm_dequantize(packed, sz, 32, (8, 32))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got[0, 0].item() == 3.03125 and got[1, 0].item() == 3.015625  # the neighbours on each side of the tie
    naive = (3 * s.float() + sz[0, 0, 1].float()).to(torch.bfloat16)  # fp32 sum, then bf16: back on the tie
    assert naive.item() != got[0, 0].item() or (3 * s.float() - sz[0, 1, 1].float()).to(torch.bfloat16).item() != got[1, 0].item()


# -- exact weights: NF4 / FP4 ----------------------------------------------------------------------
@settings(**SETTINGS)
@given(quant_type=st.sampled_from(["nf4", "fp4"]), nested=st.booleans(), x_dtype=st.sampled_from(FLOATS),
       block=st.sampled_from([32, 64, 128]), n=st.integers(1, 40), blocks=st.integers(1, 4), m=st.sampled_from([5, 20, 70]),
       seed=st.integers(0, 2**31 - 1))
def test_nf4_weights_are_the_references_bit_for_bit(quant_type, nested, x_dtype, block, n, blocks, m, seed):
    k = block * blocks
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[0, :block] = 0  # an all-zero block
    cfg = (torchq.nf4_weight_only if quant_type == "nf4" else torchq.fp4_weight_only)(block_size=block, double_quant=nested)
    impl = cfg.quantize_weight(w).tensor_impl
    x, cols = identity_rows(k, m, x_dtype)
    y = dequant_linear.blockwise_4bit_linear(*nf4_args(impl, x.to(DEVICE)))
    ref_w = reference(torch.ops.torchq.blockwise_4bit_linear, *nf4_args(impl, torch.eye(k, dtype=x_dtype)))
    assert torch.equal(y.cpu(), ref_w[cols])


@pytest.mark.parametrize("m", [1, 24])
def test_nf4_products_match_the_reference(m):
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    impl = torchq.nf4_weight_only(block_size=64, double_quant=True).quantize_weight(w.to(torch.bfloat16)).tensor_impl
    x = torch.randn(m, 256, dtype=torch.bfloat16)
    bias = torch.randn(64, dtype=torch.bfloat16)
    y = dequant_linear.blockwise_4bit_linear(*nf4_args(impl, x.to(DEVICE), bias.to(DEVICE)))
    exact = F.linear(x.double(), impl.dequantize(torch.bfloat16).double(), bias.double())
    assert sqnr(exact, y.cpu()) > 45


# -- int8 dynamic: bit for bit -----------------------------------------------------------------------
@settings(**SETTINGS)
@given(x_dtype=st.sampled_from(FLOATS), m=st.integers(1, 40), n=st.integers(1, 50), k=st.integers(1, 150),
       qrange=st.sampled_from([(-127, 127), (-128, 127)]), bias=st.booleans(), seed=st.integers(0, 2**31 - 1),
       edge=st.sampled_from(["none", "zero_row", "nan", "huge", "tiny"]))
def test_int8_dynamic_is_the_reference_bit_for_bit(x_dtype, m, n, k, qrange, bias, seed, edge):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02
    x = (torch.randn(m, k, generator=gen) * 4).to(x_dtype)
    if edge == "zero_row":
        x[0] = 0
    elif edge == "nan":
        x[0, 0] = float("nan")
    elif edge == "huge":
        x[-1] *= torch.finfo(x_dtype).max / 8
    elif edge == "tiny":
        x[0] *= 1e-30 if x_dtype != torch.float16 else 1e-6
    b = torch.randn(n, generator=gen).to(x_dtype) if bias else None
    y = int8_linear.int8_dynamic_linear(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), *qrange, 1e-5,
                                        None if b is None else b.to(DEVICE))
    ref = reference(torch.ops.torchq.int8_dynamic_linear, x, codes, scale, *qrange, 1e-5, b)
    assert y.dtype == x_dtype
    assert torch.equal(y.cpu(), ref) or (torch.isnan(ref).any() and torch.equal(y.cpu().isnan(), ref.isnan())
                                         and torch.equal(y.cpu().nan_to_num(), ref.nan_to_num()))



@settings(**SETTINGS)
@given(x_dtype=st.sampled_from(FLOATS), m=st.integers(1, 40), n=st.integers(1, 50), k=st.integers(1, 150),
       qrange=st.sampled_from([(-127, 127), (-128, 127), (-64, 63)]), zero=st.sampled_from(["0", "min", "max", "mid"]),
       bias=st.booleans(), seed=st.integers(0, 2**31 - 1),
       edge=st.sampled_from(["none", "zero_row", "nan", "inf", "huge", "tiny_scale"]))
def test_int8_static_is_the_reference_bit_for_bit(x_dtype, m, n, k, qrange, zero, bias, seed, edge):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.02
    x = (torch.randn(m, k, generator=gen) * 4).to(x_dtype)
    act_scale = 4.0 / 127
    z = {"0": 0, "min": qrange[0], "max": qrange[1], "mid": (qrange[0] + qrange[1]) // 3}[zero]
    if edge == "zero_row":
        x[0] = 0
    elif edge == "nan":
        x[0, 0] = float("nan")
    elif edge == "inf":
        x[-1, 0], x[0, -1] = float("inf"), float("-inf")
    elif edge == "huge":
        x[-1] *= torch.finfo(x_dtype).max / 8
    elif edge == "tiny_scale":
        act_scale = 2.0**-100  # outputs stay normal fp32 (CUDA flushes subnormal products to zero)
    b = torch.randn(n, generator=gen).to(x_dtype) if bias else None
    args = (act_scale, z, *qrange)
    y = int8_linear.int8_static_linear(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), *args, None if b is None else b.to(DEVICE))
    ref = reference(torch.ops.torchq.int8_static_linear, x, codes, scale, *args, b)
    assert y.dtype == x_dtype
    assert torch.equal(y.cpu().isnan(), ref.isnan()) and torch.equal(y.cpu().nan_to_num(), ref.nan_to_num())


# -- int8 weight-only ---------------------------------------------------------------------------------
@settings(**SETTINGS)
@given(x_dtype=st.sampled_from(FLOATS), m=st.sampled_from([1, 2, 3, 4, 5, 16, 40, 70]), n=st.integers(1, 50),
       k=st.integers(1, 300), bias=st.booleans(), seed=st.integers(0, 2**31 - 1),
       edge=st.sampled_from(["none", "zero_row", "extreme_codes", "tiny", "huge"]))
def test_int8_weight_only_kernels(x_dtype, m, n, k, bias, seed, edge):
    """The GEMV and tensor-core paths within their bound of the exact product; the dequantize path
    (above 64 rows, or codes that are not whole words) bit for bit the reference."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    if edge == "extreme_codes":
        codes[0] = -128
        codes[-1] = 127
    scale = torch.rand(n, generator=gen) * 0.05
    x = edge_input(gen, m, k, x_dtype, edge, fp16_scales=(1e-3, 10))
    b = torch.randn(n, generator=gen).to(x_dtype) if bias else None
    check_byte_weight_kernel(int8_weight.int8_weight_linear, torch.ops.torchq.int8_weight_linear, x, codes, scale, b,
                             codes.double() * scale.double()[:, None])


def check_byte_weight_kernel(kernel, op, x, codes, scale, b, w64):
    """The one-byte weight-only kernels: the dequantize path (above ``DOT_MAX_M`` rows, or codes
    that are not whole words) bit for bit the reference; the GEMV and tensor-core paths within
    their bound of the exact product on the exact weight ``w64``."""
    m, k = x.shape
    y = kernel(x.to(DEVICE), codes.to(DEVICE), scale.to(DEVICE), on(DEVICE, b)).cpu()
    assert y.dtype == x.dtype and y.shape == (m, codes.shape[0])
    ref = reference(op, x, codes, scale, b)
    assume(bool(torch.isfinite(ref).all()))
    if m > int8_weight.DOT_MAX_M or k % 4:
        assert torch.equal(y, ref) or DEVICE == "cuda"
        return
    assert_within_stream_bound(y, x, w64, w64, b, UNIT[x.dtype])



@settings(**SETTINGS)
@given(x_dtype=st.sampled_from(FLOATS), m=st.sampled_from([1, 2, 3, 4, 5, 16, 40, 70]), n=st.integers(1, 50),
       k=st.integers(1, 300), bias=st.booleans(), per_tensor=st.booleans(), seed=st.integers(0, 2**31 - 1),
       edge=st.sampled_from(["none", "zero_row", "every_byte", "subnormal_codes", "tiny", "huge"]))
def test_float8_weight_only_kernels(x_dtype, m, n, k, bias, per_tensor, seed, edge):
    """float8_e4m3fn codes through the int8 weight-only kernels' paths (their byte decoding: every
    finite byte, subnormals, signed zeros): the GEMV and tensor-core paths within their bound of
    the exact product, the dequantize path bit for bit the reference."""
    from torchq.float8 import quantize_float8

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    if edge == "subnormal_codes":
        w[:, 1:] *= 1e-4
    codes, scale = quantize_float8(w, "tensor" if per_tensor else "row")
    if edge == "every_byte":  # the 254 finite bytes, cycled over the weight
        finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
        codes = finite[torch.arange(n * k) % finite.numel()].reshape(n, k).view(torch.float8_e4m3fn)
    x = edge_input(gen, m, k, x_dtype, "zero_row" if edge in ("every_byte", "subnormal_codes") else edge, fp16_scales=(1e-3, 10))
    b = torch.randn(n, generator=gen).to(x_dtype) if bias else None
    check_byte_weight_kernel(int8_weight.float8_weight_linear, torch.ops.torchq.float8_weight_linear, x, codes, scale, b,
                             codes.double() * scale.double())


# -- 4-bit weights x per-block int8 activations ------------------------------------------------------
@pytest.mark.parametrize("m", [1, 3, 9, 40])
@pytest.mark.parametrize("fmt", ["int4", "nf4"])
def test_a8_ops_on_triton_match_the_reference(m, fmt):
    """The activations fake-quantized per 32-block, then the 4-bit kernels in fp32: within fp32
    summation of the reference (which multiplies the same fake-quantized values by exact weights)."""
    from torchq.backends.triton import a8_linear

    torch.manual_seed(m)
    n, k = 40, 256
    w = torch.randn(n, k)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    if fmt == "int4":
        impl = torchq.Int4WeightOnlyConfig(group_size=64, layout=Int4NativeLayout(), scale_dtype=torch.float32).quantize_weight(w).tensor_impl
        args = (impl.packed, impl.scale, impl.shift, impl.zero, [n, k], impl.group_size, impl.code_base)
        y = a8_linear.int4_groupwise_linear_a8(x.to(DEVICE), *(on(DEVICE, a) if isinstance(a, torch.Tensor) else a for a in args),
                                               bias.to(DEVICE))
        ref = reference(torch.ops.torchq.int4_groupwise_linear_a8, x, *args, bias)
        w32 = exact_int4_weight(impl)
    else:
        impl = torchq.nf4_weight_only(block_size=64).quantize_weight(w).tensor_impl
        args = (impl.packed, impl.absmax, impl.nested_codes, impl.nested_absmax, impl.nested_offset, [n, k], 64, "nf4")
        y = a8_linear.blockwise_4bit_linear_a8(x.to(DEVICE), *(on(DEVICE, a) if isinstance(a, torch.Tensor) else a for a in args),
                                               bias.to(DEVICE))
        ref = reference(torch.ops.torchq.blockwise_4bit_linear_a8, x, *args, bias)
        w32 = impl.dequantize(torch.float32).double()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    xq = torchq.PerBlockInt8().fake_quantize(x.float()).double()
    exact = F.linear(xq, w32, bias.double())
    mag = F.linear(xq.abs(), w32.abs()) + bias.double().abs()
    assert ((y.cpu().double() - exact).abs() <= (2.0**-8 + (k + 2) * 2.0**-24) * mag).all()  # one bf16 rounding, fp32 sums
    assert ((ref.double() - exact).abs() <= (2.0**-8 + (k + 2) * 2.0**-24) * mag).all()


@settings(**SETTINGS)
@given(domain=st.sampled_from([Z.FLOAT, Z.INT, Z.NONE]), x_dtype=st.sampled_from(FLOATS), g=st.sampled_from([32, 64, 128, 256]),
       n=st.integers(1, 70), k=st.integers(2, 600).map(lambda v: v - v % 2), m=st.integers(5, 40), bias=st.booleans(),
       edge=st.sampled_from(["none", "zero_row", "nan_block", "constant_w", "tiny", "huge"]), seed=st.integers(0, 2**31 - 1))
def test_int4_a8_int8_dot_is_within_its_bound(domain, x_dtype, g, n, k, m, bias, edge, seed):
    """More than 4 rows: the int8 tensor-core kernel. Its integer block sums are exact; against the
    exact product of the reference's block-quantized activations and exact weights it is off by
    fp32 roundings only (module doc's bound), plus the one rounding to x's dtype."""
    from torchq.backends.triton import a8_linear

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.exp(torch.randn(n, 1, generator=gen))
    if edge == "constant_w":
        w[0] = 0.75
    impl = torchq.Int4WeightOnlyConfig(group_size=g, zero_point_domain=domain, scale_dtype=torch.float32,
                                       layout=Int4NativeLayout()).quantize_weight(w).tensor_impl
    x = edge_input(gen, m, k, x_dtype, "zero_row" if edge == "nan_block" else edge, fp16_scales=(1e-3, 10))
    if edge == "nan_block":
        x[1, k // 2] = float("nan")  # that block's scale is NaN: the row is NaN, as the reference's
    b = torch.randn(n, generator=gen).to(x_dtype) if bias else None
    args = (impl.packed, impl.scale, impl.shift, impl.zero, [n, k], g, impl.code_base)
    y = a8_linear.int4_groupwise_linear_a8(x.to(DEVICE), *(on(DEVICE, a) if isinstance(a, torch.Tensor) else a for a in args),
                                           on(DEVICE, b)).cpu()
    ref = reference(torch.ops.torchq.int4_groupwise_linear_a8, x, *args, b)
    assert y.dtype == x_dtype and y.shape == (m, n)
    assert torch.equal(y.isnan(), ref.isnan())
    finite = torch.isfinite(ref)
    xq = torchq.PerBlockInt8().fake_quantize(x.float()).double().nan_to_num(0.0)
    w64 = exact_int4_weight(impl)
    bd = 0 if b is None else b.double()
    exact = F.linear(xq, w64) + bd
    mag = F.linear(xq.abs(), w64.abs()) + (0 if b is None else bd.abs())
    bound = (k / 32 + 8) * 2.0**-23 * mag + UNIT[x_dtype] * exact.abs() + torch.finfo(x_dtype).tiny
    assume(bool((exact.abs() < torch.finfo(x_dtype).max / 2)[finite].all()))
    assert ((y.double() - exact).abs() <= bound)[finite].all()
    assert ((ref.double() - exact).abs() <= bound + (k + 2) * 2.0**-24 * mag)[finite].all()


@settings(**SETTINGS)
@given(quant_type=st.sampled_from(["nf4", "fp4"]), nested=st.booleans(), x_dtype=st.sampled_from(FLOATS),
       block=st.sampled_from([32, 64, 256]), n=st.integers(1, 40), blocks=st.integers(1, 3), m=st.integers(5, 40),
       bias=st.booleans(), edge=st.sampled_from(["none", "zero_row", "nan_block", "tiny", "huge"]), seed=st.integers(0, 2**31 - 1))
def test_nf4_a8_int8_dot_is_within_its_bound(quant_type, nested, x_dtype, block, n, blocks, m, bias, edge, seed):
    """More than 4 rows: int8 tensor cores on the codebook rounded to int8 (the native CPU kernel's
    table): each weight within absmax·max|c|/254 of the exact codebook's, plus fp32 rounding and the
    rounding to x's dtype."""
    from torchq.backends.triton import a8_linear

    k = block * blocks
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w[0, :block] = 0  # an all-zero block
    cfg = (torchq.nf4_weight_only if quant_type == "nf4" else torchq.fp4_weight_only)(block_size=block, double_quant=nested)
    impl = cfg.quantize_weight(w).tensor_impl
    x = edge_input(gen, m, k, x_dtype, "zero_row" if edge == "nan_block" else edge, fp16_scales=(1e-3, 10))
    if edge == "nan_block":
        x[1, k // 2] = float("nan")
    b = torch.randn(n, generator=gen).to(x_dtype) if bias else None
    args = nf4_args(impl, x)[1:-1]
    y = a8_linear.blockwise_4bit_linear_a8(x.to(DEVICE), *(on(DEVICE, a) if isinstance(a, torch.Tensor) else a for a in args),
                                           on(DEVICE, b)).cpu()
    ref = reference(torch.ops.torchq.blockwise_4bit_linear_a8, x, *args, b)
    assert y.dtype == x_dtype and y.shape == (m, n)
    assert torch.equal(y.isnan(), ref.isnan())
    finite = torch.isfinite(ref)
    xq = torchq.PerBlockInt8().fake_quantize(x.float()).double().nan_to_num(0.0)
    w64 = impl.dequantize(torch.float32).double()
    absmax = impl.scale().reshape(n, -1).double().repeat_interleave(block, 1)
    bd = 0 if b is None else b.double()
    # the kernel's weights: the int8 table's values times absmax / 127, within absmax / 254 of the exact codebook's
    codes = unpack_nibbles(impl.packed.reshape(n, k // 2)).long()
    w_t = a8_linear.int8_codebook(quant_type, torch.device("cpu"))[codes].double() * absmax / 127
    assert ((w_t - w64).abs() <= absmax / 254 + 1e-12).all()
    exact = F.linear(xq, w_t) + bd
    mag = F.linear(xq.abs(), w_t.abs()) + (0 if b is None else bd.abs())
    bound = (k / 32 + 8) * 2.0**-23 * mag + UNIT[x_dtype] * exact.abs() + torch.finfo(x_dtype).tiny
    assume(bool((exact.abs() < torch.finfo(x_dtype).max / 2)[finite].all()))
    assert ((y.double() - exact).abs() <= bound)[finite].all()


def test_quantize_rows_matches_per_token_int8():
    x = torch.randn(5, 77, dtype=torch.bfloat16) * 3
    x[1] = 0
    x[2, :3] = torch.tensor([0.5, -0.5, 1.5]) * (x[2].abs().max().float() / 127)  # ties after scaling
    codes, scale = int8_linear.quantize_rows(x.to(DEVICE), -127, 127, 1e-5)
    ref_codes, ref_scale = torchq.PerTokenInt8().quantize(x)
    assert torch.equal(codes.cpu()[:, :77], ref_codes) and (codes.cpu()[:, 77:] == 0).all()
    assert torch.equal(scale.cpu(), ref_scale.reshape(-1))


# -- bf16 rounding helper ----------------------------------------------------------------------------
@triton.jit
def _round_bf16_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i, mask=i < n)
    tl.store(o_ptr + i, dequant_linear.round_to(v, 1), mask=i < n)


def test_round_to_bf16_is_round_to_nearest_even():
    bits = torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.3895e38, 1.00390625, 1.01171875,
                                    torch.finfo(torch.float32).tiny / 3])])
    out = torch.empty_like(x)
    out = out.to(DEVICE)
    _round_bf16_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), out, x.numel(), BLOCK=1024)
    want = x.to(torch.bfloat16).to(torch.float32)
    assert torch.equal(out.cpu().nan_to_num(), want.nan_to_num()) and torch.equal(out.cpu().isnan(), want.isnan())


# -- conditions ---------------------------------------------------------------------------------------
def test_cuda_rejects_names_the_reason():
    assert cuda_rejects(torch.empty(1, device="meta")) == "no torchq kernel for meta tensors"
    kernels = {k.name: k for k in torchq.linear_kernels()}
    aq = torchq.int8_dynamic_activation_int8_weight().quantize_weight(torch.randn(8, 32))
    assert kernels["int8_dynamic_triton"].check(torch.randn(2, 32), aq, None) == "CUDA kernel, input is on cpu"


# -- CUDA: dispatch, compile, larger shapes --------------------------------------------------------
@cuda
@pytest.mark.parametrize("config", ["int4", "nf4", "int8_dynamic"])
@pytest.mark.parametrize("m", [1, 16, 200])
def test_cuda_dispatch_runs_the_triton_kernels(config, m):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 512)).to(torch.bfloat16).cuda()
    ref_model = nn.Sequential(nn.Linear(1024, 512)).to(torch.bfloat16).cuda()
    ref_model.load_state_dict(model.state_dict())
    cfg = {"int4": torchq.Int4WeightOnlyConfig(layout=Int4NativeLayout()), "nf4": torchq.nf4_weight_only(),
           "int8_dynamic": torchq.int8_dynamic_activation_int8_weight()}[config]
    torchq.quantize_(model, cfg)
    x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
    with torchq.strict():
        y = model(x)
    report = torchq.explain(model, x)
    assert "triton" in str(report).lower() or "int4_native" in str(report) or "blockwise" in str(report)
    assert sqnr(ref_model(x).float(), y.float()) > 15
    compiled = torch.compile(model, fullgraph=True)
    with torchq.strict():
        yc = compiled(x)
    assert sqnr(y.float(), yc.float()) > 40


# -- launch: fewer pipeline stages when shared memory runs out -------------------------------------------
class _StagesLimitedKernel:
    """Stands in for a JIT kernel whose launch needs more shared memory than the device has above
    ``fits`` pipeline stages (what triton raises at launch on a GPU)."""

    def __init__(self, fits: int):
        self.fn = types.SimpleNamespace(__name__=f"limited_{fits}_{id(self)}")
        self.fits, self.tried = fits, []

    def __getitem__(self, grid):
        def launch(*args, num_stages, **meta):
            self.tried.append(num_stages)
            if num_stages > self.fits:
                raise triton.runtime.errors.OutOfResources(64 * 1024 * num_stages, 200 * 1024, "shared memory")

        return launch


def test_launch_retries_with_fewer_stages_and_remembers():
    kernel = _StagesLimitedKernel(fits=1)
    dequant_linear._launch(kernel, (1,), (), dict(BLOCK_N=32, num_stages=3), ("key",))
    assert kernel.tried == [3, 2, 1]
    dequant_linear._launch(kernel, (1,), (), dict(BLOCK_N=32, num_stages=3), ("key",))
    assert kernel.tried == [3, 2, 1, 1]  # the count that fits is remembered for this configuration
    dequant_linear._launch(kernel, (1,), (), dict(BLOCK_N=64, num_stages=3), ("key",))
    assert kernel.tried[4:] == [3, 2, 1]  # other block sizes: their own count


def test_launch_raises_when_one_stage_does_not_fit():
    kernel = _StagesLimitedKernel(fits=0)
    with pytest.raises(triton.runtime.errors.OutOfResources):
        dequant_linear._launch(kernel, (1,), (), dict(BLOCK_N=32, num_stages=2), ("key",))
    assert kernel.tried == [2, 1]


def test_the_lazy_cuda_entry_points_import_their_module_once(monkeypatch):
    """Per call, an entry point goes straight to its kernel: no import machinery (issue 36, item 3)."""
    import importlib

    from torchq.backends import triton as triton_backend
    from torchq.ops.int8 import check_int8_weight_args  # noqa: F401  (the op module is loaded before counting)

    codes = torch.randint(-127, 128, (8, 32), dtype=torch.int8, device=DEVICE)
    scale = torch.rand(8, device=DEVICE) + 0.5
    x = torch.randn(2, 32, device=DEVICE)
    entry = triton_backend._lazy_kernel("int8_weight", "int8_weight_linear")
    first = entry(x, codes, scale)
    calls = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert torch.equal(entry(x, codes, scale), first)
    assert calls == []
