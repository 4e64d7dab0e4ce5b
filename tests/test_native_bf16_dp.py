"""The bf16 dot-product GEMM of the native weight-only kernels (``csrc/bf16_dp_gemm.h``).

For bf16 activations of many rows (lut4: NF4 and FP4 from 5 rows, int4 of every zero-point domain
with fp32 scales from 9, with bf16 scales in groups of 32 from 17; int8 weight-only from 10, or
from 1 in panel order) on CPUs with AVX512_BF16 where the AMX GEMM does not take the call, each
panel of 16 weight rows becomes bf16 pairs and ``vdpbf16ps`` multiplies them with the activations'
pairs: every product exact, fp32 sums in an order of their own. The lut4 panels hold the
dequantized tiles' bf16 values, built once per call; int8 panels hold the codes (row-major ones
put in panel order once per call), converted in registers, each output scaled once. So the outputs must be within the fp32 sum bound of the reference (the bf16 weights times
the bf16 activations; int8's exact q * s weights are within the same bound), exactly the weight
for a one-hot row, and the calls it cannot take must go elsewhere. Its body runs here on emulated
instructions (every machine, CI's AVX2-only ones included: the same bits as the instructions,
checked where the CPU has them) and on AVX512_BF16 (skipped elsewhere); with it off the same cases
run the other paths. A call counter shows which ran. Shapes cover partial 16-row panels and
activation blocks, K not a multiple of 32 (int8), one and two threads.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_bf16_amx import CONFIGS, SHAPES, bf16_weight, check_bound, mode_under_test, outputs_within_bound, quantized
from test_native_blockwise import NATIVE, avx512_bf16_runs, needs_native

from torchq import native
from torchq.backends.native_cpu import library

HARDWARE = NATIVE and "avx512_bf16" in (native.status().features or ())
MS = [5, 9, 16, 17, 25, 33, 70]


@pytest.fixture(autouse=True)
def _gemm_on_amx_off():
    """Every test here with the GEMM switch on and the AMX GEMM off (on AMX CPUs it would take 5-64 rows first)."""
    with library.lut4_paths(), library.bf16_amx("off"):
        yield


@pytest.fixture(params=["emulated", "hardware", "off"])
def dp(request):
    """The GEMM's mode for one test (:func:`test_native_bf16_amx.mode_under_test`; the instructions
    at every row count: "all", as "on" on CPUs without AMX)."""
    yield from mode_under_test(request.param, library.bf16_dp_gemm, library.bf16_dp_gemm_calls, HARDWARE,
                               "no AVX512_BF16 on this CPU (or TORCHQ_NATIVE_AVX512BF16=0, or the AVX-512 ISA is capped)", "all")


@needs_native
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("name", CONFIGS + ["int4-zint-g32", "int4-none-g32"])
def test_outputs_are_within_the_sum_bound_of_the_bf16_reference(dp, threads, name):
    # int8's panels hold q exactly and scale the sums: weights within 2^-8 of the bf16 ones; int4
    # below 17 rows may take its dot paths (the scaled one's weights are fp32)
    outputs_within_bound(dp, name, MS, fp32_weights=lambda m: dp == "off" or name == "int8wo" or (name.startswith("int4") and m < 17))


@needs_native
@pytest.mark.parametrize("name", CONFIGS)
def test_a_one_hot_row_gives_exactly_the_weight(dp, name):
    k, n = 128, 40
    layer = quantized(name, n, k, bias=False)
    w = bf16_weight(layer)
    cols = torch.tensor([0, 1, 31, 32, 33, 63, 64, 127, 7, 50, 17, 88, 2, 3, 90, 45, 126, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18])
    x = torch.zeros(len(cols), k, dtype=torch.bfloat16)
    x[torch.arange(len(cols)), cols] = 1.0
    # int8: the code times its scale, rounded once to bf16 (the bf16 weight)
    assert torch.equal(F.linear(x, layer.weight), w[:, cols].t().contiguous())


@needs_native
def test_int8_rows_of_any_length(dp):
    """int8 weight-only K is any length: panels zero-padded to a multiple of 32."""
    for k in (1, 17, 33, 100):
        layer = quantized("int8wo", 23, k, seed=k)
        x = torch.randn(27, k, dtype=torch.bfloat16)
        check_bound(F.linear(x, layer.weight, layer.bias), x, bf16_weight(layer), layer.bias, (dp, k), fp32_weights=True)


@needs_native
@pytest.mark.parametrize("name", CONFIGS)
def test_the_instructions_give_the_emulations_bits(name):
    """The AVX512_BF16 kernels and their emulation: the same operations in the same order."""
    saved = native.status().isa
    native.set_isa("avx512")
    try:
        if not avx512_bf16_runs():
            pytest.skip("no AVX512_BF16 on this CPU (or TORCHQ_NATIVE_AVX512BF16=0)")
        for m, (k, n) in zip((25, 30, 40, 33), SHAPES):
            layer = quantized(name, n, k, seed=m)
            x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 2).to(torch.bfloat16)
            before = library.bf16_dp_gemm_calls()
            with library.bf16_dp_gemm("all"):
                hw = F.linear(x, layer.weight, layer.bias)
            with library.bf16_dp_gemm("emulated"):
                em = F.linear(x, layer.weight, layer.bias)
            assert library.bf16_dp_gemm_calls() == before + 2
            assert torch.equal(hw.view(torch.int16), em.view(torch.int16)), (name, m, k, n)
    finally:
        native.set_isa(saved)


@needs_native
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 2.0**70, 2.0**-70])
@pytest.mark.parametrize("name", ["int4-g32", "nf4", "int8wo"])
def test_activations_it_cannot_take_go_to_the_other_paths(value, name):
    """A non-finite, huge (>= 2^64) or tiny (< 2^-59, nonzero) activation: vdpbf16ps could
    overflow or flush where the reference does not, so the call runs the fused kernel's other
    paths (the same infinities and NaNs as the mode off, the finite outputs within the bf16
    roundings of its)."""
    layer = quantized(name, 40, 128)
    x = torch.randn(30, 128, dtype=torch.bfloat16)
    x[3, 5] = value
    with library.bf16_dp_gemm("off"):
        expected = F.linear(x, layer.weight, layer.bias)
    before = library.bf16_dp_gemm_calls()
    with library.bf16_dp_gemm("emulated"):
        y = F.linear(x, layer.weight, layer.bias)
        F.linear(x.nan_to_num(0.0).clamp(-4, 4).masked_fill(x.abs() < 1e-10, 0.0), layer.weight, layer.bias)
    assert library.bf16_dp_gemm_calls() - before == 1  # only the clean call
    assert torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.isinf(), expected.isinf())
    finite = expected.isfinite()
    assert torch.allclose(y[finite].float(), expected[finite].float(), rtol=2.0**-6, atol=expected[finite].abs().max().item() * 2.0**-7)


@needs_native
@pytest.mark.parametrize("mode", ["emulated", "hardware"])
@pytest.mark.parametrize("name", ["nf4", "fp4-b64"])
def test_panels_with_tiny_weights_sum_without_it(mode, name):
    """Weights near 2^-80 times activations near 2^-50: products near 2^-130, which vdpbf16ps would
    flush. Such panels take the portable loop over the same weights, so the outputs keep them."""
    if mode == "hardware" and not avx512_bf16_runs():
        pytest.skip("no AVX512_BF16 here (or the AVX-512 ISA is capped)")
    n, k = 40, 128
    layer = quantized(name, n, k, scale=2.0**-78, bias=False)
    w = bf16_weight(layer)
    assert w.abs().max() < 2.0**-66 and (w != 0).any()
    g = torch.Generator().manual_seed(5)
    signs = torch.randint(0, 2, (30, k), generator=g) * 2 - 1
    x = ((torch.rand(30, k, generator=g) + 0.5) * signs * 2.0**-48).to(torch.bfloat16)
    exact = x.double() @ w.double().t()
    before = library.bf16_dp_gemm_calls()
    with library.bf16_dp_gemm("all" if mode == "hardware" else "emulated"):
        y = F.linear(x, layer.weight)
    assert library.bf16_dp_gemm_calls() == before + 1
    check_bound(y, x, w, None, (mode, name), floor=2.0**-133)
    assert torch.equal(y == 0, exact.to(torch.bfloat16) == 0)


@needs_native
def test_int8_panel_order_gives_the_row_major_bits(dp):
    """An int8 weight in panel order (Int8VnniLayout): its 64-byte chunks already hold each row's
    code pairs in lane order, and the GEMM reads them as stored from 1 row; row-major codes are put
    in the same order per panel. So where both take it (from 10 rows) the outputs are the plain
    layout's bit for bit, and below, within the bound."""
    import torchq
    from torchq.layouts.int8_vnni import Int8VnniLayout

    for k, n in ((96, 40), (576, 130), (33, 17)):
        torch.manual_seed(k)
        lin = torch.nn.Linear(k, n, bias=True, dtype=torch.bfloat16)
        plain, panels = torch.nn.Sequential(lin), torch.nn.Sequential(torch.nn.Linear(k, n, dtype=torch.bfloat16))
        panels.load_state_dict(plain.state_dict())
        torchq.quantize_(plain, torchq.int8_weight_only())
        torchq.quantize_(panels, torchq.int8_weight_only(layout=Int8VnniLayout()))
        for m in (1, 3, 10, 16, 17, 37):
            x = torch.randn(m, k, dtype=torch.bfloat16)
            before = library.bf16_dp_gemm_calls()
            got = F.linear(x, panels[0].weight, panels[0].bias)
            assert library.bf16_dp_gemm_calls() == before + (dp != "off")
            check_bound(got, x, bf16_weight(plain[0]), plain[0].bias, (dp, k, n, m), fp32_weights=True)
            if m >= 10:  # (below, the row-major codes take the int8 dot path)
                before = library.bf16_dp_gemm_calls()
                assert torch.equal(got, F.linear(x, plain[0].weight, plain[0].bias)), (k, n, m)
                assert library.bf16_dp_gemm_calls() == before + (dp != "off")


