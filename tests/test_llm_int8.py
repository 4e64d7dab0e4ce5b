"""LLM.int8 through quantize_: outlier columns in floating point, the rest in int8."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import torchq

ops = torch.ops.torchq


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 64)).to(dtype)


def inputs(dtype=torch.float32):
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(1))
    x[:, 11] *= 40  # outlier features, as in large LLMs
    x[:, 200] *= 25
    return x.to(dtype)


def sqnr(ref, y):
    ref, y = ref.double(), y.double()
    return float(20 * torch.log10(ref.norm() / (ref - y).norm()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_is_the_llm_int8_recipe(dtype):
    m = model(dtype)
    torchq.quantize_(m, torchq.llm_int8(threshold=6.0))
    x = inputs(dtype)
    w = m[0].weight
    assert torchq.explain(m, x).kernels() == {"0": "llm_int8_cpu", "2": "llm_int8_cpu"}
    with torch.no_grad():
        y = torch.nn.functional.linear(x, w, m[0].bias)
    codes, row_absmax, cols = ops.int8_vectorwise_quant(x, 6.0)
    assert cols.tolist() == [11, 200]
    acc = ops.int8_linear_matmul(codes, w.codes)
    s_w = w.scale.reshape(1, -1).float()
    ref = acc.float() * (row_absmax / 127).reshape(-1, 1) * s_w
    ref = ref + x[:, cols].float() @ (w.codes[:, cols].float() * s_w.reshape(-1, 1)).t()
    ref = ref.to(dtype) + m[0].bias
    assert torch.equal(y, ref)


def test_outliers_make_it_better_than_plain_per_token_int8():
    x = inputs()
    base = model()
    ref = base(x)
    llm = model()
    torchq.quantize_(llm, torchq.llm_int8())
    dyn = model()
    torchq.quantize_(dyn, torchq.int8_dynamic_activation_int8_weight())
    with torch.no_grad():
        s_llm, s_dyn = sqnr(ref, llm(x)), sqnr(ref, dyn(x))
    assert s_llm > 35 and s_llm > s_dyn + 5


def test_without_outliers_cols_are_empty_and_output_is_close():
    m = model()
    torchq.quantize_(m, torchq.llm_int8(threshold=100.0))
    x = torch.randn(3, 256)
    assert ops.int8_vectorwise_quant(x, 100.0)[2].numel() == 0
    base = model()
    with torch.no_grad():
        assert sqnr(base(x), m(x)) > 30


def test_gradients_reach_input_and_bias():
    m = model()
    torchq.quantize_(m, torchq.llm_int8())
    x = inputs().requires_grad_(True)
    m(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert m[0].bias.grad is not None and m[0].weight.grad is None


def test_config_json_and_validation():
    cfg = torchq.llm_int8(threshold=4)
    assert cfg.threshold == 4.0 and torchq.config_from_json(cfg.to_json_str()) == cfg
    with pytest.raises(ValueError, match="threshold"):
        torchq.llm_int8(threshold=0)


def test_checkpoints_keep_the_outlier_scheme(tmp_path):
    m = model(torch.bfloat16)
    torchq.quantize_(m, torchq.llm_int8(threshold=5.0))
    x = inputs(torch.bfloat16)
    with torch.no_grad():
        y = m(x)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    with torch.device("meta"):
        fresh = model(torch.bfloat16)
    fresh.load_state_dict(torch.load(buf, weights_only=True), assign=True)
    assert fresh[0].weight.act_quant == torchq.OutlierInt8(5.0)
    with torch.no_grad():
        assert torch.equal(fresh(x), y)
    torchq.save_quantized(m, tmp_path / "m.safetensors")
    with torch.device("meta"):
        fresh = model(torch.bfloat16)
    torchq.load_quantized(fresh, tmp_path / "m.safetensors")
    with torch.no_grad():
        assert torch.equal(fresh(x), y)


@pytest.mark.slow
def test_compile_fullgraph():
    m = model()
    torchq.quantize_(m, torchq.llm_int8())
    x = inputs()
    torch._dynamo.reset()
    with torch.no_grad():
        assert sqnr(m(x), torch.compile(m, fullgraph=True)(x)) > 60
