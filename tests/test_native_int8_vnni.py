"""int8 weights in VNNI panel order (``Int8VnniLayout``, ``csrc/int8_linear.h`` "Panel order")
give the row-major codes' bits through every int8 path: weight-only (row tiles, GEMM, bf16 AMX,
dequantized tiles), dynamic (the VNNI panel kernel to 4 rows, AMX B tiles on, emulated and off, the
row kernels and GEMM forms on unpacked chunks, narrow ranges), static (with and without a zero
point), dequantized rows; on every ISA this machine runs up to the cap; and through the layout
(quantize_, compile, save / load). The bf16 dot-product GEMM is off here: it takes panel-order
codes from 1 bf16 row and row-major ones from 10, and test_native_bf16_dp.py compares the two
(the same bits where both take it, the sum bound below)."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchq
from torchq import native
from torchq.backends.native_cpu import library as native_library
from torchq.layouts import choose_layout
from torchq.layouts.int8_vnni import Int8VnniLayout
from torchq.ops.int8 import int8_dynamic_reference, int8_static_reference, int8_weight_reference
from torchq.ops.int8_panels import int8_panel_dynamic_linear, pack_panels, panel_numel, unpack_panels

NATIVE = native_library.loaded() is not None
pytestmark = pytest.mark.skipif(not NATIVE, reason="native library not built")
ISAS = [] if not NATIVE else [i for i in native_library.ISA_NAMES
                              if native_library.ISA_NAMES.index(i) <= native_library.ISA_NAMES.index(native.status().isa)]
SHAPES = [(1, 1), (16, 64), (17, 65), (40, 130), (33, 576), (64, 200), (130, 1030)]
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 40]


@pytest.fixture(autouse=True)
def _no_bf16_dp_gemm():
    with native_library.bf16_dp_gemm("off"):
        yield


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _weights(n: int, k: int, seed: int, edge_rows: bool = False):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    if edge_rows and n > 2:
        codes[1] = 0  # a zero row
        codes[2] = -128  # a constant extreme row
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-4
    panels, sums = pack_panels(codes)
    row = native_library.int8_weight("test", codes.reshape(-1).contiguous(), scales, n, k)
    panel = native_library.int8_panel_weight("test", panels, sums, scales, n, k)
    return row, panel, (codes, panels, sums, scales)


def _forms(row, panel):
    yield row, panel
    for qmin, qmax in ((-127, 127), (-64, 63)):  # the full range and a narrow one (its own kernels)
        yield row.dynamic(qmin, qmax, 1e-5), panel.dynamic(qmin, qmax, 1e-5)
    for z in (0, 5, -20):
        yield row.static(0.02, z, -127, 127), panel.static(0.02, z, -127, 127)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("amx", ["off", "emulated", "on"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_panels_give_the_row_major_bits(isa: str, amx: str, n: int, k: int) -> None:
    row, panel, _held = _weights(n, k, n * 1000 + k)
    gen = torch.Generator().manual_seed(k)
    calls, bf16_calls = native_library.int8_amx_calls(), native_library.bf16_amx_calls()
    with native_library.int8_amx(amx), native_library.bf16_amx(amx):  # the weight-only bf16 GEMM too
        for m in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
                inputs = [x]
                if m >= 5:  # also with edge rows: zeros, a huge value, an inf, a NaN (the bf16 GEMM declines those)
                    inputs.append(x.clone())
                    inputs[1][1] = 0
                    inputs[1][2, 0] = 3e38
                    inputs[1][3, k // 2] = float("inf")
                    inputs[1][4, k - 1] = float("nan")
                bias = torch.randn(n, generator=gen)
                for x in inputs:
                    for a, b in _forms(row, panel):
                        use_bias = bias if a.format == row.format else None
                        want = native_library.run_linear(a, x, use_bias)
                        got = native_library.run_linear(b, x, use_bias)
                        assert torch.equal(_bits(want), _bits(got)), (m, dtype, b.format, b.struct.act_zero_point)
    if amx == "emulated" and isa == "avx512":
        assert native_library.int8_amx_calls() > calls  # the panel form ran on the emulated tiles
        assert native_library.bf16_amx_calls() > bf16_calls  # and the weight-only GEMM decoded the panels
    for dtype in (torch.float32, torch.bfloat16):
        for n0, n1 in ((0, n), (n // 3, n - n // 5)):
            want, got = torch.empty(n1 - n0, k, dtype=dtype), torch.full((n1 - n0, k), 7.0, dtype=dtype)
            native_library.dequantize_rows(row, n0, n1, want)
            native_library.dequantize_rows(panel, n0, n1, got)
            assert torch.equal(want, got), (n0, n1, dtype)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_many_rows_give_the_row_major_bits(isa: str, threads: int) -> None:
    """Prompt-sized calls (65-257 rows): on VNNI without AMX the panel kernel takes every row count
    and writes bf16 outputs itself; the same bits as the row-major GEMM, NaN rows included."""
    row, panel, _held = _weights(200, 333, 7)
    gen = torch.Generator().manual_seed(1)
    with native_library.int8_amx("off"):
        for m in (65, 130, 257):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, 333, generator=gen) * 3).to(dtype)
                x[3, 5] = float("nan")
                x[4] = 0
                for a, b in list(_forms(row, panel))[1:]:  # the activation forms
                    assert torch.equal(_bits(native_library.run_linear(a, x, None)), _bits(native_library.run_linear(b, x, None))), (m, dtype)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_the_emulated_panel_kernel_gives_the_row_major_bits(isa: str, threads: int) -> None:
    """The VNNI panel kernel's body on emulated instructions (any CPU: CI's AVX2 and portable runs)
    takes the activation forms' calls of panel-order weights, every row count (tails of 1-3 rows,
    of 1-3 panels, of a panel's rows), fp32 and bf16 with edge rows, and gives the row-major
    kernels' bits."""
    gen = torch.Generator().manual_seed(3)
    for n, k in ((1, 1), (17, 65), (64, 200), (200, 333)):
        row, panel, _held = _weights(n, k, n + k)
        for m in (1, 2, 3, 4, 5, 7, 9, 65):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
                if m >= 5:
                    x[1] = 0
                    x[2, 0] = 3e38
                    x[3, k // 2] = float("inf")
                    x[4, k - 1] = float("nan")
                for a, b in list(_forms(row, panel))[1:]:  # the activation forms
                    want = native_library.run_linear(a, x, None)
                    calls = native_library.int8_panel_calls()
                    with native_library.int8_amx("off"), native_library.int8_panel("emulated"):
                        got = native_library.run_linear(b, x, None)
                    assert native_library.int8_panel_calls() == calls + 1
                    assert torch.equal(_bits(want), _bits(got)), (n, k, m, dtype, b.struct.act_zero_point)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 80), k=st.integers(1, 300), m=st.integers(1, 40), bf16=st.booleans(), z=st.integers(-30, 30),
       seed=st.integers(0, 2**16))
