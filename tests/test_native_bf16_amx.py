"""The bf16 AMX GEMM of the native weight-only kernels (``csrc/bf16_amx.h``).

For 5 to 64 bf16 activation rows on CPUs with AMX-BF16, the lut4 (int4 of every zero-point domain,
NF4, FP4, double-quantized NF4) and int8 weight-only kernels decode each panel of weight rows
into exactly the bf16 values their dequantized tiles hold, and ``tdpbf16ps`` multiplies them with
the activations: every product exact, fp32 sums in an order of their own. So the outputs must be
within the fp32 sum bound of the reference (the bf16 weights times the bf16 activations), exactly
the weight for a one-hot row, and the calls it cannot take (activations that are not finite, huge
or tiny; fp32 activations; fewer rows) must go elsewhere. Its body runs here on emulated tiles
(every machine, CI's AVX2-only ones included) and on the AMX instructions where this CPU has them
(skipped elsewhere); with it off the same cases run the tiles + ``torch.mm`` / dot paths. A call
counter shows which ran. Shapes cover partial 16-row weight panels and passes of 1, 2 and 4 panels
(1, 2-3 and 4+ activation blocks), partial activation blocks, K not a multiple of 32 (int8), one
and two threads.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_native_blockwise import NATIVE, needs_native

import torchq
from torchq import native
from torchq.backends.native_cpu import library
from torchq.configs import config_from_name

HARDWARE = NATIVE and library.bf16_amx_supported()
CONFIGS = ["int4-g32", "int4-g64-fp32", "int4-g128", "nf4", "fp4-b64", "nf4-b64", "int8wo"]
MS = [5, 16, 17, 33, 48, 64]
SHAPES = [(128, 1), (256, 17), (640, 40), (384, 130)]  # (K, N); K a multiple of every block size above


def quantized(name: str, n: int, k: int, seed: int = 0, scale: float = 1.0, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    lin.weight.data.mul_(scale)
    if name.startswith("int4") and "zint" in name:  # the integer zero-point domain
        from torchq.primitives import ZeroPointDomain

        cfg = torchq.int4_weight_only(group_size=int(name.split("-g")[1].split("-")[0]), zero_point_domain=ZeroPointDomain.INT)
    elif name == "int4-none-g32":
        from torchq.primitives import ZeroPointDomain

        cfg = torchq.int4_weight_only(group_size=32, zero_point_domain=ZeroPointDomain.NONE)
    else:
        cfg = config_from_name(name)
    model = torch.nn.Sequential(lin)
    torchq.quantize_(model, cfg)
    assert isinstance(model[0].weight, torchq.AffineQuantizedTensor), (name, n, k)
    return model[0]


def bf16_weight(layer: torch.nn.Linear) -> torch.Tensor:
    """The reference's weight in a bf16 model: the dequantized tiles' bf16 values."""
    return layer.weight.dequantize().to(torch.bfloat16)


def check_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, where,
                fp32_weights: bool = False, floor: float = 1e-30) -> None:
    """|y - (sum_k w_k x_k + b)| within the fp32 sum bound plus the output's bf16 roundings (the
    product's, and the sum's with the bias: F.linear in bf16 rounds both). ``fp32_weights``: the
    call may have run a path whose weights are the fp32 values before their bf16 rounding (the
    fused table paths, fp32 tiles where the tile switch is off): each within 2^-8 of w. ``floor``:
    an absolute allowance (below every output that matters; 2^-133, bf16's subnormal spacing, for
    outputs near 2^-126)."""
    xd, wd = x.double(), w.double()
    product = xd @ wd.t()
    b = torch.zeros(()) if bias is None else bias.detach().double()
    exact = product + b
    mags = xd.abs() @ wd.abs().t()
    k = x.shape[-1]
    allowed = (product.abs() + b.abs() + exact.abs()) * 2.0**-8 + mags * ((k + 2) * 2.0**-23 + (2.0**-8 if fp32_weights else 0)) + floor
    err = (y.detach().double() - exact).abs()
    assert bool((err <= allowed).all()), (where, float((err - allowed).max()))


@pytest.fixture(autouse=True)
def _gemm_switch_on():
    """Every test here with the GEMM switch on (TORCHQ_NATIVE_GEMM=0 turns the GEMM off in every mode)."""
    with library.lut4_paths():
        yield


def mode_under_test(param: str, switch, calls, hardware: bool, skip_reason: str, hardware_mode: str = "on"):
    """A native GEMM's mode for one test (``param``: emulated, hardware or off; ``switch`` the
    library's mode context, ``calls`` its call counter; ``hardware_mode`` the switch's mode that runs
    the instructions); afterwards the counter must show the GEMM ran exactly when it was on (each
    test runs at least one call it takes)."""
    saved = native.status().isa
    if param == "hardware":
        native.set_isa("avx512")
        if not hardware or native.status().isa != "avx512":
            native.set_isa(saved)
            pytest.skip(skip_reason)
    before = calls()
    with switch({"emulated": "emulated", "hardware": hardware_mode, "off": "off"}[param]):
        yield param
    native.set_isa(saved)
    ran = calls() - before
    assert (ran > 0) == (param != "off"), (param, ran)


def outputs_within_bound(mode: str, name: str, ms: list[int], fp32_weights: bool | Callable[[int], bool]) -> None:
    """Every shape of SHAPES at every row count of ``ms``: bf16 outputs of the right shape within
    the sum bound of the bf16 reference (``fp32_weights``: :func:`check_bound`'s, or per row count)."""
    for i, (k, n) in enumerate(SHAPES):
        layer = quantized(name, n, k, seed=i)
        w = bf16_weight(layer)
        for m in ms:
            x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m + i)) * 3).to(torch.bfloat16)
            y = F.linear(x, layer.weight, layer.bias)
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            loose = fp32_weights(m) if callable(fp32_weights) else fp32_weights
            check_bound(y, x, w, layer.bias, (mode, name, m, k, n), fp32_weights=loose)


