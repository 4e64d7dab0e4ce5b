"""Quantization-aware training (issue 38 part 1): ``torchq.qat.prepare`` / ``convert``.

The prepared model computes with the converted model's quantized weights and kernels, so their
outputs are equal bit for bit; the backward is straight-through; learned scales get LSQ's gradient."""

from __future__ import annotations

import io
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import torchq
import torchq.qat as qat
from torchq import AffineQuantizedTensor as AQT
from torchq.configs import Int4WeightOnlyConfig, IntxWeightOnlyConfig, NF4WeightOnlyConfig
from torchq.primitives import MappingType, ZeroPointDomain
from torchq.quantize import QuantizationError, SkippedLayerWarning

CONFIGS = {
    "int4-g32": torchq.int4_weight_only(32),
    "int4-g64-int": Int4WeightOnlyConfig(group_size=64, zero_point_domain=ZeroPointDomain.INT),
    "int4-g128-none": Int4WeightOnlyConfig(group_size=128, zero_point_domain=ZeroPointDomain.NONE),
    "int4-g32-fp32": Int4WeightOnlyConfig(group_size=32, scale_dtype=torch.float32),
    "int4-g32-hqq": torchq.config_from_name("int4-g32-hqq"),
    "intx2-g32": torchq.intx_weight_only(2, 32),
    "intx3-g32": torchq.intx_weight_only(3, 32),
    "intx6-sym-g64": IntxWeightOnlyConfig(bits=6, group_size=64, mapping_type=MappingType.SYMMETRIC),
    "intx8-channel": torchq.intx_weight_only(8, None),
    "nf4": torchq.nf4_weight_only(),
    "nf4-b32-single": NF4WeightOnlyConfig(block_size=32, double_quant=False),
    "fp4": torchq.fp4_weight_only(),
    "int8wo": torchq.int8_weight_only(),
    "int8dq": torchq.int8_dynamic_activation_int8_weight(),
    "int8dq-r7": torchq.config_from_name("int8dq-r7"),
    "int4a8": torchq.config_from_name("int4a8"),
    "nf4a8": torchq.config_from_name("nf4a8"),
    "llm_int8": torchq.llm_int8(),
    "fp8wo": torchq.float8_weight_only(),
    "fp8dq-row": torchq.config_from_name("fp8dq-row"),
    "fp8dq-tensor": torchq.config_from_name("fp8dq-tensor"),
}
WEIGHT_ONLY = [k for k in CONFIGS if "dq" not in k and "a8" not in k and k != "llm_int8"]
LEARNABLE = ["int4-g32", "int4-g64-int", "int4-g128-none", "intx3-g32", "intx6-sym-g64", "nf4-b32-single"]


