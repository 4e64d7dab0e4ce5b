"""``torchq.calibrate(weights=...)``: a meta-device model calibrated block by block from a float
checkpoint, never holding the whole float model; same codes as calibrating the model in memory."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import torchq

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, tie_word_embeddings=True)


def llama(meta: bool = False) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CFG)
    if meta:
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(cfg).eval()
    return transformers.LlamaForCausalLM(cfg).eval()


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 96, (2, 24), generator=g) for _ in range(3)]


def calibrate(model: nn.Module, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.TiedWeightWarning)
        return torchq.calibrate(model, batches(), torchq.int4_weight_only(group_size=32), algorithm="gptq", progress=False, **kw)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("float") / "llama"
    llama().save_pretrained(path)  # model.safetensors, the tied head stored once
    return path


def float_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


def test_streamed_calibration_gives_the_codes_of_calibration_in_memory(checkpoint) -> None:
    in_memory = llama()
    whole = float_bytes(in_memory)
    calibrate(in_memory)
    streamed = llama(meta=True)
    result = calibrate(streamed, weights=checkpoint)
    ref = dict(in_memory.named_modules())
    for name, mod in streamed.named_modules():
        if isinstance(mod, nn.Linear):
            assert isinstance(mod.weight, torchq.AffineQuantizedTensor), name
            assert mod.weight.to_plain().equal(ref[name].weight.to_plain()), name
    assert streamed.model.embed_tokens.weight is streamed.lm_head.weight  # the tie survives streaming
    assert not [n for n, t in [*streamed.named_parameters(), *streamed.named_buffers()] if t.device.type == "meta"]
    x = batches()[0]
    with torch.no_grad():
        assert torch.equal(streamed(x).logits, in_memory(x).logits)
    # never the whole float model: the embedding and norms, plus one block at a time
    one_block = sum(p.numel() * 4 for p in llama().model.layers[0].parameters())
    outside = sum(p.numel() * 4 for n, p in llama().named_parameters() if ".layers." not in n)
    assert result.peak_float_bytes is not None
    assert result.peak_float_bytes <= outside + one_block + 4096 < whole


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_failed_streamed_calibration_puts_the_meta_model_back(checkpoint, monkeypatch, exc) -> None:
    import torchq.algorithms.gptq as gptq_mod

    model = llama(meta=True)
    before = {n: t for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}
    real, calls = gptq_mod.gptq_quantize, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 9:  # in the second block
            raise exc("stop")
        return real(*args, **kwargs)

    monkeypatch.setattr(gptq_mod, "gptq_quantize", failing)
    with pytest.raises((exc, torchq.QuantizationError)):
        calibrate(model, weights=checkpoint, gptq_awq_scale=False)
    after = {n: t for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert all(t.device.type == "meta" for t in after.values())


def test_streaming_checks_the_checkpoint_before_reading_anything(checkpoint, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    model = llama(meta=True)
    with pytest.raises(ValueError, match=r"model: .* on the meta device .*pass weights="):
        calibrate(model)
    tensors = load_file(checkpoint / "model.safetensors")
    short = dict(tensors)
    del short["model.layers.2.mlp.down_proj.weight"]
    save_file(short, tmp_path / "short.safetensors")
    with pytest.raises(ValueError, match=r"weights: .* holds no tensor for 1 meta tensor\(s\) of the model \(model.layers.2.mlp.down_proj.weight\)"):
        calibrate(model, weights=tmp_path / "short.safetensors")
    wrong = dict(tensors)
    wrong["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(64, 32)
    save_file(wrong, tmp_path / "wrong.safetensors")
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.q_proj.weight' has shape \[64, 64\] in the model but \[64, 32\]"):
        calibrate(model, weights=tmp_path / "wrong.safetensors")
    assert all(t.device.type == "meta" for t in model.parameters())
    with pytest.raises(ValueError, match=r"weights: given \(.*\), but no tensor of the model is on the meta device"):
        calibrate(llama(), weights=checkpoint)
    with pytest.raises(ValueError, match="init_buffers: the model has non-persistent buffers on the meta device"):
        calibrate(copy.deepcopy(model), weights=checkpoint, init_buffers=None)
