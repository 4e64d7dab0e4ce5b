"""The AMX GEMM form of the native int8 dynamic and static kernels (``csrc/int8_amx_body.h``).

From 8 activation rows on CPUs with AMX-INT8, int8 x int8 tiles (``tdpbssd``) sum the products
exactly in int32: the outputs must be the reference's bits, as on every other path. Its body runs
here twice: on emulated tiles (``library.int8_amx("emulated")``, every machine, CI's AVX2-only
ones included) and on the AMX instructions where this CPU has them (skipped elsewhere); a call
counter shows which ran. The same cases with the form off run the VNNI / AVX2 GEMM forms, which
AMX machines otherwise no longer reach from 8 rows. Shapes
cover partial 64-position steps, partial 16-row weight panels (the copied edge tiles), partial
16-row activation tiles and more than four of them (several passes over a panel), one and two
threads (panels split between them), zero points, ±inf / NaN rows and every activation dtype.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_blockwise import NATIVE, needs_native
from test_native_int import dynamic_reference
from test_native_int8_static import QCASES, activations, assert_same_bits, ref, weight

from torchq import native
from torchq.backends.native_cpu import library
from torchq.ops.int8 import int8_dynamic_linear, int8_static_linear

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
MS = [8, 15, 16, 17, 63, 64, 65, 130]
SHAPES = [(1, 17), (64, 16), (100, 33), (576, 40), (130, 1), (4099, 19)]  # (K, N)
HARDWARE = NATIVE and library.int8_amx_supported()


@pytest.fixture(params=["emulated", "hardware", "off"])
def amx(request):
    """The AMX mode for one test: its body on emulated tiles, on AMX (where the CPU has it), or
    off (the other GEMM forms). After the test, the calls from 8 rows must have taken the AMX form
    exactly when it was on."""
    saved = native.status().isa
    if request.param == "hardware":
        native.set_isa("avx512")
        if not HARDWARE or native.status().isa != "avx512":
            native.set_isa(saved)
            pytest.skip("no AMX-INT8 on this CPU (or Linux refused it, or the AVX-512 ISA is capped)")
    before = library.int8_amx_calls()
    with library.int8_amx({"emulated": "emulated", "hardware": "on", "off": "off"}[request.param]):
        yield request.param
    native.set_isa(saved)
    ran = library.int8_amx_calls() - before
    assert (ran > 0) == (request.param != "off"), (request.param, ran)


@needs_native
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("m", MS)
def test_dynamic_is_bit_equal_to_the_reference(amx, threads, m):
    for i, (k, n) in enumerate(SHAPES):
        codes, scale = weight(n, k, seed=i)
        for dtype in FLOATS:
            x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m + i)) * 3).to(dtype)
            bias = torch.randn(n).to(dtype)
            y = int8_dynamic_linear(x, codes, scale, -127, 127, 1e-5, bias)
            assert_same_bits(y, dynamic_reference(x, codes, scale, bias=bias), (amx, m, k, n, dtype))


@needs_native
@pytest.mark.parametrize("m", [8, 33, 70])
def test_static_with_zero_points_is_bit_equal(amx, m):
    """Static activations pad their codes with the zero point past K: the edge tiles' zero weights
    must cancel them; the zero point's correction z * rowsum(w) is subtracted modulo 2^32."""
    for i, (k, n) in enumerate(SHAPES[:5]):
        codes, scale = weight(n, k, seed=i)
        for j, (z, qmin, qmax) in enumerate(QCASES):
            s = (0.03, 0.25, 1e5, 0.5)[(i + j) % 4]
            for dtype in FLOATS:
                x = activations(m, k, dtype, s, seed=i + j)
                y = int8_static_linear(x, codes, scale, s, z, qmin, qmax)
                assert_same_bits(y, ref(x, codes, scale, s, z, qmin, qmax), (amx, m, k, n, z, qmin, qmax, s, dtype))


@needs_native
def test_non_finite_rows_match_the_reference(amx):
    codes, scale = weight(21, 100, seed=5)
    x = torch.randn(40, 100)
    x[1, 5] = float("nan")
    x[17, 7] = float("inf")
    x[39, 0] = -float("inf")
    y, expected = int8_dynamic_linear(x, codes, scale, -127, 127, 1e-5), dynamic_reference(x, codes, scale)
    assert_same_bits(y, expected)
    # bf16 activations: the AMX epilogue rounds its own outputs to bf16 (NaN rows to 0x7FC0),
    # full and partial 16-column panels, huge values rounding to inf
    xb = (torch.randn(40, 100) * 3).to(torch.bfloat16)
    xb[1, 5], xb[17, 7], xb[39, 0], xb[20, 3] = float("nan"), float("inf"), -float("inf"), 3e38
    assert_same_bits(int8_dynamic_linear(xb, codes, scale, -127, 127, 1e-5), dynamic_reference(xb, codes, scale))


@needs_native
def test_it_runs_from_eight_rows_and_under_the_gemm_switch():
    """From 8 rows only, and not with the GEMM forms switched off (the call counter says which
    path ran); the bits are the reference's either way."""
    codes, scale = weight(33, 100, seed=2)
    for m, gemm, takes_amx in ((1, True, False), (7, True, False), (8, True, True), (40, True, True), (40, False, False)):
        x = torch.randn(m, 100)
        expected = dynamic_reference(x, codes, scale)
        with library.int8_amx("emulated"), library.lut4_paths(gemm=gemm):
            before = library.int8_amx_calls()
            assert_same_bits(int8_dynamic_linear(x, codes, scale, -127, 127, 1e-5), expected)
            assert (library.int8_amx_calls() > before) == takes_amx, (m, gemm)


@needs_native
def test_the_mode_switch_checks_its_argument():
    with pytest.raises(ValueError, match="mode: expected one of"):
        with library.int8_amx("fast"):
            pass
    assert library.library().tq_set_int8_amx(7) == -1  # the C entry refuses it too, unchanged


@needs_native
@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 300), m=st.integers(8, 80), dtype=st.sampled_from(FLOATS),
       qcase=st.sampled_from(QCASES + [None]), seed=st.integers(0, 2**16))
def test_random_shapes_on_emulated_tiles(n, k, m, dtype, qcase, seed):
    codes, scale = weight(n, k, seed=seed)
    with library.int8_amx("emulated"):
        if qcase is None:
            x = (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 5).to(dtype)
            assert_same_bits(int8_dynamic_linear(x, codes, scale, -127, 127, 1e-5), dynamic_reference(x, codes, scale))
        else:
            z, qmin, qmax = qcase
            x = activations(m, k, dtype, 0.25, seed=seed)
            assert_same_bits(int8_static_linear(x, codes, scale, 0.25, z, qmin, qmax), ref(x, codes, scale, 0.25, z, qmin, qmax))
