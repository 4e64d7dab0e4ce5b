"""quantize_ on tiny transformers models built from a config: tied embeddings (Llama), GPT-2's
Conv1D layers, checkpoints, and what ``save_pretrained`` does with torchq weights."""

import warnings

import pytest
import torch

import torchq
from torchq import AffineQuantizedTensor as AQT

transformers = pytest.importorskip("transformers")


def sqnr(ref, y):
    return float(20 * torch.log10(ref.norm() / (ref - y).norm()))


def llama(seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def gpt2(seed=0):
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg).eval()


def bert(seed=0):
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.BertModel(cfg).eval()


IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits(m):
    return m(IDS).logits


@pytest.mark.parametrize("strict", [True, False])
def test_llama_tied_embeddings_stay_tied_and_round_trip(tmp_path, strict):
    m = llama()
    assert m.lm_head.weight is m.model.embed_tokens.weight
    ref = logits(m)
    with pytest.warns(torchq.TiedWeightWarning, match=r"'model\.embed_tokens\.weight'"):
        torchq.quantize_(m, torchq.int8_weight_only())
    assert isinstance(m.lm_head.weight, AQT) and m.lm_head.weight is m.model.embed_tokens.weight
    y = logits(m)
    assert sqnr(ref, y) > 30
    torchq.save_quantized(m, tmp_path)
    fresh = llama(seed=1)
    torchq.load_quantized(fresh, tmp_path, strict=strict)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight and torch.equal(logits(fresh), y)
    torch.save(m.state_dict(), tmp_path / "sd.pt")
    fresh = llama(seed=1)
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True), assign=True, strict=strict)
    assert torch.equal(logits(fresh), y)


@pytest.mark.parametrize("cfg,min_sqnr", [(torchq.int8_weight_only(), 30), (torchq.int4_weight_only(group_size=32), 12)],
                         ids=["int8", "int4"])
def test_gpt2_conv1d_layers_are_quantized_and_run_the_quantized_kernel(tmp_path, cfg, min_sqnr):
    m = gpt2()
    ref = logits(m)
    with pytest.warns(torchq.TiedWeightWarning, match=r"'transformer\.wte\.weight'"):
        torchq.quantize_(m, cfg)
    convs = {n: mod for n, mod in m.named_modules() if type(mod).__name__ == "Conv1D"}
    assert len(convs) == 8
    for name, mod in convs.items():
        w = mod.weight
        assert isinstance(w, AQT) and w.transposed and tuple(w.shape) == (mod.nx, mod.nf) and w.label == name
    with torchq.strict():  # Conv1D's addmm reaches the quantized kernel: no dequantize fallback
        y = logits(m)
    assert sqnr(ref, y) > min_sqnr
    torchq.save_quantized(m, tmp_path)
    fresh = gpt2(seed=1)
    torchq.load_quantized(fresh, tmp_path)
    assert fresh.transformer.h[0].attn.c_attn.weight.transposed and torch.equal(logits(fresh), y)


@pytest.mark.slow
def test_gpt2_quantized_compiles():
    m = gpt2()
    with pytest.warns(torchq.TiedWeightWarning):
        torchq.quantize_(m, torchq.int8_weight_only())
    eager = logits(m)
    torch._dynamo.reset()
    with torch.no_grad():
        y = torch.compile(m)(IDS).logits
    assert torch.allclose(y, eager, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("build", [llama, bert], ids=["llama", "bert"])
def test_save_pretrained_with_torchq_weights_raises_a_clear_error(tmp_path, build):
    m = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.TiedWeightWarning)
        torchq.quantize_(m, torchq.int8_weight_only())
    with warnings.catch_warnings(record=True) as seen, pytest.raises(TypeError, match=r"quantized weight.*torchq\.save_quantized"):
        warnings.simplefilter("always")
        m.save_pretrained(tmp_path)
    assert not [w for w in seen if "TypedStorage" in str(w.message)]
    assert not list(tmp_path.glob("*.safetensors"))  # no half-written weights file


def test_documented_way_to_save_a_quantized_transformers_model(tmp_path):
    m = llama()
    with pytest.warns(torchq.TiedWeightWarning):
        torchq.quantize_(m, torchq.int4_weight_only(group_size=32))
    m.config.save_pretrained(tmp_path)
    torchq.save_quantized(m, tmp_path)
    fresh = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path)).eval()
    torchq.load_quantized(fresh, tmp_path)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight and torch.equal(logits(fresh), logits(m))
