"""PEFT on torchq models loaded through transformers (issue 18 part 2): LoRA / QLoRA training on
NF4 and int4 bases, adapter save / load, merge_and_unload (requantized or float), unload."""

import warnings

import pytest
import torch

import torchq
from torchq import AffineQuantizedTensor as AQT

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
import torchq.hf  # noqa: E402

IDS = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(0))
TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    f = tmp_path_factory.mktemp("llama-float")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(f)
    return f


def base(folder, name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.TiedWeightWarning)
        return transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=torchq.hf.TorchqConfig(name)).eval()


@torch.no_grad()
def logits(m):
    return m(IDS).logits


def trained(folder, name, steps=12):
    m = base(folder, name)
    frozen = {n: p for n, p in m.named_parameters()}
    pm = peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    pm.train()
    for _ in range(steps):
        loss = pm(IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    pm.eval()
    return pm, losses, frozen


@pytest.mark.parametrize("name", ["nf4", "int4-g32", "int8wo"])
def test_qlora_trains_saves_and_loads_adapters(tmp_path, folder, name):
    pm, losses, frozen = trained(folder, name)
    assert losses[-1] < losses[0] - 0.05, losses
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.get_base_layer().weight, AQT)
    assert layer.get_base_layer().weight is frozen["model.layers.0.self_attn.q_proj.weight"]  # untouched
    pm.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    loaded = peft.PeftModel.from_pretrained(base(folder, name), tmp_path).eval()
    assert torch.equal(logits(loaded), logits(pm))


def test_peft_merge_into_a_quantized_base_is_a_clear_error_and_changes_nothing(folder):
    pm, _, _ = trained(folder, "int4-g32", steps=2)
    before = logits(pm)
    with pytest.raises(NotImplementedError, match=r"immutable.*torchq\.hf\.merge_and_unload"):
        pm.merge_and_unload()
    assert torch.equal(logits(pm), before)


@pytest.mark.parametrize("name", ["nf4", "int4-g32"])
def test_merge_and_unload_requantizes_with_the_weights_own_config(tmp_path, folder, name):
    pm, _, _ = trained(folder, name)
    ref = logits(pm)
    layer = pm.base_model.model.model.layers[1].mlp.up_proj
    w = layer.get_base_layer().weight
    expected = w.config.quantize_weight(w.dequantize(torch.float32) + layer.get_delta_weight("default").float(), label=w.label)
    merged = torchq.hf.merge_and_unload(pm)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    up = merged.model.layers[1].mlp.up_proj
    assert type(up) is torch.nn.Linear and isinstance(up.weight, AQT) and up.weight.config == w.config
    assert torch.equal(up.weight.dequantize(), expected.dequantize())
    y = logits(merged)
    sqnr = 20 * torch.log10(ref.norm() / (ref - y).norm())
    assert sqnr > 15, float(sqnr)
    merged.save_pretrained(tmp_path)  # still a torchq model: saves and reloads quantized
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(logits(again), y)


def test_merge_and_unload_into_float(folder):
    pm, _, _ = trained(folder, "int4-g32")
    ref = logits(pm)
    merged = torchq.hf.merge_and_unload(pm, requantize=False)
    merged_layers = [merged.model.layers[i].get_submodule(p) for i in range(2)
                     for p in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj")]
    assert all(not isinstance(m.weight, AQT) for m in merged_layers)
    assert isinstance(merged.model.layers[0].self_attn.k_proj.weight, AQT)  # no adapter: stays quantized
    torch.testing.assert_close(logits(merged), ref, atol=1e-4, rtol=1e-4)


def test_unload_gives_back_the_quantized_base(folder):
    m = base(folder, "nf4")
    ref = logits(m)
    weights = {n: p for n, p in m.named_parameters()}
    plain = base(folder, "nf4")
    pm2 = peft.get_peft_model(plain, peft.LoraConfig(r=4, target_modules=TARGETS))
    out = pm2.unload()
    assert torch.equal(logits(out), ref)
    assert all(isinstance(p, AQT) == isinstance(weights[n], AQT) for n, p in out.named_parameters())


def test_merge_and_unload_refuses_what_it_cannot_merge(folder):
    with pytest.raises(TypeError, match="PEFT model"):
        torchq.hf.merge_and_unload(base(folder, "nf4"))
    # DoRA: PEFT dequantizes only the formats it knows before adding to the weight; torchq refuses
    # arithmetic on a quantized weight rather than silently dequantizing it on every step
    with pytest.raises(NotImplementedError, match=r"aten\.add\.Tensor.*dequantize"):
        peft.get_peft_model(base(folder, "int4-g32"), peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True))
    m = base(folder, "int4-g32")
    pm = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=TARGETS, lora_bias=True))
    with pytest.raises(NotImplementedError, match="lora_bias"):
        torchq.hf.merge_and_unload(pm)