@needs_native
def test_calls_it_does_not_serve():
    """fp32 / fp16 activations, fewer rows than its minimum (NF4 5, int4 with fp32 scales 9, row-major int8 10), and the mode off."""
    nf4, int4, int8 = quantized("nf4", 40, 128), quantized("int4-g64-fp32", 40, 128), quantized("int8wo", 40, 128)
    before = library.bf16_dp_gemm_calls()
    # (the scaled dot path emulated: int4 with fp32 scales keeps it below 9 rows wherever it runs)
    with library.bf16_dp_gemm("emulated"), library.lut4_scaled_dot("emulated"):
        F.linear(torch.randn(16, 128), nf4.weight)
        F.linear(torch.randn(16, 128, dtype=torch.float16), nf4.weight)
        F.linear(torch.randn(4, 128, dtype=torch.bfloat16), nf4.weight)
        F.linear(torch.randn(8, 128, dtype=torch.bfloat16), int4.weight)
        F.linear(torch.randn(9, 128, dtype=torch.bfloat16), int8.weight)
    with library.bf16_dp_gemm("off"):
        F.linear(torch.randn(300, 128, dtype=torch.bfloat16), nf4.weight)
    assert library.bf16_dp_gemm_calls() == before
    with library.bf16_dp_gemm("emulated"), library.lut4_scaled_dot("emulated"):
        F.linear(torch.randn(5, 128, dtype=torch.bfloat16), nf4.weight)
        F.linear(torch.randn(9, 128, dtype=torch.bfloat16), int4.weight)
        F.linear(torch.randn(10, 128, dtype=torch.bfloat16), int8.weight)
        F.linear(torch.randn(300, 128, dtype=torch.bfloat16), int8.weight)
    assert library.bf16_dp_gemm_calls() == before + 4


