"""Loading a torchq checkpoint into a transformers model built on the ``meta`` device (issue 14,
item 8): non-persistent buffers (rotary ``inv_freq``, BERT ``position_ids``) are computed by the
model's own ``_init_weights``, and the forward is bit-identical to the quantized source."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchq
from torchq import CheckpointError, LoadWarning
from torchq.checkpoint import init_meta_buffers

transformers = pytest.importorskip("transformers")


def llama(meta: bool) -> nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        return transformers.LlamaForCausalLM(cfg).eval()


def bert(meta: bool) -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    with torch.device("meta") if meta else torch.device("cpu"):
        return transformers.BertModel(cfg).eval()


MODELS = {"llama": llama, "bert": bert}
IDS = torch.tensor([[3, 17, 99, 5, 64, 1, 0, 127], [8, 8, 2, 41, 7, 100, 12, 9]])


def forward(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=IDS)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def non_persistent(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{n}.{a}" if n else a: b for n, m in model.named_modules() for a, b in m._buffers.items()
            if b is not None and a in m._non_persistent_buffers_set}


@pytest.fixture(scope="module", params=sorted(MODELS))
def source(request, tmp_path_factory):
    make = MODELS[request.param]
    m = make(meta=False)
    torchq.quantize_(m, torchq.int8_weight_only())
    path = tmp_path_factory.mktemp("tf_meta") / f"{request.param}.safetensors"
    torchq.save_quantized(m, path)
    return request.param, m, path


def test_load_into_meta_model_with_init_buffers_auto(source):
    name, src, path = source
    target = MODELS[name](meta=True)
    assert any(b.is_meta for b in non_persistent(target).values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoadWarning)  # nothing left on meta, nothing to warn about
        torchq.load_quantized(target, path, init_buffers="auto")
    want = non_persistent(src)
    got = non_persistent(target)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].device.type == "cpu" and got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert torch.equal(forward(target), forward(src))


def test_without_init_buffers_the_warning_names_them_and_the_fix(source):
    name, _, path = source
    target = MODELS[name](meta=True)
    with pytest.warns(LoadWarning, match=r"still on the meta device.*(inv_freq|position_ids).*init_buffers='auto'"):
        torchq.load_quantized(target, path)
    # the documented way afterwards, without reloading
    assert init_meta_buffers(target)
    assert not any(b.is_meta for b in non_persistent(target).values())


def test_a_user_function_fills_the_buffers_and_a_failure_changes_nothing(tmp_path):
    src = llama(meta=False)
    torchq.quantize_(src, torchq.int4_weight_only(group_size=32))
    torchq.save_quantized(src, tmp_path / "m.safetensors")

    target = llama(meta=True)
    before = dict(target.state_dict(keep_vars=True)) | non_persistent(target)

    def forgets(module: nn.Module) -> None:  # fills nothing: a NaN-filled float buffer is refused
        pass

    with pytest.raises(ValueError, match=r"init_buffers: left 'model.rotary_emb.inv_freq'.*unset"):
        torchq.load_quantized(target, tmp_path / "m.safetensors", init_buffers=forgets)
    after = dict(target.state_dict(keep_vars=True)) | non_persistent(target)
    assert all(after[k] is v for k, v in before.items())

    def rope(module: nn.Module) -> None:
        inv_freq, _ = module.compute_default_rope_parameters(module.config)
        module.inv_freq.copy_(inv_freq)
        module.original_inv_freq.copy_(inv_freq)

    torchq.load_quantized(target, tmp_path / "m.safetensors", init_buffers=rope)
    assert torch.equal(forward(target), forward(src))


def test_auto_needs_a_transformers_model():
    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    with torch.device("meta"):
        m = Plain()
    with pytest.raises(TypeError, match="no module enclosing buffer 'table' defines _init_weights"):
        init_meta_buffers(m)
    assert m.table.is_meta
    init_meta_buffers(m, lambda mod: mod.table.copy_(torch.arange(4.0)))
    assert torch.equal(m.table, torch.arange(4.0))


def test_init_buffers_argument_is_checked(source):
    _, _, path = source
    with pytest.raises(TypeError, match="init_buffers: expected None, 'auto' or a function"):
        torchq.load_quantized(llama(meta=True), path, init_buffers="yes")
    with pytest.raises(CheckpointError):  # an unrelated model: refused before any buffer is touched
        torchq.load_quantized(nn.Linear(3, 3), path, init_buffers="auto")


def test_torch_save_state_dict_assign_then_init_meta_buffers(source):
    """The same for ``torch.save`` checkpoints: ``load_state_dict(sd, assign=True)`` into the meta
    model, then :func:`init_meta_buffers`."""
    import io

    name, src, _ = source
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    target = MODELS[name](meta=True)
    target.load_state_dict(torch.load(buf, weights_only=True), assign=True)
    assert sorted(init_meta_buffers(target)) == sorted(k for k, b in non_persistent(src).items())
    assert torch.equal(forward(target), forward(src))


def test_a_tied_head_stored_once_fills_both_names_of_a_meta_model(tmp_path):
    """``save_pretrained`` stores a tied ``lm_head`` once, under the embedding's name: loading that
    into a tied meta model fills both names through the tie (strict passes, the tie survives)."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(cfg).eval()
    source.save_pretrained(tmp_path / "float")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoadWarning)
        torchq.load_quantized(model, tmp_path / "float", strict=True, init_buffers="auto")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not [n for n, t in model.state_dict().items() if t.device.type == "meta"]
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, source(IDS).logits)