@pytest.fixture(params=["emulated", "hardware", "off"])
def amx(request):
    """The bf16 AMX mode for one test (:func:`mode_under_test`)."""
    yield from mode_under_test(request.param, library.bf16_amx, library.bf16_amx_calls, HARDWARE,
                               "no AMX-BF16 on this CPU (or Linux refused it, or the AVX-512 ISA is capped)")


@needs_native
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("name", CONFIGS + ["int4-zint-g32", "int4-none-g32"])
def test_outputs_are_within_the_sum_bound_of_the_bf16_reference(amx, threads, name):
    outputs_within_bound(amx, name, MS, fp32_weights=amx == "off")


@needs_native
@pytest.mark.parametrize("name", CONFIGS)
def test_a_one_hot_row_gives_exactly_the_weight(amx, name):
    k, n = 128, 40
    layer = quantized(name, n, k, bias=False)
    w = bf16_weight(layer)
    cols = torch.tensor([0, 1, 31, 32, 33, 63, 64, 127, 7, 50, 17, 88, 2, 3, 90, 45, 126])
    x = torch.zeros(len(cols), k, dtype=torch.bfloat16)
    x[torch.arange(len(cols)), cols] = 1.0
    assert torch.equal(F.linear(x, layer.weight), w[:, cols].t().contiguous())


@needs_native
def test_int8_rows_of_any_length(amx):
    """int8 weight-only K is any length: panels decode zero-padded to a multiple of 32."""
    for k in (1, 17, 33, 100):
        layer = quantized("int8wo", 23, k, seed=k)
        x = torch.randn(21, k, dtype=torch.bfloat16)
        check_bound(F.linear(x, layer.weight, layer.bias), x, bf16_weight(layer), layer.bias, (amx, k), fp32_weights=amx == "off")