def test_the_panel_kernel_matches_the_row_major_kernels_on_random_shapes(n, k, m, bf16, z, seed) -> None:
    """Hypothesis: odd sizes, zero rows and extreme constant weight rows, static zero points; the
    panel kernel on this CPU ("on": VNNI, else unpacked chunks) and emulated, the same bits as the
    row-major codes."""
    row, panel, _held = _weights(n, k, seed, edge_rows=True)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 4).to(torch.bfloat16 if bf16 else torch.float32)
    if m > 1:
        x[1] = 0
    forms = [(row.dynamic(-127, 127, 1e-5), panel.dynamic(-127, 127, 1e-5)), (row.static(0.02, z, -127, 127), panel.static(0.02, z, -127, 127))]
    for a, b in forms:
        want = native_library.run_linear(a, x, None)
        for mode in ("on", "emulated"):
            with native_library.int8_amx("off"), native_library.int8_panel(mode):
                assert torch.equal(_bits(want), _bits(native_library.run_linear(b, x, None))), (mode, b.format)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 80), k=st.integers(1, 300), m=st.integers(1, 70), bf16=st.booleans(), z=st.integers(-30, 30),
       scale_exp=st.integers(-12, 4), seed=st.integers(0, 2**16))
def test_random_shapes_and_values_match_the_reference(n, k, m, bf16, z, scale_exp, seed) -> None:
    """The panel ops against the row-major ops' references (hypothesis: odd sizes, tiny and huge
    activations, constant and zero rows, static zero points)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    if n > 2:
        codes[1] = 0  # a zero row
        codes[2] = -128  # a constant extreme row
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-6
    panels, sums = pack_panels(codes)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = (torch.randn(m, k, generator=gen) * 2.0 ** scale_exp).to(dtype)
    if m > 1:
        x[1] = 0  # a zero activation row: its scale clamps to eps
    y = torch.ops.torchq.int8_panel_dynamic_linear(x, panels, sums, scales, -127, 127, 1e-5)
    assert torch.equal(_bits(y), _bits(int8_dynamic_reference(x, codes, scales, -127, 127, 1e-5, None)))
    y = torch.ops.torchq.int8_panel_static_linear(x, panels, sums, scales, 0.03, z, -127, 127)
    assert torch.equal(_bits(y), _bits(int8_static_reference(x, codes, scales, 0.03, z, -127, 127, None)))
    y = torch.ops.torchq.int8_panel_weight_linear(x.float(), panels, sums, scales)
    ref = int8_weight_reference(x.float(), codes, scales, None)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()) + 1e-30)


def test_pack_places_each_code_and_unpacks_losslessly() -> None:
    codes = torch.arange(17 * 65, dtype=torch.int32).remainder(251).sub(125).to(torch.int8).view(17, 65)
    panels, sums = pack_panels(codes)
    assert panels.numel() == panel_numel(17, 65) == 32 * 128
    for n in (0, 5, 15, 16):
        for k in (0, 1, 3, 4, 63, 64):
            assert panels[(n // 16) * 16 * 128 + (k // 4) * 64 + (n % 16) * 4 + k % 4] == codes[n, k]
    assert int(panels.to(torch.int32).abs().sum()) == int(codes.to(torch.int32).abs().sum())  # the padding is zeros
    assert torch.equal(sums, codes.to(torch.int32).sum(1).to(torch.int32))
    assert torch.equal(unpack_panels(panels, 17, 65), codes)


def test_bad_arguments_name_what_is_wrong() -> None:
    codes = torch.randint(-128, 128, (20, 40), dtype=torch.int8)
    panels, sums = pack_panels(codes)
    scales = torch.rand(20)
    x = torch.randn(2, 40)
    with pytest.raises(ValueError, match="panels: expected int8 \\[2048\\]"):
        int8_panel_dynamic_linear(x, panels[:-1], sums, scales, -127, 127, 1e-5)
    with pytest.raises(ValueError, match="code_sums: expected int32 \\[20\\]"):
        int8_panel_dynamic_linear(x, panels, sums[:-1], scales, -127, 127, 1e-5)
    with pytest.raises(ValueError, match="quant_min, quant_max"):
        int8_panel_dynamic_linear(x, panels, sums, scales, -100, 127, 1e-5)
    with pytest.raises(ValueError, match="panels: expected a contiguous CPU torch.int8 tensor of 2048"):
        native_library.int8_panel_weight("t", panels[:-1], sums, scales, 20, 40)
    with pytest.raises(ValueError, match="panels: expected 2048 int8 bytes"):
        unpack_panels(panels[:100], 20, 40)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(70, 96), torch.nn.GELU(), torch.nn.Linear(96, 33, bias=False))


CONFIGS = {
    "int8wo": lambda layout: torchq.int8_weight_only(layout=layout),
    "int8dq": lambda layout: torchq.int8_dynamic_activation_int8_weight(layout=layout),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_the_layout_gives_the_plain_layouts_outputs(config: str) -> None:
    from torchq.layouts.plain import PlainLayout

    plain, vnni = _model(), _model()
    torchq.quantize_(plain, CONFIGS[config](PlainLayout()))
    torchq.quantize_(vnni, CONFIGS[config](Int8VnniLayout()))
    assert isinstance(vnni[0].weight.tensor_impl.layout, Int8VnniLayout)
    for m in (1, 3, 4, 5, 16, 64, 300):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, 70).to(dtype)
            with torch.no_grad():
                want, got = plain.to(dtype)(x), vnni.to(dtype)(x)
            assert torch.equal(_bits(want), _bits(got)), (config, m, dtype)
    x = torch.randn(5, 70)
    with torch.no_grad():  # both compiled: Inductor's GELU is not eager's to the bit
        want = torch.compile(plain.float(), fullgraph=True)(x)
        assert torch.equal(torch.compile(vnni.float(), fullgraph=True)(x), want)
    buf = io.BytesIO()
    torch.save(vnni.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    again = _model(1)
    torchq.quantize_(again, CONFIGS[config](Int8VnniLayout()))
    again.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(again(x), plain(x))


def test_the_layout_round_trips_the_plain_form_and_slices_whole_panels() -> None:
    model = _model()
    torchq.quantize_(model, torchq.int8_dynamic_activation_int8_weight(layout=Int8VnniLayout()))
    impl = model[0].weight.tensor_impl
    plain = impl.to_plain()
    again = Int8VnniLayout().pack(plain)
    assert torch.equal(again.panels, impl.panels) and torch.equal(again.code_sums, impl.code_sums)
    part = impl.narrow_view(0, 16, 32)
    assert part is not None and part.panels.untyped_storage().data_ptr() == impl.panels.untyped_storage().data_ptr()
    assert torch.equal(part.to_plain().codes, plain.codes[16:48])
    assert impl.narrow_view(0, 3, 16) is None  # not on a panel boundary: through the plain form
    tail = impl.narrow_view(0, 80, 16)
    assert tail is not None and torch.equal(tail.to_plain().codes, plain.codes[80:96])


def test_automatic_placement_is_allowed_only_where_the_vnni_kernels_run() -> None:
    from torchq.canonical import QuantSpec
    from torchq.primitives import ZeroPointDomain

    spec = QuantSpec((1, 64), -128, 127, ZeroPointDomain.NONE)
    vnni = "avx512_vnni" in native.status().features
    fit = Int8VnniLayout().fit(spec, (32, 64), torch.float32, "cpu")
    assert fit.holds and fit.automatic == vnni, (fit, native.status())
    assert choose_layout(spec, (32, 64), torch.float32, "cpu").name == "plain"  # not in the general order (LLM.int8)
    assert not Int8VnniLayout().fit(QuantSpec((1, 32), -128, 127, ZeroPointDomain.NONE), (32, 64)).holds  # groupwise
    assert not Int8VnniLayout().fit(QuantSpec((1, 64), 0, 255, ZeroPointDomain.INT), (32, 64)).holds


def test_an_unpacking_cpu_warns_once_per_layer() -> None:
    from torchq.layouts import int8_vnni

    model = _model()
    torchq.quantize_(model, torchq.int8_dynamic_activation_int8_weight(layout=Int8VnniLayout()))
    saved = native.status().isa
    int8_vnni._WARNED_UNPACKED.clear()
    try:
        native.set_isa("avx2")
        with pytest.warns(int8_vnni.PanelUnpackWarning, match="unpacks the rows"):
            with torch.no_grad():
                model(torch.randn(2, 70))
    finally:
        native.set_isa(saved)


def test_the_reference_serves_what_the_kernel_does_not_take() -> None:
    """Activation codes down to -128 (the AVX2 sign trick needs -127) and a disabled library run
    the ops' references: the same values as the row-major references."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(-128, 128, (20, 40), generator=gen, dtype=torch.int8)
    panels, sums = pack_panels(codes)
    scales = torch.rand(20, generator=gen)
    x = torch.randn(3, 40, generator=gen)
    with pytest.warns(UserWarning, match="int8_panel_dynamic_linear"):
        y = torch.ops.torchq.int8_panel_dynamic_linear(x, panels, sums, scales, -128, 127, 1e-5)
    assert torch.equal(y, int8_dynamic_reference(x, codes, scales, -128, 127, 1e-5, None))
    with native.disabled():
        y = torch.ops.torchq.int8_panel_static_linear(x, panels, sums, scales, 0.02, 3, -127, 127)
    assert torch.equal(y, int8_static_reference(x, codes, scales, 0.02, 3, -127, 127, None))


def test_rows_are_gathered_from_the_panels_alone() -> None:
    """An embedding lookup on a tied int8_vnni weight reads only the rows asked for (plain_rows), with
    the plain form's codes and scales."""
    lin = torch.nn.Linear(70, 50)
    torchq.quantize_(lin, torchq.int8_weight_only(layout=Int8VnniLayout()))
    impl = lin.weight.tensor_impl
    index = torch.tensor([0, 49, 17, 16, 15, 3, 3])
    got, want = impl.plain_rows(index), impl.to_plain().rows(index)
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)
    tokens = torch.tensor([[1, 2], [40, 33]])
    assert torch.equal(torch.nn.functional.embedding(tokens, lin.weight),
                       torch.nn.functional.embedding(tokens, lin.weight.dequantize()))