class Net(nn.Module):
    """Two linears (one without bias) around a GELU, on [batch, seq, 128] inputs."""

    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        self.up = nn.Linear(128, 256, dtype=dtype)
        self.down = nn.Linear(256, 128, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(nn.functional.gelu(self.up(x)))


def net(seed=0, dtype=torch.float32) -> Net:
    torch.manual_seed(seed)
    return Net(dtype)


def inputs(seed=1, dtype=torch.float32, shape=(3, 5, 128)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def quiet():
    w = warnings.catch_warnings()
    w.__enter__()
    warnings.simplefilter("ignore")
    return w


def train_steps(m, steps=2, dtype=torch.float32, lr=1e-2, device="cpu"):
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    for i in range(steps):
        loss = m(inputs(10 + i, dtype).to(device)).float().square().mean()
        loss.backward()
        assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in m.parameters())
        opt.step()
        opt.zero_grad()


# -- outputs: prepared == converted --------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_converted_outputs_equal_the_prepared_model_bit_for_bit(name):
    w = quiet()
    try:
        m = qat.prepare(net(), CONFIGS[name])
        assert isinstance(m.up, qat.QATLinear) and isinstance(m.up, nn.Linear)
        train_steps(m)  # the weights move: the codes are recomputed from them
        x = inputs()
        m.eval()
        with torch.no_grad():
            prepared = m(x)
        with_grad = m(x).detach()  # the same arithmetic with autograd recording
        qat.convert(m)
        assert type(m.up) is nn.Linear and isinstance(m.up.weight, AQT) and isinstance(m.down.weight, AQT)
        assert m.up.weight.config == CONFIGS[name]
        with torch.no_grad():
            converted = m(x)
    finally:
        w.__exit__(None, None, None)
    assert torch.equal(prepared, converted), (prepared - converted).abs().max()
    assert torch.equal(with_grad, converted)


@pytest.mark.parametrize("name", ["int4-g32", "nf4", "int8wo", "int8dq", "intx3-g32"])
def test_bf16_model_converted_outputs_equal(name):
    w = quiet()
    try:
        m = qat.prepare(net(dtype=torch.bfloat16), CONFIGS[name])
        train_steps(m, dtype=torch.bfloat16)
        x = inputs(dtype=torch.bfloat16)
        with torch.no_grad():
            prepared = m(x)
            qat.convert(m)
            converted = m(x)
    finally:
        w.__exit__(None, None, None)
    assert prepared.dtype == torch.bfloat16 and torch.equal(prepared, converted)


@settings(max_examples=12, deadline=None)
@given(bits=st.integers(2, 8), group=st.sampled_from([16, 32, 64]), groups=st.integers(1, 4), n=st.integers(1, 40),
       sym=st.booleans(), rows=st.integers(1, 9), scale=st.sampled_from([1e-6, 1.0, 1e4]))
def test_intx_shapes_and_magnitudes_convert_bit_for_bit(bits, group, groups, n, sym, rows, scale):
    mt = MappingType.SYMMETRIC if sym and bits > 1 else MappingType.ASYMMETRIC
    cfg = IntxWeightOnlyConfig(bits=bits, group_size=group, mapping_type=mt)
    torch.manual_seed(bits * 1000 + n)
    m = nn.Linear(group * groups, n)
    with torch.no_grad():
        m.weight.mul_(scale)
        m.weight[0].zero_()  # a constant (all-zero) row
    qat.prepare(m, cfg)
    x = torch.randn(rows, group * groups)
    with torch.no_grad():
        prepared = m(x)
        qat.convert(m)
        assert torch.equal(prepared, m(x))


# -- the backward ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["int4-g32", "int8dq", "fp8wo", "nf4"])
def test_backward_is_straight_through(name):
    w = quiet()
    try:
        m = qat.prepare(net(), CONFIGS[name])
        x = inputs().requires_grad_(True)
        h = m.up(x)
        g = torch.randn_like(h)
        h.backward(g)
        wq = m.up.__dict__["_torchq_qat"].last.dequantize(torch.float32)
    finally:
        w.__exit__(None, None, None)
    g2, x2 = g.reshape(-1, 256), x.detach().reshape(-1, 128)
    torch.testing.assert_close(x.grad, (g2 @ wq).reshape(x.shape), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.up.weight.grad, g2.t() @ x2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.up.bias.grad, g2.sum(0), rtol=1e-5, atol=1e-5)
    assert m.down.weight.grad is None  # only what the output depends on


def test_frozen_weight_gets_no_gradient_and_input_still_does():
    m = qat.prepare(net(), CONFIGS["int4-g32"])
    m.up.weight.requires_grad_(False)
    x = inputs().requires_grad_(True)
    m(x).sum().backward()
    assert m.up.weight.grad is None and x.grad is not None and m.up.bias.grad is not None


@pytest.mark.parametrize("scales", ["recompute", "learned"])
def test_training_through_the_quantizer_lowers_the_quantized_error(scales):
    """A student trained through 3-bit g32 against its float teacher's outputs ends closer to them,
    once converted, on held-out inputs than round to nearest of the same weights does."""
    teacher = net()
    data = [inputs(100 + i, shape=(64, 128)) for i in range(8)]
    with torch.no_grad():
        targets = [teacher(x) for x in data]
    rtn = net()
    torchq.quantize_(rtn, CONFIGS["intx3-g32"])
    student = qat.prepare(net(), CONFIGS["intx3-g32"], scales=scales)
    opt = torch.optim.Adam(student.parameters(), lr=1e-5)
    for _ in range(40):
        for x, t in zip(data, targets):
            loss = (student(x) - t).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    qat.convert(student)
    x = inputs(999, shape=(256, 128))
    with torch.no_grad():
        t = teacher(x)
        err_rtn = float((rtn(x) - t).square().mean())
        err_qat = float((student(x) - t).square().mean())
    assert err_qat < 0.75 * err_rtn, (err_qat, err_rtn)  # measured: 0.67x (recompute), 0.65x (learned)


# -- learned scales --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", LEARNABLE)
def test_learned_scales_train_and_convert_bit_for_bit(name):
    m = qat.prepare(net(), CONFIGS[name], scales="learned")
    keys = set(m.state_dict())
    assert {"up.weight_qat_scale", "down.weight_qat_scale"} <= keys
    before = m.up.weight_qat_scale.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    for i in range(3):
        m(inputs(20 + i)).square().mean().backward()
        assert m.up.weight_qat_scale.grad is not None and bool(m.up.weight_qat_scale.grad.abs().sum() > 0)
        opt.step()
        opt.zero_grad()
    assert not torch.equal(before, m.up.weight_qat_scale.detach())
    x = inputs()
    with torch.no_grad():
        prepared = m(x)
        qat.convert(m)
        converted = m(x)
    assert torch.equal(prepared, converted)
    assert set(m.state_dict()) == {"up.weight", "up.bias", "down.weight"}
    plain = m.up.weight.to_plain()  # the trained scales are the ones stored
    assert torch.equal(plain.scale.float(), before.new_tensor(plain.scale.float()))


def test_learned_scale_gradient_is_lsq():
    """Symmetric int4 groups: d w_hat / d s = round(w/s) - w/s inside the range, the clipped code
    outside; d w_hat / d w = 1 inside, 0 outside."""
    cfg = Int4WeightOnlyConfig(group_size=32, zero_point_domain=ZeroPointDomain.NONE, scale_dtype=torch.float32)
    m = nn.Linear(32, 1, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.linspace(-1, 1, 32))
    qat.prepare(m, cfg, scales="learned")
    with torch.no_grad():
        m.weight_qat_scale.fill_(0.1)  # clips |w| > 0.75
    x = torch.eye(32)
    m(x).sum().backward()  # d/dw_hat of sum(W_hat x) over the identity: ones
    w, s = m.weight.detach()[0], 0.1
    v = w / s
    inside = (torch.round(v) >= -8) & (torch.round(v) <= 7)
    expect_s = torch.where(inside, torch.round(v) - v, torch.round(v).clamp(-8, 7)).sum()
    torch.testing.assert_close(m.weight_qat_scale.grad[0, 0], expect_s, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m.weight.grad[0], inside.float())


# -- refusals and atomicity ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["int4-g128-gptq", "nf4-awq"])
def test_calibrated_algorithms_are_refused_by_name(name):
    m = net()
    with pytest.raises(ValueError, match="algorithm=.*cannot be trained through"):
        qat.prepare(m, torchq.config_from_name(name))
    assert type(m.up) is nn.Linear


@pytest.mark.parametrize("name", ["int8wo", "fp8dq-row", "nf4", "int4a8"])
def test_learned_scales_refused_for_formats_without_them(name):
    m = net()
    with pytest.raises(ValueError, match="scales='learned'.*cannot learn its scales"):
        qat.prepare(m, CONFIGS[name], scales="learned")
    assert type(m.up) is nn.Linear and "up.weight_qat_scale" not in m.state_dict()


def test_bad_arguments_get_clear_errors():
    with pytest.raises(ValueError, match="scales: expected one of"):
        qat.prepare(net(), CONFIGS["int4-g32"], scales="lsq")
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        qat.prepare("model", CONFIGS["int4-g32"])
    with pytest.raises(ValueError, match="no layer is prepared"):
        qat.convert(net())
    m = qat.prepare(net(), CONFIGS["int4-g32"])
    with pytest.raises(ValueError, match="'up' is already prepared"):
        qat.prepare(m, CONFIGS["int8wo"])


def test_a_linear_with_its_own_forward_is_refused():
    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    m = nn.Sequential(nn.Linear(64, 64), Scaled(64, 64))
    with pytest.raises(QuantizationError, match="'1'.*overrides nn.Linear.forward.*nothing was changed"):
        qat.prepare(m, CONFIGS["int4-g32"])
    assert type(m[0]) is nn.Linear


def test_a_failing_layer_leaves_the_model_unchanged():
    m = net()
    with torch.no_grad():
        m.down.weight[3, 7] = float("nan")  # NF4 refuses NaN weights
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(QuantizationError, match="layer 'down'.*nothing was changed"):
        qat.prepare(m, CONFIGS["nf4"])
    assert type(m.up) is nn.Linear and type(m.down) is nn.Linear
    after = m.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], v, ) or k == "down.weight" for k, v in before.items())
    assert torch.equal(after["down.weight"].nan_to_num(), before["down.weight"].nan_to_num())


