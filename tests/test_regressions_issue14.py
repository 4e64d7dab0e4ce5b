"""Regressions of issue 14, items 6 and 12: contiguous outputs on every tile-dtype / ISA path
(an AVX2 CPU takes fp32 tiles, which once returned strides (1, M)), and small crashes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from test_native_blockwise import ISAS, needs_native

import torchq
from torchq import prefill

TILES = dict(argvalues=[False, True], ids=["fp32tiles", "bf16tiles"], indirect=True)
CONFIGS = {
    "int4": lambda: torchq.int4_weight_only(group_size=32),
    "int4_padded_k": lambda: torchq.int4_weight_only(group_size=32),
    "int8wo": torchq.int8_weight_only,
    "int8dq": torchq.int8_dynamic_activation_int8_weight,
    "nf4": torchq.nf4_weight_only,
    "fp4": torchq.fp4_weight_only,
    "llm_int8": torchq.llm_int8,
    "intx3": lambda: torchq.intx_weight_only(bits=3, group_size=32),
}


def _linear(name: str, dtype: torch.dtype, bias: bool = True) -> torch.nn.Linear:
    k = 96 if name == "int4_padded_k" else 128
    lin = torch.nn.Linear(k, 72, bias=bias).to(dtype)
    torchq.quantize_(lin, CONFIGS[name]())
    return lin


# -- item 6: contiguous outputs ----------------------------------------------------------------

def test_fast_bf16_matmul_is_forced_by_the_environment():
    code = "from torchq import prefill; print(prefill.FAST_BF16_MATMUL)"
    for value, expected in (("0", "False"), ("1", "True")):
        env = dict(os.environ, TORCHQ_FAST_BF16_MATMUL=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        assert out.strip() == expected
    env = dict(os.environ, TORCHQ_FAST_BF16_MATMUL="maybe")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "TORCHQ_FAST_BF16_MATMUL" in res.stderr


@pytest.mark.parametrize("fast_bf16", **TILES)
def test_the_fixture_picks_the_tile_dtype(fast_bf16):
    assert prefill.tile_dtype(torch.bfloat16) == (torch.bfloat16 if fast_bf16 else torch.float32)
    assert prefill.tile_dtype(torch.float32) == torch.float32


@pytest.mark.parametrize("fast_bf16", **TILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_are_contiguous_for_every_config_and_m(name, dtype, fast_bf16):
    torch.manual_seed(0)
    lin = _linear(name, dtype)
    k = lin.in_features
    for m in (1, 4, 5, 16, 17, 70):
        x = torch.randn(m, k, dtype=dtype)
        with torch.no_grad():
            y = lin(x)
            ref = torch.nn.functional.linear(x.float(), lin.weight.dequantize().float(), lin.bias.float())
        assert y.shape == (m, 72) and y.is_contiguous(), f"M={m}: strides {y.stride()}"
        assert torch.allclose(y.float(), ref, rtol=5e-2, atol=5e-2 * ref.abs().max().item())
        y3 = lin(torch.randn(2, m, k, dtype=dtype))
        assert y3.shape == (2, m, 72) and y3.is_contiguous(), f"[2, {m}, K]: strides {y3.stride()}"


@needs_native
@pytest.mark.parametrize("fast_bf16", **TILES)
@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_tiled_paths_are_contiguous_on_every_isa(isa, fast_bf16):
    for name in ("int4", "int4_padded_k", "int8wo", "nf4"):
        lin = _linear(name, torch.bfloat16, bias=False)
        y = lin(torch.randn(33, lin.in_features, dtype=torch.bfloat16))
        assert y.is_contiguous(), f"{name}: strides {y.stride()}"


@pytest.mark.slow
@pytest.mark.parametrize("fast_bf16", **TILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["int4", "int8wo", "nf4"])
def test_compile_with_a_20_token_prompt_matches_eager(name, dtype, fast_bf16):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.ReLU(), torch.nn.Linear(96, 64)).to(dtype)
    torchq.quantize_(m, CONFIGS[name]())
    x = torch.randn(1, 20, 128, dtype=dtype)
    with torch.no_grad():
        eager = m(x)
        torch._dynamo.reset()
        y = torch.compile(m, fullgraph=True)(x)
    assert y.shape == eager.shape
    assert torch.allclose(y.float(), eager.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_demo_quick_runs_on_avx2_with_fp32_tiles():
    """The README's main job as an AVX2-only CPU runs it (no AVX-512, no bf16 matmul)."""
    env = dict(os.environ, TORCHQ_NATIVE_ISA="avx2", TORCHQ_FAST_BF16_MATMUL="0")
    res = subprocess.run([sys.executable, "-m", "torchq.demo", "--quick"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "SQNR" in res.stdout


# -- item 12: small crashes --------------------------------------------------------------------

def test_llm_int8_float64_input_runs_the_reference():
    """float64 input has no kernel: the fallback fake-quantizes the input (OutlierInt8 had no
    fake_quantize) and matches the fp32 kernel's meaning."""
    torch.manual_seed(0)
    lin = _linear("llm_int8", torch.float32, bias=False)
    x = torch.randn(5, 128)
    x[1, 3] = 9.0  # an outlier column
    with pytest.warns(torchq.FallbackWarning):
        y64 = lin(x.double())
    assert y64.dtype == torch.float64 and y64.shape == (5, 72)
    assert torch.allclose(y64.float(), lin(x), rtol=1e-4, atol=1e-4)
    fq = torchq.OutlierInt8(6.0).fake_quantize(x)
    assert torch.equal(fq[:, 3], x[:, 3])  # the outlier column stays in float
    assert fq.dtype == x.dtype and not torch.equal(fq[:, 0], x[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_zero_rows_give_an_empty_output_like_float(name, dtype):
    if name in ("nf4", "fp4") and dtype == torch.float64:
        pytest.skip("NF4/FP4 dequantize to fp32/bf16/fp16 only (any M)")
    lin = _linear(name, torch.float32).to(dtype)
    for shape in ((0, lin.in_features), (3, 0, lin.in_features)):
        x = torch.randn(shape, dtype=dtype)
        with torch.no_grad():
            y = lin(x)
        assert y.shape == (*shape[:-1], 72) and y.dtype == dtype
    for op in (torch.ops.torchq.int8_vectorwise_quant, torchq.ops.vectorwise.int8_vectorwise_quant):
        codes, stats, cols = op(torch.randn(0, 16), 6.0)
        assert codes.shape == (0, 16) and stats.shape == (0,) and cols.numel() == 0


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_int8_dynamic_infinite_rows_are_bit_equal_to_the_reference(isa, dtype):
    """A row holding ±inf gets scale inf, all codes 0 (inf * 0 is NaN, which the reference's
    codes read as 0) and NaN outputs; the SIMD kernels turned the NaN into the lowest code (±inf)."""
    from torchq import native
    from torchq.ops.int8 import int8_dynamic_linear

    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (24, 70), generator=g, dtype=torch.int8)
    scale = torch.rand(24, generator=g) + 0.1
    x = torch.randn(7, 70, generator=g)
    x[0, 5] = float("inf")
    x[1, 3] = -float("inf")
    x[2, 7] = float("nan")
    x[3, :] = float("inf")
    x[4, 0], x[4, 1] = float("inf"), float("nan")
    x[5, 69] = 3e38  # inf in fp16
    x = x.to(dtype)
    y = int8_dynamic_linear(x, codes, scale, -127, 127, 1e-5)
    with native.disabled():
        ref = int8_dynamic_linear(x, codes, scale, -127, 127, 1e-5)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.nan_to_num(), ref.nan_to_num())
    assert ref[:5].isnan().all()


def test_float64_zero_point_is_rejected_at_quantization_and_on_load(tmp_path, monkeypatch):
    from torchq.canonical import PlainForm
    from torchq.checkpoint import CheckpointError

    w = torch.randn(32, 64)
    with pytest.raises((TypeError, ValueError), match="zero_point.*float64|float64.*zero"):
        torchq.AffineQuantizedTensor.from_float(w, "asymmetric", (1, 32), 0, 15, zero_point_dtype=torch.float64,
                                                zero_point_domain="float")
    # a file written with a float64 zero point (as an older torchq could) is refused on load
    q = torchq.AffineQuantizedTensor.from_float(w, "asymmetric", (1, 32), 0, 15, zero_point_dtype=torch.float32,
                                                zero_point_domain="float", layout=torchq.PackedBitsLayout())
    plain = q.to_plain()
    bad = object.__new__(PlainForm)
    for f, v in (("codes", plain.codes), ("scale", plain.scale), ("zero_point", plain.zero_point.double()),
                 ("spec", plain.spec), ("nested", None)):
        object.__setattr__(bad, f, v)
    monkeypatch.setattr(type(q), "to_plain", lambda self: bad)
    path = tmp_path / "w.pt"
    torch.save(q, path)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="zero_point"):
        torch.load(path, weights_only=True)


@pytest.mark.parametrize("name", ["int4", "int8wo", "int8dq", "nf4", "llm_int8", "intx3"])
def test_module_to_dtype_while_a_graph_is_alive(name):
    """Float modules convert while a forward's graph is alive; quantized ones failed in
    swap_tensors (the autograd Function saved the weight wrapper)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(128, 72), torch.nn.Linear(72, 16))
    torchq.quantize_(m, CONFIGS[name]())
    x = torch.randn(5, 128, requires_grad=True)
    m(x).sum().backward()
    expected, x.grad = x.grad, None
    y = m(x)
    m.to(torch.bfloat16)
    assert m[0].weight.dtype == torch.bfloat16 and isinstance(m[0].weight, torchq.AffineQuantizedTensor)
    y.sum().backward()
    assert torch.equal(x.grad, expected)
    m.to(torch.float32)
    assert m(x).dtype == torch.float32


@needs_native
def test_int8_dynamic_without_vnni_is_bit_equal():
    """TORCHQ_NATIVE_VNNI=0 runs the path of AVX-512 CPUs without VNNI (on any CPU)."""
    code = """
import torch
from torchq import native
from torchq.ops.int8 import int8_dynamic_linear
g = torch.Generator().manual_seed(0)
codes = torch.randint(-127, 128, (40, 70), generator=g, dtype=torch.int8)
scale = torch.rand(40, generator=g) + 0.1
for m in (1, 5, 33):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(m, 70, generator=g) * 3).to(dtype)
        y = int8_dynamic_linear(x, codes, scale, -127, 127, 1e-5)
        with native.disabled():
            ref = int8_dynamic_linear(x, codes, scale, -127, 127, 1e-5)
        assert torch.equal(y, ref), (m, dtype)
print("ok")
"""
    env = dict(os.environ, TORCHQ_NATIVE_VNNI="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]