@needs_native
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 2.0**70, 2.0**-70])
@pytest.mark.parametrize("name", ["int4-g32", "nf4", "int8wo"])
def test_activations_it_cannot_take_go_to_the_other_paths(value, name):
    """A non-finite, huge (>= 2^64) or tiny (< 2^-59, nonzero) activation: AMX could overflow or
    flush where the reference does not, so the call runs the fused kernel's table path (the
    decode-sized paths' numerics: the same infinities and NaNs as the mode off, the finite outputs
    within the bf16 roundings of its)."""
    layer = quantized(name, 40, 128)
    x = torch.randn(9, 128, dtype=torch.bfloat16)
    x[3, 5] = value
    with library.bf16_amx("off"):
        expected = F.linear(x, layer.weight, layer.bias)
    before = library.bf16_amx_calls()
    with library.bf16_amx("emulated"):
        y = F.linear(x, layer.weight, layer.bias)
        ok = F.linear(x.nan_to_num(0.0).clamp(-4, 4).masked_fill(x.abs() < 1e-10, 0.0), layer.weight, layer.bias)
    assert library.bf16_amx_calls() - before == 1  # only the clean call
    assert torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.isinf(), expected.isinf())
    finite = expected.isfinite()
    assert torch.allclose(y[finite].float(), expected[finite].float(), rtol=2.0**-6, atol=expected[finite].abs().max().item() * 2.0**-7)
    assert ok.isfinite().all()


@needs_native
@pytest.mark.parametrize("mode", ["emulated", "hardware"])
@pytest.mark.parametrize("name", ["nf4", "fp4-b64"])
def test_panels_with_tiny_weights_sum_without_tiles(mode, name):
    """Weights near 2^-80 times activations near 2^-50 (admissible): products near 2^-130, which
    AMX would flush to zero (the emulated tiles do as AMX does). Such panels take the portable loop
    over the same weights, so the outputs keep them; without the guard the emulated tiles' flushing
    would zero them and this test would fail. (int4 and int8 quantizers clamp their scales
    at 1e-6 and fp32's eps, so only blockwise absmax gets there; the tiles path's oneDNN GEMM may
    flush them on AMX machines itself, so the mode off is not compared.)"""
    if mode == "hardware" and not (HARDWARE and native.status().isa == "avx512"):
        pytest.skip("no AMX-BF16 here (or the AVX-512 ISA is capped)")
    n, k = 40, 128
    layer = quantized(name, n, k, scale=2.0**-78, bias=False)
    w = bf16_weight(layer)
    assert w.abs().max() < 2.0**-66 and (w != 0).any()
    g = torch.Generator().manual_seed(5)
    signs = torch.randint(0, 2, (17, k), generator=g) * 2 - 1
    x = ((torch.rand(17, k, generator=g) + 0.5) * signs * 2.0**-48).to(torch.bfloat16)  # |x| in [2^-49, 1.5 * 2^-48]
    assert bool(((x.float().abs() >= 2.0**-59) | (x == 0)).all())
    exact = x.double() @ w.double().t()
    assert exact.abs().max() > 2.0**-126 and (x.double().abs() @ w.double().abs().t()).min() > 0
    before = library.bf16_amx_calls()
    with library.bf16_amx("on" if mode == "hardware" else "emulated"):
        y = F.linear(x, layer.weight)
    assert library.bf16_amx_calls() == before + 1
    check_bound(y, x, w, None, (mode, name), floor=2.0**-133)
    assert torch.equal(y == 0, exact.to(torch.bfloat16) == 0)


@needs_native
def test_calls_it_does_not_serve():
    """fp32 / fp16 activations (AMX would round them to bf16), fewer than 5 rows, more than
    BF16_AMX_MAX_M (dequantized tiles + torch.mm), and the mode off."""
    layer = quantized("nf4", 40, 128)
    with library.bf16_amx("emulated"):
        before = library.bf16_amx_calls()
        F.linear(torch.randn(library.BF16_AMX_MAX_M, 128, dtype=torch.bfloat16), layer.weight)
        assert library.bf16_amx_calls() == before + 1
    before = library.bf16_amx_calls()
    with library.bf16_amx("emulated"):
        F.linear(torch.randn(16, 128), layer.weight)
        F.linear(torch.randn(16, 128, dtype=torch.float16), layer.weight)
        F.linear(torch.randn(4, 128, dtype=torch.bfloat16), layer.weight)
        F.linear(torch.randn(library.BF16_AMX_MAX_M + 1, 128, dtype=torch.bfloat16), layer.weight)
    with library.bf16_amx("off"):
        F.linear(torch.randn(16, 128, dtype=torch.bfloat16), layer.weight)
    assert library.bf16_amx_calls() == before


