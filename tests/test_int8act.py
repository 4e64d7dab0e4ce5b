"""The int8-activation 4-bit mode: torchq::int4_groupwise_linear_a8 / blockwise_4bit_linear_a8,
their native CPU kernel (integer dot products, every ISA) against the references, the config,
dispatch, torch.compile and checkpoints."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchq
from torchq import ZeroPointDomain as Z
from torchq import native
from torchq.activation import PerBlockInt8
from torchq.backends.native_cpu import library as native_library
from torchq.backends.native_cpu import lut4
from torchq.blockwise.codebooks import codebook
from torchq.layouts import Int4NativeLayout
from torchq.ops.int8act import ACTIVATIONS, blockwise_4bit_a8_reference, int4_a8_reference

NATIVE = native.status().available
needs_native = pytest.mark.skipif(not NATIVE, reason=f"native library not built: {native.status().reason}")
ISAS = [] if not NATIVE else [i for i in native_library.ISA_NAMES
                              if native_library.ISA_NAMES.index(i) <= native_library.ISA_NAMES.index(native.status().isa)]
U = 2.0**-24
OUT_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # a full ulp: sums on both sides of a rounding boundary
SETTINGS = dict(deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def int4_impl(w, g, domain=Z.FLOAT):
    cfg = torchq.Int4WeightOnlyConfig(group_size=g, layout=Int4NativeLayout(), scale_dtype=torch.float32, zero_point_domain=domain)
    return cfg.quantize_weight(w).tensor_impl


def int4_args(impl, x, bias=None):
    n, k = impl.shape
    return (x, impl.packed, impl.scale, impl.shift, impl.zero, n, k, impl.group_size, impl.code_base, bias)


def assert_within(got, ref, w32, x, bias, extra=0.0):
    """|got - ref| <= the fp32 bound over sum |w| |a q| (+ extra), plus one rounding of the output."""
    xq = ACTIVATIONS.fake_quantize(x.float()).reshape(-1, x.shape[-1])
    mag = xq.abs() @ w32.abs().T + (0 if bias is None else bias.float().abs())
    tol = (x.shape[-1] + 8) * U * mag + extra + OUT_ULP[x.dtype] * ref.float().abs().reshape(mag.shape) + 1e-30
    err = (got.float() - ref.float()).abs().reshape(mag.shape)
    finite = torch.isfinite(ref.float()).reshape(mag.shape)
    assert torch.equal(torch.isfinite(got.float()).reshape(mag.shape), finite)
    assert (err[finite] <= tol[finite]).all(), float((err - tol)[finite].max())


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@settings(**SETTINGS)
@given(g=st.sampled_from([32, 64, 128, 256]), domain=st.sampled_from([Z.FLOAT, Z.INT, Z.NONE]), n=st.integers(1, 40),
       k=st.integers(1, 300), m=st.sampled_from([1, 2, 3, 5, 8, 9, 17]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       bias=st.booleans(), scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]), seed=st.integers(0, 2**31 - 1))
def test_int4_native_is_the_reference_within_fp32_order(isa, g, domain, n, k, m, dtype, bias, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    impl = int4_impl(torch.randn(n, k, generator=gen), g, domain)
    x = (torch.randn(m, k, generator=gen) * scale).to(dtype)
    if not torch.isfinite(x).all():
        x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    args = int4_args(impl, x, b)
    ref = int4_a8_reference(*args)
    got = lut4.int4_a8_cpu(*args)
    assert got.dtype == dtype and got.shape == (m, n)
    assert_within(got, ref, impl.dequantize(torch.float32), x, b)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@settings(**SETTINGS)
@given(quant_type=st.sampled_from(["nf4", "fp4"]), block=st.sampled_from([32, 64, 128]), nested=st.booleans(),
       n=st.integers(1, 30), blocks=st.integers(1, 5), m=st.sampled_from([1, 4, 6, 12]), seed=st.integers(0, 2**31 - 1))
def test_nf4_native_uses_the_int8_codebook_within_its_stated_bound(isa, quant_type, block, nested, n, blocks, m, seed):
    gen = torch.Generator().manual_seed(seed)
    k = block * blocks
    cfg = (torchq.nf4_weight_only if quant_type == "nf4" else torchq.fp4_weight_only)(block_size=block, double_quant=nested)
    impl = cfg.quantize_weight(torch.randn(n, k, generator=gen)).tensor_impl
    x = torch.randn(m, k, generator=gen)
    args = (x, impl.packed, impl.absmax, impl.nested_codes, impl.nested_absmax, impl.nested_offset, [n, k], block, quant_type, None)
    got = lut4.blockwise_a8_cpu(*args)
    ref = blockwise_4bit_a8_reference(*args)
    w32 = impl.dequantize(torch.float32)
    cb = codebook(quant_type)
    cmax = float(cb.abs().max())
    # the stated bound: each weight off by at most absmax * cmax / 254 (absmax = |w| / |c| blockwise max)
    absmax = (w32.abs().reshape(n, blocks, block).amax(-1, keepdim=True) / cmax).expand(n, blocks, block).reshape(n, k)
    xq = ACTIVATIONS.fake_quantize(x)
    # every row count on an ISA with the GEMM form; the portable table above INT8_ACTIVATION_MAX_M
    # rows runs the exact codebook (within the fp32 bound alone, inside this one)
    extra = (xq.abs() @ (absmax * cmax / 254).T) * (1 + 1e-5)
    assert_within(got, ref, w32, x, None, extra)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("rows", [3, 12])  # the row kernel, the GEMM form
@pytest.mark.parametrize("nested", [False, True])
def test_nf4_native_is_the_int8_codebook_reference(isa, rows, nested):
    """Against weights with the codebook rounded to int8: the same up to fp32 order (on the
    portable table, above INT8_ACTIVATION_MAX_M rows: the exact codebook instead)."""
    if isa == "scalar" and rows > lut4.INT8_ACTIVATION_MAX_M:
        pytest.skip("the portable table has no GEMM form: the exact codebook (test above)")
    torch.manual_seed(0)
    n, k, block = 24, 256, 64
    impl = torchq.nf4_weight_only(block_size=block, double_quant=nested).quantize_weight(torch.randn(n, k)).tensor_impl
    x = torch.randn(rows, k)
    got = lut4.blockwise_a8_cpu(x, impl.packed, impl.absmax, impl.nested_codes, impl.nested_absmax, impl.nested_offset, [n, k], block,
                                "nf4", None)
    cb = codebook("nf4")
    t = torch.round(127 * cb / cb.abs().max())
    packed = impl.packed.reshape(n, k // 2)
    codes = torch.stack([packed >> 4, packed & 15], -1).reshape(n, k).long()
    absmax = impl.dequantize(torch.float32).reshape(n, -1, block).abs().amax(-1) / cb.abs().max()  # the (nested) block scales
    w8 = absmax.repeat_interleave(block, 1) * cb.abs().max() * t[codes] / 127
    ref = ACTIVATIONS.fake_quantize(x) @ w8.T
    assert_within(got, ref, w8, x, None)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("rows", [5, 13])  # the row kernel (the GEMM form on VNNI CPUs) and (above INT8_ACTIVATION_MAX_M) the GEMM form
def test_edge_activations(isa, rows):
    torch.manual_seed(1)
    impl = int4_impl(torch.randn(16, 128), 32)
    x = torch.randn(rows, 128)
    x[0] = 0  # all-zero row: the bias alone
    x[1, 70] = float("nan")  # a NaN: its row is NaN, the others are not touched
    x[2, 3] = float("inf")
    x[3, :32] = 0  # an all-zero block within a row
    b = torch.randn(16)
    got = lut4.int4_a8_cpu(*int4_args(impl, x, b))
    ref = int4_a8_reference(*int4_args(impl, x, b))
    assert torch.equal(got[0], b)
    assert got[1].isnan().all() and got[2].isnan().all() and ref[1].isnan().all() and ref[2].isnan().all()
    assert_within(got[3:], ref[3:], impl.dequantize(torch.float32), x[3:], b)


@needs_native
@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("rows", [3, 12])
def test_activation_codes_round_ties_to_even(isa, rows):
    """Blocks whose x / a lands on exact halves: a code off by one (a tie rounded away from even)
    moves the output by a * |w|, far outside the fp32 bound; tiny, huge and subnormal-scale blocks."""
    torch.manual_seed(2)
    impl = int4_impl(torch.randn(20, 96), 32)
    halves = torch.arange(-15.5, 16.0, 1.0)[:31]  # -15.5 .. 14.5: every one a tie at a = 1
    block = torch.cat([torch.tensor([127.0]), halves])
    x = torch.stack([torch.cat([block * 2.0**e, -block * 2.0**(e + 1), block.flip(0) * 2.0**-e]) for e in range(rows)])
    x[-1, 32:64] = block * 2.0**-140  # a = 2^-140 / 1 (subnormal): x / a still exact halves
    got = lut4.int4_a8_cpu(*int4_args(impl, x))
    ref = int4_a8_reference(*int4_args(impl, x))
    assert_within(got, ref, impl.dequantize(torch.float32), x, None)


HAS_VNNI = NATIVE and "avx512" in ISAS and "avx512_vnni" in native.status().features


def _a8_case(kind, n, k, m, g, bias, seed):
    """``(op, args)`` of an int8-activation call: an int4 weight (any zero-point domain) or an
    NF4 / FP4 one (nested or not)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * (0.5 + seed % 3)
    x = torch.randn(m, k, generator=gen) * 4
    b = torch.randn(n, generator=gen) if bias else None
    if kind.startswith("int4"):
        impl = int4_impl(w, g, {"int4-float": Z.FLOAT, "int4-int": Z.INT, "int4-none": Z.NONE}[kind])
        return lut4.int4_a8_cpu, int4_args(impl, x, b)
    quant_type, nested = kind.split("-")[0], kind.endswith("nested")
    cfg = (torchq.nf4_weight_only if quant_type == "nf4" else torchq.fp4_weight_only)(block_size=g, double_quant=nested)
    impl = cfg.quantize_weight(w).tensor_impl
    return lut4.blockwise_a8_cpu, (x, impl.packed, impl.absmax, impl.nested_codes, impl.nested_absmax, impl.nested_offset, [n, k],
                                   g, quant_type, b)