@needs_native
@pytest.mark.parametrize("name", ["nf4", "int8wo"])
def test_the_gemm_switch_turns_it_off(name):
    layer = quantized(name, 40, 128)
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    before = library.bf16_dp_gemm_calls()
    with library.bf16_dp_gemm("emulated"):
        with library.lut4_paths(gemm=False):
            off = F.linear(x, layer.weight)
        assert library.bf16_dp_gemm_calls() == before
        on = F.linear(x, layer.weight)
        assert library.bf16_dp_gemm_calls() == before + 1
    check_bound(off, x, bf16_weight(layer), None, name, fp32_weights=True)
    check_bound(on, x, bf16_weight(layer), None, name, fp32_weights=name == "int8wo")


@needs_native
@pytest.mark.parametrize("name", ["int4-g32", "int8wo"])
def test_the_compiled_op_takes_it_at_every_call(name):
    layer = quantized(name, 40, 128)
    x = torch.randn(40, 128, dtype=torch.bfloat16)
    with library.bf16_dp_gemm("emulated"):
        compiled = torch.compile(lambda t: F.linear(t, layer.weight, layer.bias), fullgraph=True)
        before = library.bf16_dp_gemm_calls()
        first = compiled(x)
        second = compiled(x)
        assert library.bf16_dp_gemm_calls() == before + 2
        eager = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(first, second) and torch.equal(first, eager)