def test_a_layer_that_cannot_take_the_config_is_skipped_by_name():
    m = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32))  # 48 inputs: no whole NF4 block of 64
    with pytest.warns(SkippedLayerWarning, match="skipped layer '1'.*not a multiple of block_size 64"):
        qat.prepare(m, torchq.nf4_weight_only(block_size=64))
    assert isinstance(m[0], qat.QATLinear) and type(m[1]) is nn.Linear
    qat.convert(m)
    assert isinstance(m[0].weight, AQT) and not isinstance(m[1].weight, AQT)


def test_mapping_configs_and_filters_select_layers():
    m = qat.prepare(net(), {"up": CONFIGS["int8wo"], "_default": None})
    assert isinstance(m.up, qat.QATLinear) and type(m.down) is nn.Linear
    assert qat.prepared_layers(m) == {"up": CONFIGS["int8wo"]}
    m2 = qat.prepare(net(), CONFIGS["int8wo"], filter_fn=lambda mod, name: name == "down")
    assert type(m2.up) is nn.Linear and isinstance(m2.down, qat.QATLinear)


# -- the model stays an ordinary float model -------------------------------------------------------
def test_state_dict_is_the_float_models_and_loads_both_ways():
    ref = net()
    m = qat.prepare(net(), CONFIGS["int4-g32"])
    train_steps(m)
    sd = m.state_dict()
    assert list(sd) == list(ref.state_dict()) and all(type(v) is torch.Tensor for v in sd.values())
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    ref.load_state_dict(loaded)  # into a float model
    again = qat.prepare(net(seed=5), CONFIGS["int4-g32"])
    again.load_state_dict(loaded)  # into a prepared one: the cached codes follow the new weights
    x = inputs()
    with torch.no_grad():
        assert torch.equal(again(x), m(x))
    torchq.quantize_(ref, CONFIGS["int4-g32"])  # recomputed scales: quantize_ of the trained weights is convert
    with torch.no_grad():
        assert torch.equal(ref(x), m(x))


