"""The native int4 groupwise, int8 weight-only and int8 dynamic CPU kernels against their references.

* int4 (``Int4NativeLayout``): lossless round trips through the plain form; the layout's
  pure-PyTorch dequantization equals ``dequantize_affine`` bit for bit (float, integer and no
  zero point; fp32 / bf16 / fp16 scales); one-hot activations give the exact weights on every
  ISA and group size; random inputs stay within the fp32 accumulation bound; bf16 scales in groups
  of 32 (the AVX512_BF16 pair tables) with tiny, subnormal and overflowing blocks are bit-exact, and
  bit-equal with TORCHQ_NATIVE_AVX512BF16=0; their bf16 dot path (2-16 bf16 rows) is one-hot exact
  and within the bound, with its fallbacks; so is the scaled dot path of fp32 scales (1-16 bf16
  rows, any group size), on the hardware and on emulated instructions (every CPU), which give the
  hardware's bits;
* int8 weight-only: the same (one-hot exact, accumulation bound); its bf16 dot path (2-32 bf16 rows,
  AVX512_BF16) too, with its fallbacks, on the hardware and on emulated instructions (every CPU),
  which give the hardware's bits;
* int8 dynamic: bit-equal to the reference (per-token quantization, int32 accumulation, fp32
  rescale) on every ISA, for 1 and 2 threads, odd K and N, zero / constant / tiny / huge rows;
* without the library the references run and say so once, and automatic layout choice skips
  the native layout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_blockwise import (
    ISAS,
    NATIVE,
    _floats,
    _scaled_dot_calls,
    assert_within_bound,
    avx512_bf16_runs,
    forced_tiles,
    needs_native,
)

import torchq
from torchq import native
from torchq.backends.native_cpu import library
from torchq.canonical import PlainForm, QuantSpec
from torchq.layouts import Int4CPULayout, Int4NativeLayout, Int8VnniLayout, PlainLayout
from torchq.layouts.int4_native import _cached_native_weight
from torchq.ops.int4 import INT4_GROUPWISE_GROUP_SIZES as GROUP_SIZES
from torchq.ops.int4 import dequantize_int4_groupwise, int4_groupwise_linear
from torchq.ops.int8 import int8_dynamic_linear, int8_weight_linear
from torchq.ops.int8_panels import pack_panels
from torchq.primitives import ZeroPointDomain


@pytest.fixture(autouse=True)
def _no_bf16_dp_gemm():
    """The paths these tests name, without the bf16 dot-product GEMM that takes many bf16 rows
    first on AVX512_BF16 CPUs (its own tests: test_native_bf16_dp.py)."""
    with library.bf16_dp_gemm("off"):
        yield

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


# -- int4 ---------------------------------------------------------------------------------------

def int4_plain(n: int, k: int, g: int, domain: str, scale_dtype: torch.dtype, seed: int = 0, magnitude: float = 1.0) -> PlainForm:
    gen = torch.Generator().manual_seed(seed)
    groups = -(-k // g)
    if domain == "float":  # tinygemm: codes 0..15, float zero
        spec = QuantSpec((1, g), 0, 15, ZeroPointDomain.FLOAT)
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        zero = (torch.randn(n, groups, generator=gen) * magnitude).to(scale_dtype)
    elif domain == "int":  # asymmetric uint4 with integer zero points
        spec = QuantSpec((1, g), 0, 15, ZeroPointDomain.INT)
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        zero = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8)
    else:  # symmetric int4, no zero point
        spec = QuantSpec((1, g), -8, 7, ZeroPointDomain.NONE)
        codes = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
        zero = None
    scale = (torch.rand(n, groups, generator=gen) * magnitude + magnitude / 16).to(scale_dtype)
    plain = PlainForm(codes, scale, zero, spec)
    plain.validate()
    return plain


def term_magnitudes(plain: PlainForm) -> torch.Tensor:
    """The magnitudes of the terms the lut4 decode path sums separately, per weight: |(q - mid) s|
    + |z| for a float zero point; |q s| + |z s| for an integer one (it sums c x and the shift's
    (-z) x apart before scaling: sum_k (q - z) s x = s (sum_k q x - z sum_k x)); |w| otherwise."""
    if plain.spec.zero_point_domain == ZeroPointDomain.INT:
        codes = PlainForm(plain.codes, plain.scale, torch.zeros_like(plain.zero_point), plain.spec).dequantize(torch.float32)
        zero = PlainForm(torch.zeros_like(plain.codes), plain.scale, plain.zero_point, plain.spec).dequantize(torch.float32)
        return codes.abs() + zero.abs()
    if plain.spec.zero_point_domain != ZeroPointDomain.FLOAT:
        return plain.dequantize(torch.float32).abs()
    mid = (plain.spec.quant_min + plain.spec.quant_max + 1) // 2
    scaled = PlainForm(plain.codes, plain.scale, torch.zeros_like(plain.zero_point), plain.spec).dequantize(torch.float32)
    zero = PlainForm(torch.full_like(plain.codes, mid), plain.scale, plain.zero_point, plain.spec).dequantize(torch.float32)
    return scaled.abs() + zero.abs()


def int4_impl(plain: PlainForm):
    return Int4NativeLayout().pack(plain)


def run_int4(x, impl, bias=None):
    rm, ra = impl.round_kinds
    return int4_groupwise_linear(x, impl.packed, impl.scale, impl.shift, impl.zero, list(impl.shape), impl.group_size,
                                 impl.code_base, rm, ra, bias)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 20), k=st.integers(1, 300), g=st.sampled_from(GROUP_SIZES[:4]),
    domain=st.sampled_from(["float", "int", "none"]), scale_dtype=st.sampled_from(FLOATS), seed=st.integers(0, 2**16),
)
def test_int4_layout_round_trips_and_dequantizes_bit_exactly(n, k, g, domain, scale_dtype, seed):
    plain = int4_plain(n, k, g, domain, scale_dtype, seed)
    impl = int4_impl(plain)
    assert impl.to_plain().equal(plain)
    rm, ra = impl.round_kinds
    for dtype in FLOATS:
        ours = dequantize_int4_groupwise(impl.packed, impl.scale, impl.shift, impl.zero, k, g, impl.code_base, rm, ra, dtype)
        assert torch.equal(ours, plain.dequantize(dtype))


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("domain", ["float", "int", "none"])
@pytest.mark.parametrize("scale_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("m", [1, 3, 7, 70], ids=lambda m: f"M{m}")
def test_int4_one_hot_rows_give_the_exact_weights(isa, domain, scale_dtype, m):
    n, k, g = 37, 256, 64
    plain = int4_plain(n, k, g, domain, scale_dtype)
    impl = int4_impl(plain)
    dense = plain.dequantize(torch.float32)
    cols = torch.randint(0, k, (m,), generator=torch.Generator().manual_seed(m))
    x = torch.zeros(m, k)
    x[torch.arange(m), cols] = 1.0
    assert torch.equal(run_int4(x, impl), dense[:, cols].T)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_int4_one_hot_every_group_size_and_padded_k(isa, g):
    n, k = 5, g * 2 + 17  # K not a multiple of g: padded columns meet zero activations
    plain = int4_plain(n, k, g, "float", torch.bfloat16, seed=g)
    dense = plain.dequantize(torch.float32)
    cols = torch.tensor([0, 1, g - 1, g, k - 1])
    x = torch.zeros(len(cols), k)
    x[torch.arange(len(cols)), cols] = 1.0
    assert torch.equal(run_int4(x, int4_impl(plain)), dense[:, cols].T)


@needs_native
@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 40), k=st.integers(1, 400), g=st.sampled_from([32, 64, 128, 256]),
    m=st.sampled_from([1, 2, 3, 4, 5, 8, 17, 66]), dtype=st.sampled_from(FLOATS),
    domain=st.sampled_from(["float", "int", "none"]), scale_dtype=st.sampled_from(FLOATS),
    with_bias=st.booleans(), magnitude=st.sampled_from([1e-4, 1.0, 30.0]), seed=st.integers(0, 2**16),
    fast_bf16=st.booleans(),
)
def test_int4_random_inputs_within_the_accumulation_bound(n, k, g, m, dtype, domain, scale_dtype, with_bias, magnitude, seed, fast_bf16):
    plain = int4_plain(n, k, g, domain, scale_dtype, seed, magnitude)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    with forced_tiles(fast_bf16):
        y = run_int4(x, int4_impl(plain), bias)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_within_bound(y, x, plain.dequantize(torch.float32), bias, dtype, term_magnitudes(plain))


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("m", [1, 4, 9, 80])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_threads_and_isas_within_the_bound(isa, threads, m, scale_dtype):
    plain = int4_plain(131, 512, 128, "float", scale_dtype)
    x = torch.randn(m, 512)
    y = run_int4(x, int4_impl(plain))
    assert_within_bound(y, x, plain.dequantize(torch.float32), None, torch.float32, term_magnitudes(plain))


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("g", GROUP_SIZES)
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_many_rows_one_hot_and_bound(isa, g, scale_dtype):
    """M >= 64 on AVX2 / AVX-512 runs the GEMM path (weight panels of 2W rows x 256 positions): K = 600
    pads to whole groups and ends in a partial 256-block, N = 37 ends in a partial panel; one-hot
    rows give the exact weights and random rows stay within the bound."""
    k, n = 600, 37
    plain = int4_plain(n, k, g, "float", scale_dtype, seed=g)
    impl = int4_impl(plain)
    dense = plain.dequantize(torch.float32)
    for m in (64, 67):
        cols = torch.randint(0, k, (m,), generator=torch.Generator().manual_seed(m))
        one_hot = torch.zeros(m, k)
        one_hot[torch.arange(m), cols] = 1.0
        assert torch.equal(run_int4(one_hot, impl), dense[:, cols].T)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + g))
        bias = torch.randn(n)
        assert_within_bound(run_int4(x, impl, bias), x, dense, bias, torch.float32)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("domain", ["float", "int", "none"])
@pytest.mark.parametrize("scale_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("g", GROUP_SIZES)
def test_int4_decode_paths_one_hot_bound_and_non_finite(isa, domain, scale_dtype, g):
    """M <= 4 on AVX2 runs the decode paths (lut4_linear.h) where the weight allows (fp32 scales).
    One-hot rows give the exact weights, random rows stay within the bound, and a row with inf /
    NaN gives the reference's inf / NaN (such rows take the table path)."""
    for k in (576, 1024):
        if k % g:
            continue
        plain = int4_plain(21, k, g, domain, scale_dtype, seed=g + k)
        impl = int4_impl(plain)
        dense = plain.dequantize(torch.float32)
        for m in (1, 2, 3, 4):
            cols = torch.randint(0, k, (m,), generator=torch.Generator().manual_seed(m))
            one_hot = torch.zeros(m, k)
            one_hot[torch.arange(m), cols] = 1.0
            assert torch.equal(run_int4(one_hot, impl), dense[:, cols].T)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
            for magnitude in (1.0, 1e-30, 1e18, 1e30):  # 1e30: past 2^64, the table path
                xm = x * magnitude
                assert_within_bound(run_int4(xm, impl), xm, dense, None, torch.float32, term_magnitudes(plain))
            # The affine path prescales x by 16^-j (up to 2^-24): exact down to |x| = 2^-102, so
            # scaling a row by a power of two scales the output exactly (here to |x| >= 2^-101).
            xe = x.sign() * x.abs().clamp_min(2.0**-11)
            assert torch.equal(run_int4(xe * 2.0**-90, impl), run_int4(xe, impl) * 2.0**-90)
            if lookup_path(isa, m, g, domain, scale_dtype):  # no prescaled activations: exact further down
                assert torch.equal(run_int4(xe * 2.0**-99, impl), run_int4(xe, impl) * 2.0**-99)
            else:  # below 2^-102 (here |x| >= 2^-110) the call takes the table path, as with decode off
                with library.lut4_paths(decode=False):
                    table = run_int4(xe * 2.0**-99, impl)
                assert torch.equal(run_int4(xe * 2.0**-99, impl), table)
            x[0, 3] = float("inf")
            x[m - 1, k - 1] = float("nan") if m > 1 else x[m - 1, k - 1]
            ref = x.double() @ dense.double().T
            y = run_int4(x, impl).double()
            assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
            assert torch.equal(y[y.isinf()], ref[ref.isinf()])