@needs_native
@pytest.mark.parametrize("name", ["nf4", "int8wo"])
def test_the_gemm_switch_turns_it_off(name):
    """A GEMM form: lut4_paths(gemm=False) / TORCHQ_NATIVE_GEMM=0 turn it off in every mode (the
    golden digests are recorded with it off)."""
    layer = quantized(name, 40, 128)
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    before = library.bf16_amx_calls()
    with library.bf16_amx("emulated"):
        with library.lut4_paths(gemm=False):
            off = F.linear(x, layer.weight)
        assert library.bf16_amx_calls() == before
        on = F.linear(x, layer.weight)
        assert library.bf16_amx_calls() == before + 1
    check_bound(off, x, bf16_weight(layer), None, name, fp32_weights=True)
    check_bound(on, x, bf16_weight(layer), None, name)


@needs_native
@pytest.mark.parametrize("fast_bf16", [True], indirect=True)
@pytest.mark.parametrize("name", ["int4-g32", "nf4", "int8wo"])
def test_the_compiled_op_takes_it_at_every_call(fast_bf16, name):
    """Through the dispatcher (torch.compile's path) the op's kernel asks the same question as the
    eager layer: with bf16 tiles available (as on AMX CPUs), the first compiled call must not take
    them and the later ones the GEMM (that gave two answers for one graph)."""
    layer = quantized(name, 40, 128)
    x = torch.randn(24, 128, dtype=torch.bfloat16)
    with library.bf16_amx("emulated"):
        compiled = torch.compile(lambda t: F.linear(t, layer.weight, layer.bias), fullgraph=True)
        before = library.bf16_amx_calls()
        first = compiled(x)
        assert library.bf16_amx_calls() == before + 1
        second = compiled(x)
        assert library.bf16_amx_calls() == before + 2
        eager = F.linear(x, layer.weight, layer.bias)
    assert torch.equal(first, second) and torch.equal(first, eager)
    check_bound(first, x, bf16_weight(layer), layer.bias, ("compiled", name))


def test_modes_are_checked():
    with pytest.raises(ValueError, match="mode: expected one of"):
        with library.bf16_amx("fast"):
            pass


@needs_native
@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(CONFIGS), m=st.integers(5, library.BF16_AMX_MAX_M), n=st.integers(1, 90), k_blocks=st.integers(1, 6),
       seed=st.integers(0, 2**16), magnitude=st.sampled_from([2.0**-40, 1.0, 2.0**40]))
def test_random_shapes_on_emulated_tiles(name, m, n, k_blocks, seed, magnitude):
    k = 128 * k_blocks
    layer = quantized(name, n, k, seed=seed)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * magnitude).to(torch.bfloat16)
    before = library.bf16_amx_calls()
    with library.bf16_amx("emulated"):
        y = F.linear(x, layer.weight, layer.bias)
    a = x.float().abs()
    admissible = bool(((a == 0) | ((a >= 2.0**-59) & (a < 2.0**64))).all())  # else the table path
    assert library.bf16_amx_calls() == before + int(admissible)
    check_bound(y, x, bf16_weight(layer), layer.bias, (name, m, n, k), fp32_weights=not admissible)


@needs_native
def test_status_lists_it_while_it_runs_on_amx():
    if not HARDWARE or native.status().isa != "avx512":
        pytest.skip("no AMX-BF16 here (or the AVX-512 ISA is capped)")
    with library.bf16_amx("on"):
        assert "amx_bf16" in native.status().features
    for mode in ("off", "emulated"):
        with library.bf16_amx(mode):
            assert "amx_bf16" not in native.status().features