def test_unprepare_restores_float_layers():
    m = qat.prepare(net(), CONFIGS["int4-g32"], scales="learned")
    qat.unprepare(m)
    assert type(m.up) is nn.Linear and set(m.state_dict()) == {"up.weight", "up.bias", "down.weight"}
    with torch.no_grad():
        torch.testing.assert_close(m(inputs()), net()(inputs()))


def test_every_forward_sees_the_current_weights():
    """No stale codes: writes through ``.data`` (which do not bump the version counter) count."""
    m = qat.prepare(net(), CONFIGS["int4-g32"])
    x = inputs()
    with torch.no_grad():
        m(x)
        m.up.weight.data.mul_(1.5)
        m.down.weight.data = m.down.weight.data.flip(0)
        prepared = m(x)
    ref = net()
    ref.load_state_dict(m.state_dict())
    torchq.quantize_(ref, CONFIGS["int4-g32"])
    with torch.no_grad():
        assert torch.equal(prepared, ref(x))


def test_deepcopy_and_device_moves_keep_the_qat_layers():
    import copy

    m = qat.prepare(net(), CONFIGS["int4-g32"])
    c = copy.deepcopy(m).to(torch.float32)
    x = inputs()
    with torch.no_grad():
        assert torch.equal(c(x), m(x))
    qat.convert(c)
    assert isinstance(c.up.weight, AQT) and isinstance(m.up, qat.QATLinear)


