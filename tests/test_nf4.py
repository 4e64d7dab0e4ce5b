"""NF4 / FP4 through quantize_: the Blockwise4bitLayout, its kernel, checkpoints, QLoRA."""

from __future__ import annotations

import importlib.util
import io
import warnings

import pytest
import torch
from torch import nn

import torchq
from torchq import Blockwise4bitLayout, PackedBitsLayout, PlainLayout
from torchq.blockwise import codebook

ops = torch.ops.torchq
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
CONFIGS = {
    "nf4-dq": lambda **kw: torchq.nf4_weight_only(**kw),
    "nf4": lambda **kw: torchq.nf4_weight_only(double_quant=False, **kw),
    "fp4-dq-b128": lambda **kw: torchq.fp4_weight_only(block_size=128, **kw),
    "fp4-b32": lambda **kw: torchq.fp4_weight_only(block_size=32, double_quant=False, **kw),
}


def net(dtype=torch.bfloat16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 64, bias=False)).to(dtype)


def quantized(cfg_name: str, dtype=torch.bfloat16, **kw) -> nn.Sequential:
    m = net(dtype)
    torchq.quantize_(m, CONFIGS[cfg_name](**kw))
    return m


def run(m, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.FallbackWarning)
        return m(x)


@pytest.mark.parametrize("cfg_name", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_the_op_reference(cfg_name, dtype):
    cfg = CONFIGS[cfg_name]()
    m = quantized(cfg_name, dtype)
    w0 = net(dtype)[0].weight.detach()
    w = m[0].weight
    assert isinstance(w, torchq.AffineQuantizedTensor) and w.quant_layout == Blockwise4bitLayout()
    packed, absmax = ops.quantize_4bit(w0, cfg.block_size, cfg.quant_type, torch.uint8)
    impl = w.tensor_impl
    assert torch.equal(impl.packed.reshape(-1), packed.reshape(-1))  # bitsandbytes' bytes
    if cfg.double_quant:
        from torchq.blockwise import double_dequantize, double_quantize

        want = double_dequantize(*double_quantize(absmax))
        assert torch.equal(impl.scale().reshape(-1), want)
        assert impl.absmax is None and impl.nested_codes.dtype == torch.uint8
    else:
        assert torch.equal(impl.absmax.reshape(-1), absmax)
    ref_w = ops.dequantize_4bit(packed, impl.scale().reshape(-1), cfg.block_size, cfg.quant_type, [256, 256], dtype)
    assert torch.equal(w.dequantize(), ref_w)
    x = torch.randn(5, 256).to(dtype)
    with torch.no_grad():  # (with a trainable bias, the bias is added outside the kernel)
        ref_y = torch.nn.functional.linear(x, ref_w, m[0].bias)
        with torchq.native.disabled():  # the reference path is the definition, bit for bit
            assert torch.equal(torch.nn.functional.linear(x, w, m[0].bias), ref_y)
        # the native paths use the same weight values; their rounding differs (fp32 accumulation
        # and one rounding for small M; bf16 tiles, then the bias in a second rounding, for larger M)
        y = torch.nn.functional.linear(x, w, m[0].bias)
        exact = x.double() @ ref_w.double().T + m[0].bias.double()
        assert (y.double() - exact).norm() <= 1.5 * (ref_y.double() - exact).norm() + 1e-5 * exact.norm()
    report = torchq.explain(m, x)
    assert report.kernels() == {"0": "blockwise_4bit_linear", "2": "blockwise_4bit_linear"}


def test_bytes_per_weight():
    m = quantized("nf4-dq")
    w = m[0].weight
    n, k = w.shape
    bits = 8 * w.nbytes_quantized() / (n * k)
    assert bits == pytest.approx(4 + 8 / 64 + 32 / (64 * 256) + 32 / (n * k), rel=1e-6)  # ~4.127
    plain = quantized("nf4")[0].weight
    assert 8 * plain.nbytes_quantized() / (n * k) == pytest.approx(4.5)


def test_layer_whose_in_features_is_not_a_multiple_of_the_block_is_skipped_visibly():
    m = nn.Sequential(nn.Linear(96, 8))
    with pytest.warns(torchq.SkippedLayerWarning, match="not a multiple of block_size 64"):
        torchq.quantize_(m, torchq.nf4_weight_only())
    assert not isinstance(m[0].weight, torchq.AffineQuantizedTensor)


def test_config_validation_and_json():
    with pytest.raises(ValueError, match="block_size"):
        torchq.nf4_weight_only(block_size=48)
    with pytest.raises(ValueError, match="quant_type"):
        torchq.NF4WeightOnlyConfig(quant_type="int4")
    cfg = torchq.fp4_weight_only(block_size=128, double_quant=False)
    assert torchq.config_from_json(cfg.to_json_str()) == cfg


@pytest.mark.parametrize("cfg_name", ["nf4", "fp4-b32"])
@pytest.mark.parametrize("layout", [PlainLayout(), PackedBitsLayout()])
def test_other_layouts_hold_the_same_codes(cfg_name, layout):
    w = quantized(cfg_name)[0].weight
    other = w.to_layout(layout)
    assert other.to_plain().equal(w.to_plain())
    assert torch.equal(other.dequantize(), w.dequantize())
    assert other.to_layout(Blockwise4bitLayout()).to_plain().equal(w.to_plain())


def test_double_quantized_scales_stay_in_the_blockwise_layout():
    w = quantized("nf4-dq")[0].weight
    with pytest.raises(ValueError, match="double-quantized"):
        w.to_layout(PlainLayout())
    with pytest.raises(ValueError, match="codebook"):
        w.to_layout(torchq.Int4CPULayout())


@pytest.mark.parametrize("cfg_name", CONFIGS)
def test_checkpoints_roundtrip(tmp_path, cfg_name):
    m = quantized(cfg_name)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    y = run(m, x)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    with torch.device("meta"):
        fresh = net()
    fresh.load_state_dict(torch.load(buf, weights_only=True), assign=True)
    assert torch.equal(run(fresh, x), y)
    assert fresh[0].weight.to_plain().equal(m[0].weight.to_plain())
    torchq.save_quantized(m, tmp_path / "m.safetensors")
    with torch.device("meta"):
        fresh = net()
    torchq.load_quantized(fresh, tmp_path / "m.safetensors")
    assert torch.equal(run(fresh, x), y)
    assert fresh[0].weight.to_plain().equal(m[0].weight.to_plain())


def test_narrow_of_double_quantized_weight_keeps_values():
    w = quantized("nf4-dq")[0].weight
    part = w.detach()[64:128]
    assert torch.equal(part.dequantize(), w.dequantize()[64:128])


def test_qlora_adapter_trains_on_a_frozen_nf4_base():
    """A LoRA adapter on a frozen NF4 linear: gradients reach the adapter (and the input) through
    the quantized weight, and the loss falls."""
    torch.manual_seed(0)
    base = nn.Linear(128, 64)
    torchq.quantize_(nn.Sequential(base), torchq.nf4_weight_only())

    class LoRA(nn.Module):
        def __init__(self, base: nn.Linear, r: int = 8) -> None:
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.randn(r, 128) * 0.01)
            self.b = nn.Parameter(torch.zeros(64, r))

        def forward(self, x):
            return self.base(x) + (x @ self.a.t()) @ self.b.t()

    model = LoRA(base)
    target = nn.Linear(128, 64)
    x = torch.randn(256, 128)
    y = target(x).detach()
    opt = torch.optim.Adam([model.a, model.b], lr=1e-2)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        inp = x.clone().requires_grad_(True)
        loss = torch.nn.functional.mse_loss(model(inp), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    assert inp.grad is not None and torch.isfinite(inp.grad).all()
    assert not base.weight.requires_grad and base.weight.grad is None
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.slow
def test_compile_fullgraph():
    m = quantized("nf4-dq")
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        y, ref = torch.compile(m, fullgraph=True)(x).float(), m(x).float()
    assert 20 * torch.log10(ref.norm() / (ref - y).norm()) > 40  # inductor fuses the bf16 epilogue differently


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_same_bytes_and_outputs_as_bitsandbytes(quant_type):
    import bitsandbytes.functional as bnbf

    m = net(torch.bfloat16)
    w0 = m[0].weight.detach().clone()
    torchq.quantize_(m, torchq.NF4WeightOnlyConfig(quant_type=quant_type, double_quant=False))
    packed, state = bnbf.quantize_4bit(w0, blocksize=64, quant_type=quant_type)
    impl = m[0].weight.tensor_impl
    a, b = impl.packed.reshape(-1), packed.reshape(-1)
    differ = a != b
    if quant_type == "nf4":
        assert not differ.any()
    assert torch.equal(impl.absmax.reshape(-1), state.absmax)
    assert torch.equal(m[0].weight.dequantize(), bnbf.dequantize_4bit(packed, state)) or quant_type == "fp4"
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    bnb_y = torch.nn.functional.linear(x, bnbf.dequantize_4bit(packed, state))
    with torchq.native.disabled():  # the reference gemv_4bit is bitsandbytes' arithmetic, bit for bit
        assert torch.equal(ops.gemv_4bit(x, impl.packed, [256, 256], impl.absmax.reshape(-1), codebook(quant_type), 64), bnb_y) \
            or quant_type == "fp4"
    # the native kernel accumulates the same fp32 weights in fp32 and rounds once: within bf16 rounding
    y = ops.gemv_4bit(x, impl.packed, [256, 256], impl.absmax.reshape(-1), codebook(quant_type), 64)
    if quant_type == "nf4":
        assert torch.allclose(y.float(), bnb_y.float(), rtol=2**-7, atol=2**-7)