def lookup_path(isa: str, m: int, g: int, domain: str, scale_dtype: torch.dtype, any_isa: bool = False) -> bool:
    """Whether a call takes the lookup path (lut4_linear.h, DECODE_LOOKUP): AVX-512 (or AVX2 under
    ``lut4_paths(lookup_any_isa=True)``), one row, groups of 32, fp32 scales and zeros, no integer
    zero point."""
    isas = ("avx512", "avx2") if any_isa else ("avx512",)
    return isa in isas and m == 1 and g == 32 and scale_dtype == torch.float32 and domain != "int"


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("domain", ["float", "none"])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("any_isa", [False, True], ids=["preferred", "any_isa"])
def test_int4_g32_one_row_lookup_path(isa, threads, domain, dtype, any_isa):
    """One row of int4 g32 with fp32 scales on AVX-512 takes the lookup path: per block the
    unscaled codebook values against x, times the block's scale, then sum_b z_b X_b. K = 224
    (7 blocks: the zeros' term in one partial vector), 576 (SmolLM2's: one whole vector and a
    partial one) and 1024; N = 23 ends in single rows. One-hot rows give the exact weights, random
    rows stay within the bound (with bias, in every activation dtype), a power-of-two scaling
    down to 2^-99 is exact, inf / NaN rows give the reference's, and with the decode switch off
    (the table path) one-hot rows agree. ``any_isa``: the AVX2 instantiation as well
    (``lut4_paths(lookup_any_isa=True)``), which AVX2 machines run only so."""
    if any_isa and isa != "avx2":
        pytest.skip(f"any_isa runs the AVX2 instantiation (here {isa}: the preferred case covers AVX-512)")
    with library.lut4_paths(lookup_any_isa=any_isa):
        _one_row_lookup_cases(isa, domain, dtype, any_isa)