# -- tied embeddings, transformers, PEFT, compile, FSDP2 ------------------------------------------
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(96, 64, padding_idx=0)
        self.mix = nn.Linear(64, 64)
        self.head = nn.Linear(64, 96, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def test_tied_embedding_reads_the_quantized_rows_and_trains():
    torch.manual_seed(0)
    m = qat.prepare(TinyLM(), CONFIGS["int4-g32"])
    assert isinstance(m.embed, qat.QATEmbedding) and m.embed.weight is m.head.weight
    ids = torch.randint(0, 96, (4, 9))
    ids[0, :3] = 0  # the padding row
    m(ids).logsumexp(-1).mean().backward()
    # straight through: the gradients of a float model holding the quantized values
    ref = TinyLM()
    with torch.no_grad():
        ref.embed.weight.copy_(m.embed.__dict__["_torchq_qat"].last.dequantize())
        ref.mix.weight.copy_(m.mix.__dict__["_torchq_qat"].last.dequantize())
        ref.mix.bias.copy_(m.mix.bias)
    ref(ids).logsumexp(-1).mean().backward()
    torch.testing.assert_close(m.embed.weight.grad, ref.embed.weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(m.mix.weight.grad, ref.mix.weight.grad, rtol=1e-4, atol=1e-6)
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    with torch.no_grad():
        prepared = m(ids)
        with pytest.warns(torchq.TiedWeightWarning):
            qat.convert(m)
        assert type(m.embed) is nn.Embedding and isinstance(m.embed.weight, AQT) and m.embed.weight is m.head.weight
        assert torch.equal(prepared, m(ids))


def test_weight_tied_to_another_kind_of_module_is_refused():
    m = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    m[1].weight = m[0].weight
    with pytest.raises(QuantizationError, match="weight of '0' is also '1.weight' \\(Linear\\).*nn.Embedding only"):
        qat.prepare(m, CONFIGS["int4-g32"])
    assert type(m[0]) is nn.Linear


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_transformers_llama_and_gpt2_conv1d_train_and_convert():
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32))
    for m in (_tiny_llama(), gpt2.eval()):
        qat.prepare(m, CONFIGS["int4-g32"], filter_fn=lambda mod, name: "lm_head" not in name and torchq.quantize.default_filter(mod, name))
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        m.train()
        m(ids, labels=ids).loss.backward()
        opt.step()
        m.eval()
        with torch.no_grad():
            prepared = m(ids).logits
            qat.convert(m)
            assert torch.equal(prepared, m(ids).logits)
    assert gpt2.transformer.h[0].attn.c_attn.weight.transposed