A8_KINDS = ["int4-float", "int4-int", "int4-none", "nf4", "nf4-nested", "fp4"]


def _a8_outputs() -> list[torch.Tensor]:
    """Outputs of the GEMM form (M 9 and 14) for every kind, a partial panel (N = 37), bias, and
    K with a half chunk (96, groups of 32)."""
    with native_library.lut4_paths(gemm=True):
        return [op(*args) for kind in A8_KINDS for m in (9, 14) for k, g in ((320, 64), (96, 32))
                for op, args in [_a8_case(kind, 37, k, m, g, True, 5)]]


@needs_native
@pytest.mark.skipif(not HAS_VNNI, reason="the VNNI GEMM form needs an AVX-512 VNNI CPU (and TORCHQ_NATIVE_VNNI not 0)")
@settings(**SETTINGS)
@given(kind=st.sampled_from(A8_KINDS), n=st.integers(1, 40), chunks=st.integers(1, 9), g=st.sampled_from([32, 64, 128]),
       m=st.sampled_from([9, 10, 11, 12, 13, 17, 33]), bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_vnni_gemm_form_is_bit_equal_to_the_avx2_one(kind, n, chunks, g, m, bias, seed):
    """Above INT8_ACTIVATION_MAX_M rows the AVX-512 table's GEMM form (vpdpbusd) computes the AVX2
    form's terms in its order: the same bits, for every tile remainder (M mod 4), partial panels
    (N mod 16), a half chunk (K = 64 i + 32, groups of 32) and both kinds (affine codes; the
    codebook's int8 values, signed). The GEMM forms are switched on for the comparison (with
    TORCHQ_NATIVE_GEMM=0 both ISAs would take their fp32 paths, which sum in other orders)."""
    k = 32 * chunks // g * g or g  # a whole number of weight blocks
    op, args = _a8_case(kind, n, k, m, g, bias, seed)
    saved = native.status().isa
    try:
        with native_library.lut4_paths(gemm=True):
            native.set_isa("avx2")
            avx2 = op(*args)
            native.set_isa("avx512")
            avx512 = op(*args)
    finally:
        native.set_isa(saved)
    assert torch.equal(avx512, avx2)


@needs_native
@pytest.mark.skipif(not HAS_VNNI, reason="the VNNI GEMM form needs an AVX-512 VNNI CPU (and TORCHQ_NATIVE_VNNI not 0)")
@pytest.mark.parametrize("kind", A8_KINDS)
def test_vnni_gemm_form_takes_calls_from_five_rows(kind):
    """On VNNI CPUs the GEMM form (faster than the row kernel from 5 rows) takes 5-8 rows too: its
    rows are computed alike whatever the other rows, so a 5-row call gives the first 5 rows of a
    9-row one (the GEMM form at any row limit) bit for bit; with the GEMM forms off, the row kernel
    serves them (within the reference's bound: test above)."""
    op, args = _a8_case(kind, 40, 192, 9, 64, True, 3)
    x = args[0]
    saved = native.status().isa
    try:
        native.set_isa("avx512")
        with native_library.lut4_paths(gemm=True):
            nine = op(*args)
            for m in (5, 8):
                assert torch.equal(op(x[:m], *args[1:]), nine[:m]), m
    finally:
        native.set_isa(saved)


@needs_native
@pytest.mark.skipif(not HAS_VNNI, reason="the VNNI GEMM form needs an AVX-512 VNNI CPU (and TORCHQ_NATIVE_VNNI not 0)")
def test_int8_activation_gemm_without_vnni_is_bit_equal():
    """TORCHQ_NATIVE_VNNI=0 gives the AVX-512 table the AVX2 GEMM form (CPUs without VNNI): the
    same outputs as this process's table (the VNNI form where the CPU has it)."""
    import os
    import subprocess
    import sys

    code = """
import sys, torch
sys.path.insert(0, "tests")
from test_int8act import _a8_outputs
from torchq import native
assert "avx512_vnni" not in native.status().features, native.status().features
torch.save(_a8_outputs(), sys.argv[1])
"""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "outs.pt")
        env = dict(os.environ, TORCHQ_NATIVE_VNNI="0")
        res = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=300,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert res.returncode == 0, res.stderr[-3000:]
        theirs = torch.load(path, weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(_a8_outputs(), theirs, strict=True))