def test_modes_are_checked():
    with pytest.raises(ValueError, match="mode: expected one of"):
        with library.bf16_dp_gemm("fast"):
            pass


@needs_native
@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(CONFIGS), m=st.integers(25, 80), n=st.integers(1, 90), k_blocks=st.integers(1, 6),
       seed=st.integers(0, 2**16), magnitude=st.sampled_from([2.0**-40, 1.0, 2.0**40]))
def test_random_shapes_emulated(name, m, n, k_blocks, seed, magnitude):
    k = 128 * k_blocks
    layer = quantized(name, n, k, seed=seed)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * magnitude).to(torch.bfloat16)
    before = library.bf16_dp_gemm_calls()
    with library.bf16_dp_gemm("emulated"):
        y = F.linear(x, layer.weight, layer.bias)
    a = x.float().abs()
    admissible = bool(((a == 0) | ((a >= 2.0**-59) & (a < 2.0**64))).all())
    assert library.bf16_dp_gemm_calls() == before + int(admissible)
    check_bound(y, x, bf16_weight(layer), layer.bias, (name, m, n, k), fp32_weights=True)


@needs_native
@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 70), k=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_int8_panel_order_random_shapes_emulated(m, n, k, seed):
    """Panel-order and row-major int8 codes of any shape (partial panels, K of any length: chunks
    past K zero) give the same bits through the emulated GEMM, within the bound."""
    import torchq
    from torchq.layouts.int8_vnni import Int8VnniLayout

    torch.manual_seed(seed)
    plain = torch.nn.Sequential(torch.nn.Linear(k, n, dtype=torch.bfloat16))
    panels = torch.nn.Sequential(torch.nn.Linear(k, n, dtype=torch.bfloat16))
    panels.load_state_dict(plain.state_dict())
    torchq.quantize_(plain, torchq.int8_weight_only())
    torchq.quantize_(panels, torchq.int8_weight_only(layout=Int8VnniLayout()))
    x = torch.randn(m, k, dtype=torch.bfloat16)
    with library.bf16_dp_gemm("emulated"):
        before = library.bf16_dp_gemm_calls()
        got = F.linear(x, panels[0].weight, panels[0].bias)
        want = F.linear(x, plain[0].weight, plain[0].bias)
        assert library.bf16_dp_gemm_calls() == before + 1 + (m >= 10)
    check_bound(got, x, bf16_weight(plain[0]), plain[0].bias, (m, n, k), fp32_weights=True)
    if m >= 10:
        assert torch.equal(got, want)