def _one_row_lookup_cases(isa, domain, dtype, any_isa):
    n = 23
    for k in (224, 576, 1024):
        plain = int4_plain(n, k, 32, domain, torch.float32, seed=k)
        impl = int4_impl(plain)
        dense = plain.dequantize(torch.float32)
        for col in (0, 1, 30, 31, 32, 33, k // 2, k - 1):
            one_hot = torch.zeros(1, k)
            one_hot[0, col] = 1.0
            assert torch.equal(run_int4(one_hot, impl), dense[:, col:col + 1].T), (k, col)
            with library.lut4_paths(decode=False):
                assert torch.equal(run_int4(one_hot, impl), dense[:, col:col + 1].T)
        gen = torch.Generator().manual_seed(k + 1)
        x = torch.randn(1, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        for magnitude in (1.0, 2.0**-10, 100.0) if dtype == torch.float16 else (1.0, 1e-30, 1e18):
            xm = (x * magnitude).to(dtype)
            bm = bias.to(dtype)
            assert_within_bound(run_int4(xm, impl, bm), xm.float(), dense, bm.float(), dtype, term_magnitudes(plain))
        xe = x.sign() * x.abs().clamp_min(2.0**-11)
        if lookup_path(isa, 1, 32, domain, torch.float32, any_isa):
            assert torch.equal(run_int4(xe * 2.0**-99, impl), run_int4(xe, impl) * 2.0**-99)
        x[0, 3] = float("inf")
        x[0, k - 1] = float("nan") if domain == "none" else x[0, k - 1]
        ref = x.double() @ dense.double().T
        y = run_int4(x, impl).double()
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
        assert torch.equal(y[y.isinf()], ref[ref.isinf()])


def edge_scale_plain(n: int, k: int, domain: str, seed: int, overflow: bool = True, g: int = 32) -> PlainForm:
    """A bf16-scale int4 weight (groups of ``g``) whose blocks mix ordinary scales and zeros with ones the AVX512_BF16
    pair tables must not take (magnitudes below 2^-100, bf16 subnormals: vcvtne2ps2bf16 reads fp32
    subnormals as zero) and ones that round to inf (near the bf16 maximum), in both blocks of a pair
    and in one of the two (``overflow=False``: none near the maximum)."""
    plain = int4_plain(n, k, g, domain, torch.bfloat16, seed=seed)
    scale = plain.scale.float()
    zero = plain.zero_point.float() if domain == "float" else None
    edge = [2.0**-101, 2.0**-126, 2.0**-130, 1e-39, 2.0**-100, 2.0**-99] + ([3.0e38] if overflow else [])
    g = torch.Generator().manual_seed(seed)
    for i in range(scale.numel()):
        if torch.rand((), generator=g) < 0.35:
            scale.view(-1)[i] = edge[int(torch.randint(len(edge), (), generator=g))]
        if zero is not None and torch.rand((), generator=g) < 0.35:
            zero.view(-1)[i] = edge[int(torch.randint(len(edge), (), generator=g))] * (1 if i % 2 else -1)
    scale = scale.to(torch.bfloat16)
    out = PlainForm(plain.codes, scale, zero.to(torch.bfloat16) if zero is not None else plain.zero_point, plain.spec)
    out.validate()
    return out


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("domain", ["float", "int", "none"])
@pytest.mark.parametrize("k", [32 * 7, 32 * 8, 32 * 3 + 17])
def test_int4_bf16_scale_edge_blocks_one_hot_and_dequantize_exactly(isa, domain, k):
    """Blocks of 32 with bf16 scales take the AVX512_BF16 pair tables where the CPU has them
    (``native.status().features``), pair by pair, the others the table of one block: tiny, subnormal
    and overflowing scales / zeros, an odd number of blocks (the last alone) and padded K give the
    reference's weights bit for bit, dequantized (with infinite weights too) and in the rows (one-hot,
    M = 1, 3 fused; 7 panels; finite weights: 0 * inf is NaN)."""
    plain = edge_scale_plain(19, k, domain, seed=k)
    impl = int4_impl(plain)
    rm, ra = impl.round_kinds
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantize_int4_groupwise(impl.packed, impl.scale, impl.shift, impl.zero, k, 32, impl.code_base, rm, ra, dtype)
        torch.testing.assert_close(ours, plain.dequantize(dtype), rtol=0, atol=0, equal_nan=True)
    plain = edge_scale_plain(19, k, domain, seed=k, overflow=False)
    impl = int4_impl(plain)
    dense = plain.dequantize(torch.float32)
    assert dense.isfinite().all()
    for m in (1, 3, 7):
        cols = torch.randint(0, k, (m,), generator=torch.Generator().manual_seed(m))
        one_hot = torch.zeros(m, k)
        one_hot[torch.arange(m), cols] = 1.0
        torch.testing.assert_close(run_int4(one_hot, impl), dense[:, cols].T, rtol=0, atol=0, equal_nan=True)


@needs_native
def test_int4_bf16_scale_tables_equal_without_avx512bf16():
    """TORCHQ_NATIVE_AVX512BF16=0 runs the AVX-512 path of CPUs without AVX512_BF16 (on any CPU): the
    pair tables hold the same values, so dequantized weights, fp32 outputs and one-row bf16 outputs
    are bit-equal either way (more bf16 rows take the bf16 dot path: another summation order)."""
    code = """
import sys, torch
from torchq import native
sys.path.insert(0, "tests")
from test_native_int import int4_impl, int4_plain, edge_scale_plain, run_int4
from torchq.ops.int4 import dequantize_int4_groupwise
out = {"features": native.status().features}
for domain in ("float", "int"):
    for plain in (int4_plain(45, 576, 32, domain, torch.bfloat16, seed=3), edge_scale_plain(45, 576, domain, seed=4)):
        impl = int4_impl(plain)
        rm, ra = impl.round_kinds
        out[domain, id(plain) % 2, "dq"] = dequantize_int4_groupwise(impl.packed, impl.scale, impl.shift, impl.zero, 576, 32, impl.code_base, rm, ra, torch.bfloat16)
        for m in (1, 2, 4, 9):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m)).to(dtype)
                out[domain, id(plain) % 2, m, str(dtype)] = run_int4(x, impl)
torch.save(out, sys.argv[1])
"""
    import tempfile

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for flag in ("0", "1"):
            path = os.path.join(tmp, f"out{flag}.pt")
            env = dict(os.environ, TORCHQ_NATIVE_AVX512BF16=flag)
            res = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, res.stderr[-2000:]
            results.append(torch.load(path))
    off, on = results
    assert "avx512_bf16" not in off.pop("features")
    on.pop("features")
    assert off.keys() == on.keys()
    for key in off:
        if key[-1] == str(torch.bfloat16) and key[2] >= 2:
            continue  # the bf16 dot path sums in another order (its bound: test_int4_bf16_dot_path_rows_...)
        torch.testing.assert_close(on[key], off[key], rtol=0, atol=0, equal_nan=True, msg=str(key))


@needs_native
@pytest.mark.parametrize("mode", ["on", "emulated"])
@pytest.mark.parametrize("g,k", [(32, 32 * 18), (32, 32 * 7), (64, 64 * 9), (128, 128 * 3), (256, 256 * 3)])
def test_int4_bf16_dot_path_rows_one_hot_bound_and_fallbacks(mode, g, k):
    """bf16 activations, 1..16 rows, int4 with bf16 scales in groups
    of 32 (tables in pairs) or of a multiple of 64 (a table per group): on AVX512_BF16 CPUs the bf16
    dot path (lut4_linear.h), also for 5..16 rows that would otherwise take dequantized tiles;
    ``emulated`` runs its body on emulated instructions on every CPU.
    One-hot rows give the weights (rounded once to the bf16 output), random rows stay within the
    bound, and tiles with tiny scales or zeros, and activations below 2^-59, take the table path
    (bit-exact one-hot). Elsewhere: the same checks on the paths the CPU has. With the bf16 AMX
    GEMM off: on AMX-BF16 CPUs it takes the rows from 5 (tests/test_native_bf16_amx.py)."""
    with library.bf16_amx("off"), library.lut4_dot(mode):
        _dot_path_checks(k, g, mode == "emulated" or avx512_bf16_runs())


def _dot_path_checks(k: int, g: int, runs: bool) -> None:
    for plain in (int4_plain(45, k, g, "float", torch.bfloat16, seed=k), int4_plain(45, k, g, "int", torch.bfloat16, seed=k + 1),
                  edge_scale_plain(45, k, "float", seed=k + 2, overflow=False, g=g)):
        impl = int4_impl(plain)
        dense = plain.dequantize(torch.float32)
        weight = library.weight_args(impl, _cached_native_weight)
        for m in (1, 2, 5, 9, 16):
            cols = torch.randint(0, k, (m,), generator=torch.Generator().manual_seed(m))
            one_hot = torch.zeros(m, k, dtype=torch.bfloat16)
            one_hot[torch.arange(m), cols] = 1.0
            before = library.lut4_dot_calls()
            want, got = dense[:, cols].T.to(torch.bfloat16), run_int4(one_hot, impl)
            assert library.lut4_dot_calls() - before == runs, m
            # bf16 tiles + torch.mm (where no dot path runs) may flush subnormal weights to zero
            subnormal = (want != 0) & (want.abs() < 2.0**-126)
            assert torch.equal(got[~subnormal], want[~subnormal])
            assert bool(((got[subnormal] == want[subnormal]) | (got[subnormal] == 0)).all())
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).to(torch.bfloat16)
            assert_within_bound(run_int4(x, impl), x, dense, None, torch.bfloat16, term_magnitudes(plain))
            tiny = x * 2.0**-70  # below 2^-59: the table path, exact products of the same weights
            assert_within_bound(run_int4(tiny, impl), tiny, dense, None, torch.bfloat16, term_magnitudes(plain))
        assert weight.dot_max_m(torch.bfloat16) == (16 if runs else 0)
        assert weight.dot_max_m(torch.float32) == 0
        with library.lut4_paths(decode=False):  # the switch of the reordering small-M paths turns it off
            assert weight.dot_max_m(torch.bfloat16) == 0
    # the layout's eager path (decode_linear, and its bound form) takes the same kernel as the op
    lin = torch.nn.Linear(k, 45, bias=False).to(torch.bfloat16)
    torchq.quantize_(lin, torchq.int4_weight_only(group_size=g))
    impl = lin.weight.tensor_impl
    for m in (1, 3, 9, 16, 17):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        assert torch.equal(lin(x), run_int4(x, impl)), m


def fp32_scale_edge_plain(n: int, k: int, g: int, domain: str, seed: int) -> PlainForm:
    """int4_plain with fp32 scales, and rows whose scale or zero the scaled dot path refuses (inf, NaN,
    subnormal, above 2^100: those rows take the table path) or takes (0, FLT_MIN, 2^100)."""
    plain = int4_plain(n, k, g, domain, torch.float32, seed=seed)
    scale = plain.scale.clone()
    for row, v in ((3, float("inf")), (17, float("nan")), (30, 1e-40), (31, 0.0), (32, 2.0**-126), (40, 2.0**100), (44, 2.0**101)):
        scale[row, 1 % scale.shape[1]] = v
    zero = plain.zero_point
    if domain == "float":
        zero = zero.clone()
        zero[5, 0], zero[6, 0], zero[7, 0] = 1e-42, -(2.0**102), 0.0
    out = PlainForm(plain.codes, scale, zero, plain.spec)
    out.validate()
    return out


@needs_native
@pytest.mark.parametrize("mode", ["on", "emulated"])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("g,k", [(32, 576), (32, 224), (32, 160), (64, 576), (64, 3200), (128, 384)])  # 128-position chunks and K ending 32-96 past one
@pytest.mark.parametrize("domain", ["float", "none"])
def test_int4_fp32_scale_scaled_dot_path_one_hot_bound_and_fallbacks(mode, threads, g, k, domain):
    """bf16 activations, 1..16 rows, int4 with fp32 scales: on AVX512_BF16 CPUs the scaled dot path
    (lut4_linear.h: codebook values as bf16 into vdpbf16ps, each 64 positions' lanes scaled once per
    block, the zeros' term per lane), also for 5..16 rows that would otherwise take dequantized
    tiles (17 rows do). K = 224 ends in half a 64-position step; 3200 runs the activation rows in
    chunks of 4 and the weight rows in blocks of 8; N = 45 ends in partial tiles; groups of 32 scale
    each step's halves apart, larger groups whole steps. One-hot rows give the weights (rounded once
    to the bf16 output); random rows stay within the bound with a bias; rows whose scale or zero is
    inf, NaN, subnormal or above 2^100, and calls with activations below 2^-59 or inf / NaN, take the
    table path (the reference's non-finite outputs). Elsewhere the same checks run on the paths the
    CPU has; ``emulated`` runs the path's body on emulated instructions on every CPU (the bf16 AMX
    GEMM, which would take 5+ rows on AMX CPUs, is off)."""
    with library.bf16_amx("off"), library.lut4_scaled_dot(mode):
        _scaled_dot_checks(g, k, domain, mode == "emulated" or avx512_bf16_runs())


def _scaled_dot_checks(g: int, k: int, domain: str, runs: bool) -> None:
    n = 45
    plain = fp32_scale_edge_plain(n, k, g, domain, seed=k + g)
    impl = int4_impl(plain)
    dense = plain.dequantize(torch.float32)
    finite = dense.isfinite().all(1)
    terms = term_magnitudes(plain)[finite]
    weight = library.weight_args(impl, _cached_native_weight)
    assert weight.dot_max_m(torch.bfloat16) == (16 if runs else 0)
    assert weight.dot_max_m(torch.float32) == 0
    for m in (1, 2, 3, 5, 9, 16):
        gen = torch.Generator().manual_seed(m + k)
        cols = torch.cat([torch.tensor([0, k - 1, g, g - 1]), torch.randint(0, k, (m,), generator=gen)])[:m]
        one_hot = torch.zeros(m, k, dtype=torch.bfloat16)
        one_hot[torch.arange(m), cols] = 1.0
        for x1, scaled in ((one_hot, 1.0), (one_hot * 2.0**-70, 2.0**-70)):  # below 2^-59: the table path
            got, calls = _scaled_dot_calls(run_int4, x1, impl)
            assert calls == (scaled == 1.0 and runs)
            want = (dense[finite][:, cols].T * scaled).to(torch.bfloat16)
            # bf16 tiles + torch.mm (where no dot path runs, 5+ rows) may flush subnormal weights to zero
            subnormal = (want != 0) & (want.abs() < 2.0**-126)
            got_finite = got[:, finite]
            assert torch.equal(got_finite[~subnormal], want[~subnormal]), (m, scaled)
            assert bool(((got_finite[subnormal] == want[subnormal]) | (got_finite[subnormal] == 0)).all())
            if runs or m < 5:
                assert torch.equal(got_finite, want)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        bias = torch.randn(n, generator=gen).to(torch.bfloat16)
        y, calls = _scaled_dot_calls(run_int4, x, impl, bias)
        assert calls == runs
        assert_within_bound(y[:, finite], x, dense[finite], bias[finite], torch.bfloat16, terms)
        ref = torch.nn.functional.linear(x.double(), dense.double(), bias.double())
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
        with library.lut4_paths(decode=False):  # the switch of the reordering small-M paths turns it off
            off, calls = _scaled_dot_calls(run_int4, x, impl, bias)
            assert weight.dot_max_m(torch.bfloat16) == 0
        assert calls == 0
        assert_within_bound(off[:, finite], x, dense[finite], bias[finite], torch.bfloat16, terms)
        x[0, 1] = float("inf")
        x[m - 1, k - 1] = float("nan")
        y, calls = _scaled_dot_calls(run_int4, x, impl, bias)
        assert calls == 0
        ref = torch.nn.functional.linear(x.double(), dense.double(), bias.double())
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
        assert torch.equal(y[ref.isinf()].float(), ref[ref.isinf()].float())
    # the layout's eager path (decode_linear, and its bound form) takes the op's kernel
    lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    torchq.quantize_(lin, torchq.int4_weight_only(group_size=g, scale_dtype=torch.float32))
    impl = lin.weight.tensor_impl
    for m in (1, 3, 9, 16, 17):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        got, calls = _scaled_dot_calls(lin, x)
        assert calls == (runs and m <= 16), m
        assert torch.equal(got, run_int4(x, impl)), m


@needs_native
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_int4_fp32_scale_scaled_dot_path_emulated_gives_the_kernels_bits(threads):
    """The emulated body (csrc/lut4_scaled_dot_emulated.cpp: vdpbf16ps's pair order and fp32
    roundings, the per-lane FMAs, the shuffle tree) gives the AVX512_BF16 kernel's bits for every row
    count, groups of 32 to 256, K ending 32, 64 or 96 positions into a 128-position chunk, odd N, float and no zero points, a bias,
    tiny and huge activations within the path's range and a zero scale: so CPUs without the
    instruction test what it computes."""
    if not avx512_bf16_runs():
        pytest.skip("the CPU has no AVX512_BF16 (or the ISA is capped below AVX-512): no kernel to compare with")
    gen = torch.Generator().manual_seed(11)
    for n, k, g in ((45, 224, 32), (64, 576, 32), (9, 288, 32), (12, 576, 64), (17, 1152, 128), (33, 640, 64), (8, 512, 256)):
        for domain in ("float", "none"):
            plain = int4_plain(n, k, g, domain, torch.float32, seed=n + k)
            plain.scale[n // 2] = 0.0
            # the last row's weights 1 at positions 0..7 (scale ORDER_SCALE): with ORDER_X, whether
            # vdpbf16ps adds a lane's odd pair first shows in the bf16 output (_order_row)
            plain.codes[n - 1, :8] = 1 if domain == "none" else 9  # weight 1 * scale (float: (9 - 8) s + 0)
            plain.scale[n - 1, 0] = ORDER_SCALE
            if domain == "float":
                plain.zero_point[n - 1, 0] = 0.0
            impl = int4_impl(plain)
            bias = torch.randn(n, generator=gen).to(torch.bfloat16)
            bias[n - 1] = 0.0
            for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16):
                # lane 0 of a 128-position chunk: words 0, 1 of its 16-bit words' nibbles at bits 0-3
                # (positions 1, 5) in the first vdpbf16ps, then at bits 4-7 (positions 0, 4)
                x = _bits_rows(m, k, gen, (1, 0, 4))
                with library.bf16_amx("off"):
                    (on, calls_on), (emulated, calls_emulated) = (
                        _scaled_dot_calls(_in_scaled_dot_mode, mode, x, impl, bias) for mode in ("on", "emulated"))
                assert calls_on == calls_emulated == 1
                assert float(on[m // 2, n - 1]) == 1.0 + 2.0**-7  # the odd pair first
                assert torch.equal(on, emulated), (n, k, g, domain, m)


# float32 bit patterns at the scaled dot guard's edges: +-0, the subnormals' ends, FLT_MIN, 2^100 and
# the next float past it, inf, NaNs (quiet, signalling, negative)
GUARD_EDGE_BITS = (0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x007FFFFF, 0x00800000, 0x80800000, 0x71800000,
                   0xF1800000, 0x71800001, 0xF1800001, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF)


def _guard_admits(bits: int) -> bool:
    """The scaled dot path's contract for one scale or zero (csrc/lut4_linear.h): 0, or normal and
    at most 2^100 in magnitude."""
    magnitude = bits & 0x7FFFFFFF
    return magnitude == 0 or 0x00800000 <= magnitude <= 0x71800000


@needs_native
@pytest.mark.parametrize("mode", ["on", "emulated"])
@settings(max_examples=150, deadline=None)
@given(count=st.integers(0, 70), zeros=st.booleans(), data=st.data())
def test_int4_scaled_dot_guard_admits_exactly_zero_and_normal_values_up_to_2_100(mode, count, zeros, data):
    """The guard that sends a weight row to the table path where a scale or zero would make a
    weight c s subnormal or overflow (the path's error bound assumes neither) admits exactly 0 and
    the normal values of magnitude <= 2^100, in the scales and the zeros alike, at every position
    of a tile's run (the AVX-512 form: 16 at a time, a masked rest): checked directly, since a
    subnormal weight's difference rarely survives the bf16 output. Arrays of admitted values with
    edge patterns (and any bit pattern) put at drawn positions. On CPUs without the kernel "on" is
    skipped (the next test checks that it reports None)."""
    if mode == "on" and not avx512_bf16_runs():
        pytest.skip("no AVX512_BF16 kernel here (the edge-pattern test checks that 'on' reports None)")
    admitted = st.builds(lambda m, negative: m | (0x80000000 if negative else 0), st.integers(0x00800000, 0x71800000), st.booleans())
    scale_bits = data.draw(st.lists(admitted, min_size=count, max_size=count))
    zero_bits = data.draw(st.lists(admitted, min_size=count, max_size=count)) if zeros else None
    if count:
        pattern = st.one_of(st.sampled_from(GUARD_EDGE_BITS), st.integers(0, 2**32 - 1))
        for _ in range(data.draw(st.integers(0, 3))):
            target = zero_bits if zero_bits is not None and data.draw(st.booleans()) else scale_bits
            target[data.draw(st.sampled_from([0, count - 1, count // 2, data.draw(st.integers(0, count - 1))]))] = data.draw(pattern)
    want = all(_guard_admits(b) for b in scale_bits + (zero_bits or []))
    with library.lut4_scaled_dot(mode):
        got = library.lut4_scaled_dot_values_ok(_floats(scale_bits), None if zero_bits is None else _floats(zero_bits))
    assert got is want, ([hex(b) for b in scale_bits], zero_bits and [hex(b) for b in zero_bits])


@needs_native
def test_int4_scaled_dot_guard_rejects_each_edge_pattern_alone_and_checks_its_arguments():
    """Each edge pattern alone, in the scales or the zeros, at each position of 1 to 33 values:
    only the admitted ones pass (so a bound moved by one float is caught); mismatched or non-fp32
    arguments raise naming the argument, and no kernel (the mode off, the decode paths off, "on"
    without AVX512_BF16) gives None."""
    modes = ["emulated"] + (["on"] if avx512_bf16_runs() else [])
    for mode in modes:
        with library.lut4_scaled_dot(mode):
            for count in (1, 15, 16, 17, 33):
                for bits in GUARD_EDGE_BITS:
                    for at in {0, count // 2, count - 1}:
                        values = [0x3F800000] * count
                        values[at] = bits
                        for in_zeros in (False, True):
                            scales = _floats([0x3F800000] * count if in_zeros else values)
                            zeros = _floats(values) if in_zeros else None
                            assert library.lut4_scaled_dot_values_ok(scales, zeros) is _guard_admits(bits), (mode, count, hex(bits), at)
            assert library.lut4_scaled_dot_values_ok(torch.ones(0)) is True
            with pytest.raises(ValueError, match="zeros: expected a contiguous CPU torch.float32 tensor of 4 elements"):
                library.lut4_scaled_dot_values_ok(torch.ones(4), torch.ones(3))
            with pytest.raises(ValueError, match="scales: expected a contiguous CPU torch.float32 tensor"):
                library.lut4_scaled_dot_values_ok(torch.ones(4, dtype=torch.float64))
            with library.lut4_paths(decode=False):
                assert library.lut4_scaled_dot_values_ok(torch.ones(4)) is None
    with library.lut4_scaled_dot("off"):
        assert library.lut4_scaled_dot_values_ok(torch.ones(4)) is None
    if not avx512_bf16_runs():
        with library.lut4_scaled_dot("on"):
            assert library.lut4_scaled_dot_values_ok(torch.ones(4)) is None
    with pytest.raises(TypeError, match="scales: expected a tensor, got NoneType"):
        library.lut4_scaled_dot_values_ok(None)


@needs_native
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_int4_bf16_dot_path_emulated_gives_the_kernels_bits(threads):
    """The bf16 dot path's emulated body (csrc/lut4_dot_emulated.cpp: vcvtne2ps2bf16's roundings of
    the tables, the zeros' second rounding, vpermw's lookups, vdpbf16ps's pair order, the shuffle
    tree) gives the AVX512_BF16 kernel's bits for every row count, groups of 32 (pairs, and a last
    block alone) to 256, odd N, float and integer zero points, a bias, a zero scale and tiny and huge
    activations within the path's range: so CPUs without the instructions test what it computes."""
    if not avx512_bf16_runs():
        pytest.skip("the CPU has no AVX512_BF16 (or the ISA is capped below AVX-512): no kernel to compare with")
    gen = torch.Generator().manual_seed(12)
    for n, k, g in ((45, 224, 32), (64, 576, 32), (17, 1152, 128), (33, 640, 64), (8, 512, 256)):
        for domain in ("float", "int"):
            plain = int4_plain(n, k, g, domain, torch.bfloat16, seed=n + k)
            plain.scale[n // 2] = 0.0
            impl = int4_impl(plain)
            bias = torch.randn(n, generator=gen).to(torch.bfloat16)
            for m in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16):
                x = (torch.randn(m, k, generator=gen) * torch.exp(4 * torch.randn(m, 1, generator=gen))).to(torch.bfloat16)
                outs = []
                for mode in ("on", "emulated"):
                    with library.bf16_amx("off"), library.lut4_dot(mode):
                        before = library.lut4_dot_calls()
                        outs.append(run_int4(x, impl, bias))
                        assert library.lut4_dot_calls() - before == 1, (mode, m)
                assert torch.equal(outs[0], outs[1]), (n, k, g, domain, m)


# A weight row whose scale is ORDER_SCALE and whose weights at the positions _order_row uses are 1,
# against _order_row: one lane of the dot paths sums 1 (a first vdpbf16ps), then +2^-24 in its even
# pair and -2^-24 in its odd pair. Odd pair first (Intel's definition, and AMD's Zen 4 measured):
# 1 - 2^-24, then exactly 1, and the output ORDER_SCALE rounds up to 1 + 2^-7 in bf16; even pair
# first: 1 + 2^-24 rounds to 1, then 1 - 2^-24, and the output rounds to 1 + 2^-8, a tie, then to 1.
ORDER_SCALE = 1.0 + 2.0**-8 + 2.0**-23


def _order_row(k: int, positions: tuple[int, int, int]) -> torch.Tensor:
    """bf16 activations: 1 at positions[0], +2^-24 at positions[1] (an even pair of the same lane),
    -2^-24 at positions[2] (its odd pair), 0 elsewhere."""
    row = torch.zeros(k, dtype=torch.bfloat16)
    row[positions[0]], row[positions[1]], row[positions[2]] = 1.0, 2.0**-24, -(2.0**-24)
    return row


def _bits_rows(m: int, k: int, gen: torch.Generator, order: tuple[int, int, int]) -> torch.Tensor:
    """bf16 activations for the emulation's bit tests: large (2^40) and small (2^-40) magnitudes
    within the dot paths' range [2^-59, 2^64), and row m // 2 the _order_row at `order`."""
    x = torch.randn(m, k, generator=gen)
    x[0, : k // 3] *= 2.0**40
    x[m - 1, k // 3:] *= 2.0**-40
    x = x.to(torch.bfloat16)
    x[m // 2] = _order_row(k, order)
    return x


def _in_scaled_dot_mode(mode, *args):
    with library.lut4_scaled_dot(mode):
        return run_int4(*args)


def test_int4_weight_only_picks_the_native_layout_and_kernel():
    lin = torch.nn.Linear(256, 64).to(torch.bfloat16)
    torchq.quantize_(lin, torchq.int4_weight_only(group_size=64))
    want = Int4NativeLayout if NATIVE else Int4CPULayout
    assert isinstance(lin.weight.tensor_impl.layout, want)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    kernel, _ = torchq.dispatch.select_linear_kernel(x, lin.weight, lin.bias)
    assert kernel.name == ("int4_native" if NATIVE else "int4_cpu")


def test_int4_native_layout_converts_to_and_from_the_aten_layout():
    plain = int4_plain(70, 300, 128, "float", torch.bfloat16)
    aten = Int4CPULayout().pack(plain)
    assert Int4NativeLayout().pack(aten.to_plain()).to_plain().equal(plain)


def test_int4_op_opcheck_and_gradients():
    plain = int4_plain(12, 96, 32, "int", torch.float16)
    impl = int4_impl(plain)
    x = torch.randn(3, 96, requires_grad=True)
    bias = torch.randn(12, requires_grad=True)
    rm, ra = impl.round_kinds
    args = (x, impl.packed, impl.scale, impl.shift, impl.zero, [12, 96], 32, impl.code_base, rm, ra, bias)
    torch.library.opcheck(torch.ops.torchq.int4_groupwise_linear.default, args)
    run_int4(x, impl, bias).sum().backward()
    assert torch.allclose(x.grad, plain.dequantize(torch.float32).sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)
    assert torch.equal(bias.grad, torch.full((12,), 3.0))


def test_int4_op_errors_name_the_argument():
    impl = int4_impl(int4_plain(4, 64, 32, "float", torch.float32))
    rm, ra = impl.round_kinds
    with pytest.raises(ValueError, match="group_size"):
        int4_groupwise_linear(torch.randn(1, 64), impl.packed, impl.scale, None, impl.zero, [4, 64], 48, 0.0, rm, ra)
    with pytest.raises(ValueError, match="x: expected last dimension"):
        int4_groupwise_linear(torch.randn(1, 63), impl.packed, impl.scale, None, impl.zero, [4, 64], 32, 0.0, rm, ra)
    with pytest.raises(ValueError, match="round_mul"):
        int4_groupwise_linear(torch.randn(1, 64), impl.packed, impl.scale, None, impl.zero, [4, 64], 32, 0.0, 7, ra)


# -- int8 weight-only ---------------------------------------------------------------------------

def int8_weight(n: int, k: int, seed: int = 0, magnitude: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * magnitude / 127 + 1e-8
    return codes, scale, codes.float() * scale[:, None]


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("m", [1, 3, 7, 70], ids=lambda m: f"M{m}")
def test_int8_one_hot_rows_give_the_exact_weights(isa, m):
    n, k = 37, 203
    codes, scale, dense = int8_weight(n, k)
    cols = torch.cat([torch.tensor([0, k - 1]), torch.randint(0, k, (m,))])[:m]
    x = torch.zeros(m, k)
    x[torch.arange(m), cols] = 1.0
    assert torch.equal(int8_weight_linear(x, codes, scale), dense[:, cols].T)


@needs_native
@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 40), k=st.integers(1, 300), m=st.sampled_from([1, 2, 3, 4, 5, 8, 17, 66]),
    dtype=st.sampled_from(FLOATS), with_bias=st.booleans(), magnitude=st.sampled_from([1e-4, 1.0, 30.0]),
    seed=st.integers(0, 2**16), fast_bf16=st.booleans(),
)
def test_int8_weight_only_random_inputs_within_the_accumulation_bound(n, k, m, dtype, with_bias, magnitude, seed, fast_bf16):
    codes, scale, dense = int8_weight(n, k, seed, magnitude)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    with forced_tiles(fast_bf16):
        y = int8_weight_linear(x, codes, scale, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_within_bound(y, x, dense, bias, dtype)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("m", [1, 4, 9, 80])
def test_int8_weight_only_threads_and_isas_within_the_bound(isa, threads, m):
    codes, scale, dense = int8_weight(131, 515)
    x = torch.randn(m, 515)
    y = int8_weight_linear(x, codes, scale)
    assert_within_bound(y, x, dense, None, torch.float32)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_int8_weight_only_gemm_form_one_hot_bound_and_non_finite(isa, threads):
    """M >= 16 on AVX2, 64 on AVX-512 runs the GEMM form (panels of 2W rows x 256 positions of q * s):
    K = 603 ends in a partial 256-block and a partial 8-position group, N = 37 in a partial panel;
    one-hot rows give the exact weights, random rows stay within the bound with a bias, the
    row kernel (the GEMM form switched off) agrees within the same bound, and inf / NaN
    activations give the reference's non-finite outputs."""
    n, k = 37, 603
    codes, scale, dense = int8_weight(n, k, seed=5)
    for m in (16, 17, 22, 64, 67):
        cols = torch.cat([torch.tensor([0, k - 1, 255, 256, 600]), torch.randint(0, k, (m,), generator=torch.Generator().manual_seed(m))])[:m]
        one_hot = torch.zeros(m, k)
        one_hot[torch.arange(m), cols] = 1.0
        assert torch.equal(int8_weight_linear(one_hot, codes, scale), dense[:, cols].T)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + 1))
        bias = torch.randn(n)
        y = int8_weight_linear(x, codes, scale, bias)
        assert_within_bound(y, x, dense, bias, torch.float32)
        with library.lut4_paths(gemm=False):
            assert_within_bound(int8_weight_linear(x, codes, scale, bias), x, dense, bias, torch.float32)
        x[1, 3] = float("inf")
        x[2, 600] = float("nan")
        x[m - 1, 256] = -float("inf")
        y = int8_weight_linear(x, codes, scale, bias)
        ref = torch.nn.functional.linear(x.double(), dense.double(), bias.double()).float()
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
        assert torch.equal(y[ref.isinf()], ref[ref.isinf()])


def _dot_calls(fn, *args):
    """fn(*args) and how many int8 weight-only calls took the bf16 dot path in it."""
    before = library.int8_dot_calls()
    out = fn(*args)
    return out, library.int8_dot_calls() - before


@needs_native
@pytest.mark.parametrize("mode", ["all", "emulated"])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("k", [32 * 18, 203, 3200])
def test_int8_weight_only_bf16_dot_path_one_hot_bound_and_fallbacks(mode, threads, k):
    """bf16 activations, 2..32 rows: on AVX512_BF16 CPUs the int8 bf16 dot path (int8_linear.h: codes
    as bf16 into vdpbf16ps, each output scaled once), also for 5..32 rows that would otherwise take
    dequantized tiles (33 rows do). K = 203 ends in a partial 32-chunk; 3200 runs the activation rows in chunks
    of 4 (to stay in L1), the others in chunks of up to 8; N = 45 ends in partial weight tiles. One-hot rows give the weights q * s (rounded once to
    the bf16 output); random rows stay within the bound with a bias; rows whose scale is 0, inf, NaN
    or subnormal, and calls with activations below 2^-59 or inf / NaN, take the fp32 kernels (the
    reference's non-finite outputs); the panel layout gives the plain layout's bits. Elsewhere the
    same checks run on the paths the CPU has; ``emulated`` runs the path's body on emulated
    instructions on every CPU (the bf16 AMX GEMM, which would take 5+ rows on AMX CPUs, is off).
    Mode ``all`` (every row count also on AMX CPUs, where ``on`` starts at 5 rows: tested below)."""
    with library.bf16_amx("off"), library.int8_dot(mode):
        _int8_dot_checks(k, mode == "emulated" or avx512_bf16_runs())


@needs_native
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_int8_weight_only_bf16_dot_path_emulated_gives_the_kernels_bits(threads):
    """The emulated body (csrc/int8_dot_emulated.cpp: vdpbf16ps's pair order and fp32 roundings, the
    shuffle tree) gives the AVX512_BF16 kernel's bits, for every row count, odd K and N, a bias,
    tiny and huge activations within the path's range and a zero scale: so CPUs without the
    instruction test what it computes."""
    if not avx512_bf16_runs():
        pytest.skip("the CPU has no AVX512_BF16 (or the ISA is capped below AVX-512): no kernel to compare with")
    gen = torch.Generator().manual_seed(7)
    for n, k in ((45, 203), (64, 576), (17, 1100)):
        codes, scale, _ = int8_weight(n, k, seed=n + k)
        scale[n // 2] = 0.0
        codes[n - 1, [0, 32, 33]] = 1  # see ORDER_SCALE: lane 0 sums position 0, then 33 and 32
        scale[n - 1] = ORDER_SCALE
        bias = torch.randn(n, generator=gen).to(torch.bfloat16)
        bias[n - 1] = 0.0
        for m in (2, 3, 4, 5, 7, 8, 9, 16, 23, 32):
            x = _bits_rows(m, k, gen, (0, 32, 33))  # lane 0: positions 0, 1, then 32, 33
            with library.bf16_amx("off"):
                (on, calls_on), (emulated, calls_emulated) = (
                    _dot_calls(_in_mode, mode, x, codes, scale, bias) for mode in ("all", "emulated"))
            assert calls_on == calls_emulated == 1
            assert float(on[m // 2, n - 1]) == 1.0 + 2.0**-7  # the odd pair first
            assert torch.equal(on, emulated), (n, k, m)


@needs_native
def test_int8_weight_only_bf16_dot_path_starts_at_5_rows_on_amx_cpus():
    """Mode "on": on CPUs with AMX-BF16 the dot path takes no call below 5 rows (the fp32 row kernels
    are faster there: csrc/int8_linear.h, kInt8DotAmxCpuMinM), from 5 rows it does (where the AMX GEMM
    is off); elsewhere every row count from 2. Mode "all" takes 2 rows on every CPU with the
    instruction, "emulated" on every CPU. The outputs are within the bound either way."""
    n, k = 45, 203
    codes, scale, dense = int8_weight(n, k, seed=3)
    runs, amx = avx512_bf16_runs(), library.bf16_amx_supported()
    gen = torch.Generator().manual_seed(4)
    with library.bf16_amx("off"):
        for m in (2, 4, 5, 8):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            for mode, takes in (("on", runs and (m >= 5 or not amx)), ("all", runs), ("emulated", True)):
                y, calls = _dot_calls(_in_mode, mode, x, codes, scale)
                assert calls == takes, (mode, m)
                assert_within_bound(y, x, dense, None, torch.bfloat16)


def _in_mode(mode, *args):
    with library.int8_dot(mode):
        return int8_weight_linear(*args)


def _int8_dot_checks(k: int, runs: bool) -> None:
    n = 45
    codes, scale, _ = int8_weight(n, k, seed=k)
    scale[[3, 17, 30, 31, 44]] = torch.tensor([float("inf"), float("nan"), 1e-40, 0.0, -2.0**-126])
    dense = codes.float() * scale[:, None]
    subnormal_scale = (scale != 0) & (scale.abs() < 2.0**-126)
    for m in (2, 3, 5, 9, 16, 21, 32):
        gen = torch.Generator().manual_seed(m + k)
        cols = torch.cat([torch.tensor([0, k - 1]), torch.randint(0, k, (m,), generator=gen)])[:m]
        one_hot = torch.zeros(m, k, dtype=torch.bfloat16)
        one_hot[torch.arange(m), cols] = 1.0
        finite = scale.isfinite()  # an inf / NaN scale's row is NaN: its 0 * inf products
        ref = torch.nn.functional.linear(one_hot.double(), dense.double())
        for x1, scaled in ((one_hot, 1.0), (one_hot * 2.0**-70, 2.0**-70)):  # below 2^-59: the fp32 kernels
            got, calls = _dot_calls(int8_weight_linear, x1, codes, scale)
            assert calls == (scaled == 1.0 and runs)
            want, got_finite = (dense[finite][:, cols].T * scaled).to(torch.bfloat16), got[:, finite]
            # bf16 tiles + torch.mm (where no dot path runs) may flush subnormal weights to zero
            subnormal = (want != 0) & (want.abs() < 2.0**-126)
            assert torch.equal(got_finite[~subnormal], want[~subnormal])
            assert bool(((got_finite[subnormal] == want[subnormal]) | (got_finite[subnormal] == 0)).all())
            if runs and scaled == 1.0:  # the dot path's subnormal-scale rows take the fp32 kernel: exact
                assert torch.equal(got_finite, want)
            assert bool(got[:, ~finite].isnan().all()) and bool(ref[:, ~finite].isnan().all())
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        bias = torch.randn(n, generator=gen).to(torch.bfloat16)
        y, calls = _dot_calls(int8_weight_linear, x, codes, scale, bias)
        assert calls == runs
        assert_within_bound(y[:, finite], x, dense[finite], bias[finite], torch.bfloat16)
        ref = torch.nn.functional.linear(x.double(), dense.double(), bias.double())
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
        with library.lut4_paths(decode=False):  # the switch of the reordering small-M paths turns it off
            off, calls = _dot_calls(int8_weight_linear, x, codes, scale, bias)
        assert calls == 0
        assert_within_bound(off[:, finite], x, dense[finite], bias[finite], torch.bfloat16)
        x[0, 1] = float("inf")
        x[m - 1, k - 1] = float("nan")
        y, calls = _dot_calls(int8_weight_linear, x, codes, scale, bias)
        assert calls == 0
        # (not the subnormal scale's row: bf16 tiles + torch.mm, where they run, flush its weights)
        y, ref = y[:, ~subnormal_scale], torch.nn.functional.linear(x.double(), dense.double(), bias.double())[:, ~subnormal_scale]
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
        assert torch.equal(y[ref.isinf()].float(), ref[ref.isinf()].float())
    # the layouts' eager paths (plain and panels, decode_linear and its bound form) take the op's kernel
    lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    panels = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
    panels.load_state_dict(lin.state_dict())
    torchq.quantize_(lin, torchq.int8_weight_only())
    torchq.quantize_(panels, torchq.int8_weight_only(layout=Int8VnniLayout()))
    impl = lin.weight.tensor_impl
    for m in (3, 9, 17, 32, 33):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        want, calls = _dot_calls(int8_weight_linear, x, impl.codes, impl.scale)
        assert calls == (m <= 32 and runs), m
        for module in (lin, lin, panels):  # the second call of lin: its bound call
            got, calls = _dot_calls(module, x)
            assert torch.equal(got, want) and calls == (m <= 32 and runs), m


# -- int8 dynamic -------------------------------------------------------------------------------

def dynamic_reference(x, codes, scale, qmin=-127, qmax=127, eps=1e-5, bias=None):
    with native.disabled():
        return int8_dynamic_linear(x, codes, scale, qmin, qmax, eps, bias)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("m", [1, 3, 4, 5, 33])
@pytest.mark.parametrize("qrange", [(-127, 127), (-63, 63), (-64, 63)], ids=lambda r: f"q{r[0]}_{r[1]}")
def test_int8_dynamic_is_bit_equal_to_the_reference(isa, threads, dtype, m, qrange):
    """Every range, and 7-bit ones (within [-64, 63]: the AVX2 narrow kernels, codes + 64 against
    the signed weights, minus 64 * the row sums), in the row tiles and (33 rows) the GEMM form."""
    qmin, qmax = qrange
    codes, scale, _ = int8_weight(67, 4099 if m == 1 else 131)
    codes[0] = -128  # the narrow kernels' widest pair: 2 * 127 * 128
    k = codes.shape[1]
    x = (torch.randn(m, k) * 3).to(dtype)
    bias = torch.randn(67).to(dtype)
    y = int8_dynamic_linear(x, codes, scale, qmin, qmax, 1e-5, bias)
    assert torch.equal(y, dynamic_reference(x, codes, scale, qmin, qmax, bias=bias))


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("gemm", [True, False], ids=["gemm", "rows"])
@pytest.mark.parametrize("qrange", [(-63, 63), (-64, 63), (-8, 7)], ids=lambda r: f"q{r[0]}_{r[1]}")
def test_int8_dynamic_narrow_kernels_bit_equal(isa, threads, gemm, qrange):
    """7-bit activation ranges from 8 rows on AVX2 (and AVX-512 without VNNI): the narrow GEMM form,
    or with the GEMM forms off its row tiles; K = 203 ends in a partial panel step and a partial
    32-code tile, N = 37 in a partial panel; weights -128 and 127 reach the widest pairs."""
    qmin, qmax = qrange
    codes, scale, _ = int8_weight(37, 203, seed=3)
    codes[0], codes[1] = -128, 127
    for m in (7, 8, 9, 17, 33):
        x = torch.randn(m, 203, generator=torch.Generator().manual_seed(m)) * 4
        x[0, 0], x[m - 1, 5] = 100.0, -100.0  # codes at both ends of the range
        with library.lut4_paths(gemm=gemm):
            y = int8_dynamic_linear(x, codes, scale, qmin, qmax, 1e-5)
        assert torch.equal(y, dynamic_reference(x, codes, scale, qmin, qmax))


@needs_native
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 30), k=st.integers(1, 260), m=st.sampled_from([1, 2, 3, 5, 9, 32, 37]), dtype=st.sampled_from(FLOATS),
    rows=st.lists(st.sampled_from(["randn", "zeros", "constant", "tiny", "huge", "one-spike"]), min_size=1, max_size=9),
    qrange=st.sampled_from([(-127, 127), (-63, 63), (-8, 7)]), seed=st.integers(0, 2**16),
)
def test_int8_dynamic_edge_rows_bit_equal(n, k, m, dtype, rows, qrange, seed):
    qmin, qmax = qrange
    codes, scale, _ = int8_weight(n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    for i in range(m):
        kind = rows[i % len(rows)]
        if kind == "zeros":
            x[i] = 0
        elif kind == "constant":
            x[i] = -2.5
        elif kind == "tiny":
            x[i] *= 1e-30
        elif kind == "huge":
            x[i] *= 1e30 if dtype != torch.float16 else 1e4
        elif kind == "one-spike":
            x[i] = 0
            x[i, seed % k] = 7.0
    x = x.to(dtype)
    y = int8_dynamic_linear(x, codes, scale, qmin, qmax, 1e-5)
    assert torch.equal(y, dynamic_reference(x, codes, scale, qmin, qmax))


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("m", [4, 34])  # the row tiles and (from 32 rows) the GEMM form
def test_int8_dynamic_non_finite_rows_match_the_reference(isa, m):
    """NaN and ±inf rows give the reference's outputs (NaN: an inf row's codes are all 0), bit for bit."""
    codes, scale, _ = int8_weight(8, 40)
    x = torch.randn(m, 40)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3, 0] = -float("inf")
    y, ref = int8_dynamic_linear(x, codes, scale, -127, 127, 1e-5), dynamic_reference(x, codes, scale)
    assert torch.equal(y[0], ref[0]) and torch.equal(y[4:], ref[4:])
    assert y[1:4].isnan().all() and ref[1:4].isnan().all()


def test_int8_configs_pick_the_native_kernels():
    for cfg, name in ((torchq.int8_weight_only(), "int8_weight_only_native"), (torchq.int8_dynamic_activation_int8_weight(), "int8_dynamic_native")):
        lin = torch.nn.Linear(64, 16)
        torchq.quantize_(lin, cfg)
        assert isinstance(lin.weight.tensor_impl.layout, PlainLayout)
        for dtype in FLOATS:
            kernel, verdicts = torchq.dispatch.select_linear_kernel(torch.randn(2, 64, dtype=dtype), lin.weight, None)
            if NATIVE:
                assert kernel.name == name
            else:
                assert kernel.name != name and "native library not available" in dict(verdicts)[name]


def test_int8_ops_opcheck():
    codes, scale, _ = int8_weight(10, 48)
    x, bias = torch.randn(3, 48), torch.randn(10)
    torch.library.opcheck(torch.ops.torchq.int8_weight_linear.default, (x, codes, scale, bias))
    torch.library.opcheck(torch.ops.torchq.int8_dynamic_linear.default, (x, codes, scale, -127, 127, 1e-5, bias))


def test_int8_dynamic_with_full_range_runs_the_reference_and_says_why():
    codes, scale, _ = int8_weight(10, 48)
    x = torch.randn(2, 48)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = int8_dynamic_linear(x, codes, scale, -128, 127, 1e-5)
    assert torch.equal(y, dynamic_reference(x, codes, scale, -128, 127))
    if NATIVE:
        assert any(issubclass(w.category, native.NativeMissingWarning) and "[-128, 127]" in str(w.message) for w in caught)


# -- without the library ------------------------------------------------------------------------

def test_disabled_library_runs_the_references_and_warns_once():
    plain = int4_plain(8, 64, 32, "float", torch.float32)
    impl = int4_impl(plain)
    codes, scale, _ = int8_weight(8, 64)
    x = torch.randn(2, 64)
    with native.disabled(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y4 = run_int4(x, impl)
        run_int4(x, impl)
        y8 = int8_weight_linear(x, codes, scale)
    assert torch.equal(y4, torch.nn.functional.linear(x, plain.dequantize(torch.float32)))
    assert torch.equal(y8, torch.nn.functional.linear(x, codes.float() * scale[:, None]))
    # inside disabled() the reference is the intended path: no warning; outside, a missing library warns once per op
    assert not [w for w in caught if issubclass(w.category, native.NativeMissingWarning)]


def test_without_the_library_auto_choice_skips_the_native_layout_and_ops_warn():
    code = (
        "import warnings, torch, torchq\n"
        "from torchq.layouts import Int4CPULayout, Int4NativeLayout\n"
        "assert not torchq.native.status().available\n"
        "lin = torch.nn.Linear(128, 8)\n"
        "torchq.quantize_(lin, torchq.int4_weight_only(group_size=32))\n"
        "assert isinstance(lin.weight.tensor_impl.layout, Int4CPULayout), lin.weight\n"
        "lin2 = torch.nn.Linear(128, 8)\n"
        "torchq.quantize_(lin2, torchq.int4_weight_only(group_size=32, layout=Int4NativeLayout()))\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    lin2(torch.randn(1, 128)); lin2(torch.randn(1, 128))\n"
        "msgs = [str(x.message) for x in w if issubclass(x.category, torchq.native.NativeMissingWarning)]\n"
        "assert len(msgs) == 1 and 'int4_groupwise_linear' in msgs[0] and 'TORCHQ_NATIVE=0' in msgs[0], msgs\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TORCHQ_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


# -- int8 rows as bf16: the AVX512_BF16 conversion (csrc/int8_linear.h, "bf16 dequantization") -----

def _edge_scale_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes over the whole range and a scale of every kind: normal (tiny, huge: products overflow to
    inf), 0, -0, inf, NaN, subnormal (its rows take the generic kernel)."""
    codes, scale, _ = int8_weight(n, k, seed)
    codes[0, : min(k, 4)] = torch.tensor([-128, 127, 0, -1], dtype=torch.int8)[: min(k, 4)]
    edge = [2.0**-126, -2.0**-120, 1e38, -3e38, 0.0, -0.0, float("inf"), float("nan"), 1e-40, -2.0**-149, 1.0 + 2.0**-9]
    scale[1 : 1 + len(edge)] = torch.tensor(edge)
    return codes, scale


@needs_native
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_int8_bf16_dequantization_gives_the_same_bits_in_every_mode(threads):
    """Rows as bf16 q * s through tq_dequantize_rows (the dequantized tiles' source), row-major and
    in panel order, for K with and without a partial 32-chunk: the generic kernel ("off"), the
    vcvtne2ps2bf16 kernel ("on" / "all", on CPUs with AVX512_BF16) and its emulated body ("emulated",
    every CPU) give the same bits, which are torch's rounding of the fp32 products (the subnormal
    scale's rows too: they take the generic kernel; NaN as the kernels' one NaN). Also through the bf16 AMX GEMM (emulated tiles:
    every CPU), whose panels they decode."""
    for n, k in ((20, 1), (20, 31), (33, 32), (17, 33), (40, 203), (16, 576)):
        codes, scale = _edge_scale_weight(n, k, seed=n * k)
        want = (codes.float() * scale[:, None]).to(torch.bfloat16)
        outs = {}
        for mode in library.INT8_DOT_MODES:
            with library.int8_dot(mode):
                for name, layout in (("plain", "plain"), ("panels", "panels")):
                    weight = (library.int8_weight("t", codes.reshape(-1), scale, n, k) if layout == "plain"
                              else _int8_panel_weight(codes, scale))
                    out = torch.empty(n, k, dtype=torch.bfloat16)
                    library.dequantize_rows(weight, 0, n, out)
                    outs[mode, name] = out
        nan = want.isnan()
        for key, out in outs.items():
            assert torch.equal(out.view(torch.int16), outs["off", "plain"].view(torch.int16)), (n, k, key)
            assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16)), (n, k, key)
            assert bool(out[nan].isnan().all())
    n, k = 40, 203
    codes, scale = _edge_scale_weight(n, k, seed=9)
    finite = scale.isfinite() & (scale.abs() < 1e30)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with library.bf16_amx("emulated"):
        ys = []
        for mode in library.INT8_DOT_MODES:
            with library.int8_dot(mode):
                before = library.bf16_amx_calls()
                ys.append(int8_weight_linear(x, codes, scale))
                assert library.bf16_amx_calls() - before == 1
    for y in ys[1:]:
        assert torch.equal(y.view(torch.int16), ys[0].view(torch.int16))
    dense = (codes.float() * scale[:, None]).to(torch.bfloat16).float()
    assert_within_bound(ys[0][:, finite], x, dense[finite], None, torch.bfloat16)


def _int8_panel_weight(codes: torch.Tensor, scale: torch.Tensor) -> library.NativeWeight:
    """codes [n, k] in panel order (torchq's Int8VnniLayout) as a native weight (kept alive by it)."""
    n, k = codes.shape
    panels, sums = pack_panels(codes)
    return library.int8_panel_weight("t", panels, sums, scale, n, k)
