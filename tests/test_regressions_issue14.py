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