def _native_weights() -> dict:
    """Each weight-only format's NativeWeight (built by its layout's eager path)."""
    from torchq.layouts import blockwise_4bit, int4_native, plain

    builders = {"nf4": blockwise_4bit._cached_native_weight, "int4-g32": int4_native._cached_native_weight,
                "int4-g64-fp32": int4_native._cached_native_weight, "int8wo": plain._in_place_int8_weight}
    return {name: library.weight_args(quantized(name, 40, 128).weight.tensor_impl, build) for name, build in builders.items()}


@needs_native
def test_on_amx_cpus_its_default_mode_leaves_prompts_to_amx():
    """On CPUs with AMX-BF16, torch.mm's bf16 GEMM runs on AMX: mode "on" takes at most
    BF16_DP_AMX_CPU_MAX_M rows (more go to the AMX GEMM's 5-64, then dequantized tiles +
    torch.mm), "all" every count, as "on" does on CPUs without AMX (the weights' dot_max_m says so)."""
    if not avx512_bf16_runs():
        pytest.skip("no AVX512_BF16 on this CPU (or TORCHQ_NATIVE_AVX512BF16=0, or the AVX-512 ISA is capped)")
    layer, most = quantized("nf4", 40, 128), library.BF16_DP_AMX_CPU_MAX_M
    weights = _native_weights()
    capped = library.bf16_amx_supported()
    with library.bf16_dp_gemm("off"):  # the dot paths' own rows (the AMX GEMM is off here)
        dot_paths = {name: weight.dot_max_m(torch.bfloat16) for name, weight in weights.items()}
    for mode, takes_more in (("on", not capped), ("all", True)):
        with library.bf16_dp_gemm(mode):
            for m, takes in ((most, True), (most + 1, takes_more), (300, takes_more)):
                before = library.bf16_dp_gemm_calls()
                x = torch.randn(m, 128, dtype=torch.bfloat16)
                check_bound(F.linear(x, layer.weight, layer.bias), x, bf16_weight(layer), layer.bias, (mode, m))
                assert library.bf16_dp_gemm_calls() - before == takes, (mode, m)
            for name, weight in weights.items():
                assert weight.dot_max_m(torch.bfloat16) == (library.BF16_DP_MAX_M if takes_more else max(most, dot_paths[name])), (mode, name)
                assert library._bf16_native_max_m() >= weight.dot_max_m(torch.bfloat16), (mode, name)


@needs_native
@pytest.mark.parametrize("amx", ["off", "on", "emulated"])
@pytest.mark.parametrize("dp", ["off", "on", "all", "emulated"])
def test_the_python_bound_covers_every_weights_rows(dp, amx):
    """library._bf16_native_max_m (the quick check before a weight is built) is never below a weight's
    own dot_max_m (the kernel's), under every mode of both GEMMs, on every ISA leg."""
    weights = _native_weights()
    with library.bf16_dp_gemm(dp), library.bf16_amx(amx):
        for name, weight in weights.items():
            own = weight.dot_max_m(torch.bfloat16)
            assert library._bf16_native_max_m() >= own, (name, dp, amx)
            if "emulated" in (dp, amx):  # (a GEMM on every ISA)
                assert own >= (library.BF16_DP_MAX_M if dp == "emulated" else library.BF16_AMX_MAX_M), (name, dp, amx)


@needs_native
def test_the_environment_sets_its_mode_at_load():
    """TORCHQ_NATIVE_BF16_DP=0: off, =all: every row count on any CPU, else (unset, anything else) on."""
    code = "from torchq.backends.native_cpu import library; print(library.BF16_DP_MODES[library.library().tq_set_bf16_dp_gemm(-1)])"

    def mode(value: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "TORCHQ_NATIVE_BF16_DP"}
        if value is not None:
            env["TORCHQ_NATIVE_BF16_DP"] = value
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()

    assert [mode(v) for v in (None, "0", "all", "1")] == ["on", "off", "all", "on"]