def test_peft_lora_on_a_qat_base():
    peft = pytest.importorskip("peft")
    m = _tiny_llama()
    qat.prepare(m, CONFIGS["nf4"], filter_fn=lambda mod, name: "lm_head" not in name and torchq.quantize.default_filter(mod, name))
    pm = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    pm.train()
    losses = []
    for _ in range(5):
        loss = pm(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    pm.eval()
    with torch.no_grad():
        prepared = pm(ids).logits
        qat.convert(pm)
        assert isinstance(pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight, AQT)
        assert type(pm.base_model.model.model.layers[0].self_attn.q_proj.lora_A.default) is nn.Linear
        assert torch.equal(prepared, pm(ids).logits)


@pytest.mark.parametrize("scales", ["recompute", "learned"])
def test_torch_compile_matches_eager(scales):
    m = qat.prepare(net(), CONFIGS["int4-g32"], scales=scales)
    x = inputs().requires_grad_(True)
    y = m(x)
    y.square().sum().backward()
    eager = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad = None
    torch._dynamo.reset()
    yc = torch.compile(m)(x)
    yc.square().sum().backward()
    torch.testing.assert_close(y, yc)  # inductor's own GELU: close, not equal
    for a, b in zip(eager, [p.grad for p in m.parameters()] + [x.grad]):
        torch.testing.assert_close(a, b)



# -- CUDA (run by benchmarks/gpu_suite.sh where a GPU is lent; skipped elsewhere) -----------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA_CONFIGS = ["int4-g32", "int4-g128-none", "nf4", "int8wo", "int8dq", "int4a8", "intx3-g32", "fp8wo", "fp8dq-row"]


@needs_cuda
@pytest.mark.parametrize("name", CUDA_CONFIGS)
@pytest.mark.parametrize("scales", ["recompute", "learned"])
def test_cuda_bf16_training_converts_bit_for_bit(name, scales):
    """On a GPU, a bf16 model prepared on the device trains (finite gradients that move the weights)
    and converts to the layout and kernels CUDA gives ``quantize_``, computing the prepared model's
    outputs bit for bit; the converted codes are those the CPU computes from the same weights."""
    if name.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 kernels need compute capability 8.9")
    if scales == "learned" and name not in LEARNABLE:
        pytest.skip(f"{name} has no learnable scales")
    w = quiet()
    try:
        m = qat.prepare(net(dtype=torch.bfloat16).cuda(), CONFIGS[name], scales=scales)
        before = m.up.weight.detach().clone()
        train_steps(m, dtype=torch.bfloat16, device="cuda")
        assert not torch.equal(before, m.up.weight.detach())
        x = inputs(dtype=torch.bfloat16).cuda()
        cpu = None
        if scales == "recompute":  # the same float weights quantized on the CPU
            cpu = net(dtype=torch.bfloat16)
            cpu.load_state_dict({k: v.cpu() for k, v in m.state_dict().items()})
            torchq.quantize_(cpu, CONFIGS[name])
        with torch.no_grad():
            prepared = m(x)
            qat.convert(m)
            converted = m(x)
    finally:
        w.__exit__(None, None, None)
    assert isinstance(m.up.weight, AQT) and m.up.weight.device.type == "cuda"
    assert prepared.dtype == torch.bfloat16 and torch.equal(prepared, converted)
    if cpu is not None:
        for layer in ("up", "down"):
            ours, theirs = getattr(m, layer).weight.to_plain(), getattr(cpu, layer).weight.to_plain()
            assert torch.equal(ours.codes.cpu(), theirs.codes), layer
            assert torch.equal(ours.scale.cpu(), theirs.scale), layer
            assert (ours.zero_point is None) == (theirs.zero_point is None), layer
            assert ours.zero_point is None or torch.equal(ours.zero_point.cpu(), theirs.zero_point), layer

@pytest.mark.slow
def test_fsdp2_qat_matches_one_process(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    import distributed_workers as dw

    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    configs = ["int4-g32", "int8dq"]
    results = dw.spawn("fsdp_qat", 2, tmp_path, configs)
    for rank_out in results:
        for name in configs:
            r = rank_out[name]
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), rtol=1e-5, atol=1e-6)
            for k, v in r["ref_weights"].items():
                torch.testing.assert_close(r["weights"][k], v, rtol=1e-5, atol=1e-6)
            assert torch.equal(r["prepared"], r["converted"])


