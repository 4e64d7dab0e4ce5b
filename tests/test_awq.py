"""AWQ (torchq.algorithms.awq) and the input scale it leaves on quantized weights
(AffineQuantizedTensor.input_scale): numerics, ops, compile, checkpoints, hostile files."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import torchq
from torchq.algorithms.awq import awq_quantize
from torchq.algorithms.gptq import proxy_error
from torchq.checkpoint import CheckpointError, codec

CONFIGS = {
    "int4": torchq.int4_weight_only(group_size=32),
    "int4-sym": torchq.int4_weight_only(group_size=32, zero_point_domain="none"),
    "intx3": torchq.intx_weight_only(bits=3, group_size=16),
    "nf4": torchq.nf4_weight_only(block_size=32),
}


def salient_problem(seed: int, n: int = 16, k: int = 64, t: int = 256):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(t, k, generator=g)
    x[:, :4] *= 30  # a few input features carry large activations
    return w, x, x.T @ x / t, x.abs().mean(dim=0)


def sqnr(ref: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum()))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_awq_scales_salient_features_and_beats_round_to_nearest(name: str) -> None:
    w, x, h, m = salient_problem(0)
    fmt = CONFIGS[name].group_format(w)
    r = awq_quantize(w, h, m, fmt)
    assert r.used == "awq" and r.alpha > 0
    assert r.error < 0.8 * r.rtn_error
    # salient features are divided by more at run time: their columns were rounded on a finer grid
    assert float(r.input_scale[:4].max()) < float(r.input_scale[4:].min())
    approx = fmt.dequantize(r.codes, r.scale, r.zero) * r.input_scale
    assert proxy_error(w, approx, h) / proxy_error(w, torch.zeros_like(w), h) == pytest.approx(r.error, rel=1e-4)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 8), groups=st.integers(1, 3), t=st.integers(1, 40), name=st.sampled_from(sorted(CONFIGS)),
       clip=st.booleans(), seed=st.integers(0, 2**16))
def test_awq_never_worse_than_round_to_nearest(n, groups, t, name, clip, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    k = groups * 32
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g).mul(3)
    x = torch.randn(t, k, generator=g) * torch.rand(k, generator=g).mul(10)
    fmt = CONFIGS[name].group_format(w)
    r = awq_quantize(w, x.T @ x / t, x.abs().mean(0), fmt, grid=5, clip=clip)
    assert r.error <= r.rtn_error * (1 + 1e-6)


def test_awq_grid_one_without_clipping_is_round_to_nearest() -> None:
    w, x, h, m = salient_problem(1)
    fmt = CONFIGS["int4"].group_format(w)
    r = awq_quantize(w, h, m, fmt, grid=1, clip=False)
    codes, scale, zero, _ = fmt.round_to_nearest(w)
    assert r.used == "rtn" and r.input_scale is None and torch.equal(r.codes, codes)
    with pytest.raises(ValueError, match="mean_abs"):
        awq_quantize(w, h, m[:3], fmt)
    with pytest.raises(ValueError, match="grid"):
        awq_quantize(w, h, m, fmt, grid=0)


# -- the input scale on a quantized weight ----------------------------------------------------------------
def scaled_weight(dtype: torch.dtype = torch.float32, seed: int = 0) -> torchq.AffineQuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    w = torchq.int4_weight_only(group_size=32).quantize_weight(torch.randn(24, 64, generator=g).to(dtype), label="layer")
    s = torch.rand(64, generator=g) + 0.5
    return w._replace(input_scale=s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_scale_linear_matches_its_dequantized_value(dtype) -> None:
    w = scaled_weight(dtype)
    x = torch.randn(5, 64).to(dtype)
    deq = w.dequantize(torch.float32)
    codes_only = w.tensor_impl.dequantize(torch.float32)
    assert torch.allclose(deq, codes_only * w.input_scale)
    y = F.linear(x, w)
    ref = F.linear(x.float(), deq)
    assert sqnr(ref, y.float()) > (40 if dtype == torch.float32 else 25)


def test_input_scale_follows_ops() -> None:
    w = scaled_weight()
    assert "input_scale" in repr(w)
    cols = w[:, 32:64]  # slicing the input features (whole groups) slices the scale
    assert torch.equal(cols.input_scale, w.input_scale[32:64])
    assert torch.allclose(cols.dequantize(), w.dequantize()[:, 32:64])
    rows = w[4:12]
    assert torch.allclose(rows.dequantize(), w.dequantize()[4:12])
    c = w.clone()
    assert c.input_scale is not w.input_scale and torch.equal(c.input_scale, w.input_scale)
    assert torch.allclose(w.t().dequantize(), w.dequantize().t())
    assert torch.allclose(F.embedding(torch.tensor([3, 7]), w), w.dequantize()[[3, 7]])
    dst = scaled_weight(seed=1)
    dst.copy_(w)
    assert torch.equal(dst.input_scale, w.input_scale) and torch.equal(dst.dequantize(), w.dequantize())
    plain = torchq.int4_weight_only(group_size=32).quantize_weight(torch.randn(24, 64))
    with pytest.raises(ValueError, match="input_scale"):
        plain.copy_(w)
    with pytest.raises(ValueError, match="input_scale: expected a float32 tensor of shape"):
        w._replace(input_scale=torch.ones(63))
    with pytest.raises(ValueError, match="input_scale"):
        torchq.interop.bitsandbytes.to_bitsandbytes({"w": w})


def test_input_scale_compiles_fullgraph() -> None:
    lin = nn.Linear(64, 24, bias=True)
    lin.weight = nn.Parameter(scaled_weight(), requires_grad=False)
    x = torch.randn(3, 64)
    eager = lin(x)
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(x), eager, atol=1e-5)


def test_input_scale_round_trips_checkpoints(tmp_path) -> None:
    lin = nn.Linear(64, 24)
    lin.weight = nn.Parameter(scaled_weight(), requires_grad=False)
    model = nn.Sequential(lin)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert torch.equal(sd["0.weight"].input_scale, lin.weight.input_scale)
    torchq.save_quantized(model, tmp_path / "ckpt")
    fresh = nn.Sequential(nn.Linear(64, 24))
    torchq.load_quantized(fresh, tmp_path / "ckpt")
    x = torch.randn(4, 64)
    assert torch.equal(fresh(x), model(x))
    assert torch.equal(fresh[0].weight.input_scale, lin.weight.input_scale)


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf")])
def test_hostile_input_scale_is_rejected(bad: float) -> None:
    w = scaled_weight()
    record, tensors = codec.encode(w)
    s = tensors["input_scale"].clone()
    s[5] = bad
    tensors["input_scale"] = s
    record["parts"]["input_scale"] = codec.part_record(s, True)
    with pytest.raises(CheckpointError, match="input_scale must be finite and positive"):
        codec.decode(record, tensors, name="w")
    tensors["input_scale"] = torch.ones(10)
    record["parts"]["input_scale"] = codec.part_record(tensors["input_scale"], True)
    with pytest.raises(CheckpointError, match="input_scale"):
        codec.decode(record, tensors, name="w")


# -- calibrate with AWQ ----------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def test_calibrate_awq_on_a_tiny_llama(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # one salient hidden feature, as trained models have
        model.model.embed_tokens.weight[:, 3] *= 25
    before = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 96, (1, 32), generator=gen) for _ in range(3)]
    result = torchq.calibrate(model, data, torchq.int4_weight_only(group_size=32), algorithm="awq", progress=False)
    assert len(result.layers) == 15 and all(r.alpha is not None for r in result.layers)
    assert all(r.error <= r.rtn_error for r in result.layers)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.config.algorithm == "awq" and q.input_scale is not None
    rtn = copy.deepcopy(before)
    torchq.quantize_(rtn, torchq.int4_weight_only(group_size=32))
    x = torch.cat(data)
    with torch.no_grad():
        ref = before(x).logits
        assert (model(x).logits - ref).pow(2).mean() < (rtn(x).logits - ref).pow(2).mean()
    torchq.save_quantized(model, tmp_path / "awq")
    fresh = transformers.LlamaForCausalLM(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torchq.load_quantized(fresh, tmp_path / "awq")
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, model(x).logits)
    report = str(torchq.explain(model, x))
    assert "algorithm='awq'" in report and "input scale" in report