HAS_AVX2_GEMM = NATIVE and "avx2" in ISAS
HAS_AMX = HAS_AVX2_GEMM and "avx512" in ISAS and native_library.int8_amx_supported()
CODEBOOK_KINDS = ["nf4", "nf4-nested", "fp4"]


def _amx_forms(op, args) -> dict[str, torch.Tensor]:
    """The call through the AVX2 GEMM form, the AMX form on emulated tiles and, on AMX CPUs, on the
    tiles (GEMM forms on), each AMX run checked to have taken the AMX form."""
    saved = native.status().isa
    out = {}
    try:
        with native_library.lut4_paths(gemm=True):
            native.set_isa("avx2")
            with native_library.int8_amx("off"):
                out["avx2"] = op(*args)
            for mode, isa in [("emulated", "avx2")] + ([("on", "avx512")] if HAS_AMX else []):
                native.set_isa(isa)
                before = native_library.int8_amx_calls()
                with native_library.int8_amx(mode):
                    out[mode] = op(*args)
                assert native_library.int8_amx_calls() == before + 1, mode
    finally:
        native.set_isa(saved)
    return out


@needs_native
@pytest.mark.skipif(not HAS_AVX2_GEMM, reason="the AMX form's panels are unpacked with AVX2")
@settings(**SETTINGS)
@given(kind=st.sampled_from(CODEBOOK_KINDS), n=st.integers(1, 40), chunks=st.integers(1, 9), g=st.sampled_from([32, 64, 128]),
       m=st.sampled_from([64, 65, 70, 79, 80, 96, 111]), bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_amx_gemm_form_is_bit_equal_to_the_avx2_one(kind, n, chunks, g, m, bias, seed):
    """From 64 rows nf4a8 / fp4a8 take the AMX form (tdpbssd of each 32-block's codes against the
    panel's signed table values, then the other forms' fp32 epilogue in their order): the AVX2 form's
    bits on emulated tiles (every machine, CI's AVX2-only ones included) and, on AMX CPUs, on the
    tiles; for whole and partial groups of 16 rows (M mod 16), partial panels (N mod 16), a half
    chunk (K = 64 i + 32) and bias."""
    k = 32 * chunks // g * g or g  # a whole number of weight blocks
    forms = _amx_forms(*_a8_case(kind, n, k, m, g, bias, seed))
    for mode in ("emulated", "on"):
        if mode in forms:
            assert torch.equal(forms[mode], forms["avx2"]), mode


@needs_native
@pytest.mark.skipif(not HAS_AVX2_GEMM, reason="the AMX form's panels are unpacked with AVX2")
@pytest.mark.parametrize("kind,m", [("int4-float", 64), ("int4-none", 100), ("nf4", 63), ("fp4", 40)])
def test_amx_gemm_form_is_not_taken_below_64_rows_or_for_int4(kind, m):
    """The affine kind (int4a8: on AMX no faster than its VNNI form) and fewer than 64 rows keep the
    other GEMM forms, even with the AMX form emulated; with the ISA capped to AVX2, "on" never takes
    the tiles (an AMX CPU then runs what an AVX2 one does)."""
    op, args = _a8_case(kind, 37, 192, m, 64, True, 1)
    saved = native.status().isa
    try:
        native.set_isa("avx2")
        for mode in ("emulated", "on"):
            with native_library.lut4_paths(gemm=True), native_library.int8_amx(mode):
                before = native_library.int8_amx_calls()
                op(*args)
                assert native_library.int8_amx_calls() == before, mode
        big_op, big_args = _a8_case("nf4", 37, 192, 64, 64, True, 1)
        with native_library.lut4_paths(gemm=True), native_library.int8_amx("on"):
            before = native_library.int8_amx_calls()
            big_op(*big_args)
            assert native_library.int8_amx_calls() == before
    finally:
        native.set_isa(saved)


@needs_native
def test_rounded_scales_are_refused_by_the_library():
    impl = torchq.Int4WeightOnlyConfig(group_size=32, layout=Int4NativeLayout(), scale_dtype=torch.bfloat16).quantize_weight(
        torch.randn(8, 64)).tensor_impl
    weight = lut4.int4_native_weight(impl.packed, impl.scale, impl.shift, impl.zero, 8, 64, 32, impl.code_base, *impl.round_kinds)
    with pytest.raises(Exception, match="int4_groupwise_linear_a8"):
        native_library.run_linear(weight.int8_activations(), torch.randn(1, 64), None)


@pytest.mark.parametrize("name", ["int4a8", "int4a8-g128", "nf4a8", "fp4a8-b32"])
def test_config_dispatch_compile_and_checkpoint(tmp_path, name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    ref_model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    ref_model.load_state_dict(model.state_dict())
    cfg = torchq.config_from_name(name)
    assert torchq.config_from_json(cfg.to_json()) == cfg
    torchq.quantize_(model, cfg)
    assert isinstance(model[0].weight.act_quant, PerBlockInt8)
    x = torch.randn(3, 128)
    with torch.no_grad():
        if NATIVE:
            with torchq.strict():
                y = model(x)
            kernels = set(torchq.explain(model, x).kernels().values())
            assert kernels == {"int4_int8_activations" if name.startswith("int4") else "blockwise_4bit_int8_activations"}
        else:
            y = model(x)
        r = ref_model(x)
        assert float(20 * torch.log10(r.norm() / (r - y).norm())) > 12
        torch._dynamo.reset()  # earlier tests' graphs of Sequential.forward count toward the recompile limit
        compiled = torch.compile(model, fullgraph=True)
        assert torch.allclose(compiled(x), y, atol=1e-5, rtol=1e-5)
        torchq.save_quantized(model, tmp_path / "m.safetensors")
        fresh = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        torchq.load_quantized(fresh, tmp_path / "m.safetensors")
        assert fresh[0].weight.act_quant == PerBlockInt8()
        assert torch.equal(fresh(x), y)


def test_bf16_scales_take_no_int8_kernel_and_strict_says_why():
    w = torchq.Int4WeightOnlyConfig(group_size=32, layout=Int4NativeLayout(), scale_dtype=torch.bfloat16).quantize_weight(torch.randn(8, 64))
    aqt = torchq.AffineQuantizedTensor(w.tensor_impl, w.dtype, act_quant=PerBlockInt8())
    with torchq.strict(), pytest.raises(torchq.NoKernelError, match="needs fp32 scales and zeros"):
        torch.nn.functional.linear(torch.randn(2, 64), aqt)


def test_config_arguments():
    with pytest.raises(ValueError, match="weight: expected 'int4', 'nf4' or 'fp4', got 'int8'"):
        torchq.int8_dynamic_activation_4bit_weight("int8")
    with pytest.raises(ValueError, match="double_quant: only for weight='nf4'"):
        torchq.int8_dynamic_activation_4bit_weight("int4", double_quant=True)
    with pytest.raises(ValueError, match="group_size"):
        torchq.int8_dynamic_activation_4bit_weight("int4", group_size=48)
    with pytest.raises(ValueError, match="layout: the int8-activation mode chooses its own"):
        torchq.Int8DynamicActivation4BitWeightConfig(layout=Int4NativeLayout())