# -- tuning the float parameters of a quantized model ----------------------------------------------
class NormNet(nn.Module):
    """Linear (bias) -> LayerNorm -> GELU -> Linear (no bias) -> a model's own RMSNorm class."""

    class OwnRMSNorm(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.weight

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(128, 256)
        self.norm = nn.LayerNorm(256)
        self.down = nn.Linear(256, 128, bias=False)
        self.out_norm = NormNet.OwnRMSNorm(128)

    def forward(self, x):
        return self.out_norm(self.down(nn.functional.gelu(self.norm(self.up(x)))))


def norm_net(seed=0) -> NormNet:
    torch.manual_seed(seed)
    m = NormNet()
    with torch.no_grad():  # not the identity, so that the tuned values start somewhere
        m.norm.weight.uniform_(0.5, 1.5)
        m.norm.bias.uniform_(-0.1, 0.1)
        m.out_norm.weight.uniform_(0.5, 1.5)
    return m


def test_float_tuning_selects_norms_and_biases_and_freezes_the_rest():
    m = norm_net()
    torchq.quantize_(m, CONFIGS["int4-g32"])
    names = lambda ps: sorted(n for n, p in m.named_parameters() if any(p is q for q in ps))  # noqa: E731
    both = qat.prepare_float_tuning(m)
    assert names(both) == ["norm.bias", "norm.weight", "out_norm.weight", "up.bias"]
    assert [n for n, p in m.named_parameters() if p.requires_grad] == ["up.bias", "norm.weight", "norm.bias", "out_norm.weight"]
    assert names(qat.prepare_float_tuning(m, ["norms"])) == ["norm.bias", "norm.weight", "out_norm.weight"]
    assert not m.up.bias.requires_grad
    assert names(qat.prepare_float_tuning(m, "biases")) == ["up.bias"]
    assert [n for n, p in m.named_parameters() if p.requires_grad] == ["up.bias"]


def test_float_tuning_trains_through_the_quantized_layers_and_keeps_their_codes():
    """A 3-bit model's norms and biases, distilled from its float teacher, bring the outputs on
    held-out inputs closer to the teacher's; the quantized weights stay bit for bit."""
    teacher = norm_net()
    student = norm_net()
    torchq.quantize_(student, CONFIGS["intx3-g32"])
    before = {n: m.weight.dequantize().clone() for n, m in student.named_modules() if isinstance(getattr(m, "weight", None), AQT)}
    assert sorted(before) == ["down", "up"]
    x = inputs(999, shape=(256, 128))
    with torch.no_grad():
        err_before = float((student(x) - teacher(x)).square().mean())
    params = qat.prepare_float_tuning(student)
    opt = torch.optim.Adam(params, lr=1e-2)
    data = [inputs(100 + i, shape=(64, 128)) for i in range(8)]
    for _ in range(20):
        for d in data:
            with torch.no_grad():
                t = teacher(d)
            loss = (student(d) - t).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        err_after = float((student(x) - teacher(x)).square().mean())
    assert err_after < 0.95 * err_before, (err_after, err_before)  # measured: 0.913x (untrained: 1x)
    for n, m in student.named_modules():
        if n in before:
            assert isinstance(m.weight, AQT) and not m.weight.requires_grad
            assert torch.equal(m.weight.dequantize(), before[n])


def test_float_tuning_bad_arguments_change_nothing():
    m = norm_net()
    torchq.quantize_(m, CONFIGS["int8wo"])
    flags = [p.requires_grad for p in m.parameters()]
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got dict"):
        qat.prepare_float_tuning({})
    with pytest.raises(ValueError, match=r"kinds: expected some of \['norms', 'biases'\], got \['norm'\]"):
        qat.prepare_float_tuning(m, ["norm"])
    with pytest.raises(ValueError, match=r"kinds: expected some of .*got \[\]"):
        qat.prepare_float_tuning(m, [])
    bare = nn.Sequential(nn.Linear(64, 64, bias=False))
    torchq.quantize_(bare, CONFIGS["int8wo"])
    with pytest.raises(ValueError, match="model: no parameter of kinds"):
        qat.prepare_float_tuning(bare)
    assert [p.requires_grad for p in m.parameters()] == flags


def test_float_tuning_of_a_transformers_llama_trains_its_rmsnorms():
    m = _tiny_llama()
    torchq.quantize_(m, {"lm_head": None, "_default": CONFIGS["int4-g32"]})
    params = qat.prepare_float_tuning(m)
    expected = sorted(n for n, _ in m.named_parameters() if "norm" in n)  # 2 layers x 2 + the final norm
    assert len(expected) == 5
    assert sorted(n for n, p in m.named_parameters() if p.requires_grad) == expected
    assert len(params) == 5 and not m.lm_head.weight.requires_grad
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m(ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    assert all(p.grad is None for n, p in m.named_parameters() if n not in expected)
