"""quantize_ on tiny transformers models built from a config: tied embeddings (Llama), GPT-2's
Conv1D layers, checkpoints, and ``save_pretrained`` of torchq weights (issue 14 item 9): it writes
torchq's safetensors format, which ``load_quantized`` reads back into a model built from the
folder's config."""

import contextlib
import copy
import functools
import json
import pickle
import warnings

import pytest
import torch

import torchq
from torchq import AffineQuantizedTensor as AQT

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

import torchq.hf  # noqa: E402  (after the skip: its names need transformers)


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


@torch.no_grad()
def outputs(m):
    out = m(IDS)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def quantized(build, cfg):
    m = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchq.TiedWeightWarning)
        torchq.quantize_(m, cfg)
    return m


SAVE_CONFIGS = {
    "int4": lambda: torchq.int4_weight_only(group_size=32),
    "nf4": lambda: torchq.nf4_weight_only(),
    "int8dyn": lambda: torchq.int8_dynamic_activation_int8_weight(),
}


def from_folder(build, folder, meta):
    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.quantization_config["quant_method"] == "torchq"
    with torch.device("meta") if meta else contextlib.nullcontext():
        return type(build())(config).eval()


@pytest.mark.parametrize("meta", [False, True], ids=["float", "meta"])
@pytest.mark.parametrize("cfg", sorted(SAVE_CONFIGS))
@pytest.mark.parametrize("build", [llama, bert], ids=["llama", "bert"])
def test_save_pretrained_writes_torchq_weights_that_load_quantized_reads_back(tmp_path, build, cfg, meta):
    m = quantized(build, SAVE_CONFIGS[cfg]())
    assert isinstance(m.hf_quantizer, torchq.hf.TorchqHfQuantizer)
    y = outputs(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no TypedStorage or other warning
        m.save_pretrained(tmp_path / "a")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "model.safetensors" in files and "model.safetensors.index.json" not in files
    assert json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]["quant_method"] == "torchq"
    fresh = from_folder(build, tmp_path / "a", meta)
    torchq.load_quantized(fresh, tmp_path / "a", init_buffers="auto")
    assert torch.equal(outputs(fresh), y)
    if build is llama:
        assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    src, got = m.state_dict(), fresh.state_dict()
    assert src.keys() == got.keys()
    for k, v in src.items():
        if isinstance(v, AQT):
            assert isinstance(got[k], AQT) and torch.equal(got[k].dequantize(), v.dequantize()), k
        else:
            assert type(got[k]) is torch.Tensor and got[k].dtype == v.dtype and torch.equal(got[k], v), k
    # the loaded model saves again (load_quantized attached the quantizer): the same metadata and tensors
    fresh.save_pretrained(tmp_path / "b")
    with safe_open(tmp_path / "a" / "model.safetensors", "pt") as a, safe_open(tmp_path / "b" / "model.safetensors", "pt") as b:
        assert a.metadata() == b.metadata() and set(a.keys()) == set(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


def test_save_pretrained_sharded_round_trips_with_parts_of_one_weight_in_two_shards(tmp_path, capsys):
    m = quantized(llama, torchq.int4_weight_only(group_size=32))
    y = outputs(m)
    m.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (tmp_path / "model.safetensors").exists()
    shards_of: dict[str, set[str]] = {}
    for key, file in index["weight_map"].items():
        shards_of.setdefault(key.split(":")[0], set()).add(file)
    assert any(len(files) > 1 for files in shards_of.values())  # transformers splits one weight's parts
    for meta in (True, False):
        fresh = from_folder(llama, tmp_path, meta)
        torchq.load_quantized(fresh, tmp_path, init_buffers="auto")
        assert torch.equal(outputs(fresh), y)
    # torchq inspect lists each entry once, although every shard repeats the header
    from torchq.cli import main

    assert main(["inspect", str(tmp_path), "--json"]) == 0
    names = [e["name"] for e in json.loads(capsys.readouterr().out)["entries"]]
    assert sorted(names) == sorted(m.state_dict())
    # a shard the index does not list: its tensors are in no file the checkpoint names
    dropped = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != dropped}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(torchq.CheckpointError, match="in no file"):
        torchq.load_quantized(from_folder(llama, tmp_path, True), tmp_path)


def test_sharded_save_pretrained_files_of_two_checkpoints_are_refused(tmp_path):
    for seed, folder in ((0, "a"), (1, "b")):
        quantized(functools.partial(llama, seed), torchq.int8_weight_only()).save_pretrained(
            tmp_path / folder, max_shard_size="40KB")
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "a" / shard).write_bytes((tmp_path / "b" / shard).read_bytes())
    with pytest.raises(torchq.CheckpointError, match="header differs"):
        torchq.load_quantized(from_folder(llama, tmp_path / "a", True), tmp_path / "a")


def test_from_pretrained_loads_a_folder_that_quantize_then_save_pretrained_wrote(tmp_path):
    m = quantized(llama, torchq.int8_weight_only())
    m.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(again.model.layers[0].mlp.up_proj.weight, AQT)
    assert again.lm_head.weight is again.model.embed_tokens.weight and torch.equal(logits(again), logits(m))


@pytest.mark.parametrize("build", [llama, bert], ids=["llama", "bert"])
def test_safetensors_of_torchq_weights_without_the_quantizer_raises_a_clear_error(tmp_path, build):
    m = quantized(build, torchq.int8_weight_only())
    with pytest.raises(TypeError, match=r"quantized weight.*torchq\.save_quantized"):
        safetensors_torch.save_file(m.state_dict(), str(tmp_path / "sd.safetensors"))
    # a state dict assigned by plain torch: no quantizer attached, save_pretrained says how
    torch.save(m.state_dict(), tmp_path / "sd.pt")
    fresh = build(seed=1)
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True), assign=True)
    fresh.tie_weights()  # assign=True wraps each entry in its own Parameter: tie the embeddings again
    assert getattr(fresh, "hf_quantizer", None) is None
    with warnings.catch_warnings(record=True) as seen, pytest.raises(TypeError, match=r"torchq\.hf\.attach\(model\)"):
        warnings.simplefilter("always")
        fresh.save_pretrained(tmp_path / "out")
    assert not [w for w in seen if "TypedStorage" in str(w.message)]
    assert not list((tmp_path / "out").glob("*.safetensors"))  # no half-written weights file
    torchq.hf.attach(fresh).save_pretrained(tmp_path / "out")
    loaded = from_folder(build, tmp_path / "out", True)
    torchq.load_quantized(loaded, tmp_path / "out", init_buffers="auto")
    assert torch.equal(outputs(loaded), outputs(m))


def test_attach_only_transformers_models_and_keep_them_copyable():
    plain = torch.nn.Sequential(torch.nn.Linear(64, 64))
    torchq.quantize_(plain, torchq.int8_weight_only())
    assert not hasattr(plain, "hf_quantizer")
    with pytest.raises(TypeError, match="PreTrainedModel"):
        torchq.hf.attach(plain)
    untouched = bert()
    torchq.quantize_(untouched, torchq.int8_weight_only(), filter_fn=lambda mod, name: False)
    assert getattr(untouched, "hf_quantizer", None) is None  # nothing quantized: nothing attached
    m = quantized(bert, torchq.int8_weight_only())
    twin = copy.deepcopy(m)
    assert type(twin.hf_quantizer) is type(m.hf_quantizer)
    config = pickle.loads(pickle.dumps(m.config))
    assert config.quantization_config.to_dict() == m.config.quantization_config.to_dict()


def test_save_pretrained_refuses_a_model_whose_weights_transformers_converts_on_save(tmp_path):
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=2)
    m = transformers.MixtralForCausalLM(cfg).eval()
    torchq.quantize_(m, torchq.int8_weight_only())
    with pytest.raises(ValueError, match=r"converts.*merge or split.*torchq\.save_quantized"):
        m.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))


def test_documented_way_to_save_a_quantized_transformers_model(tmp_path):
    m = llama()
    with pytest.warns(torchq.TiedWeightWarning):
        torchq.quantize_(m, torchq.int4_weight_only(group_size=32))
    m.config.save_pretrained(tmp_path)
    torchq.save_quantized(m, tmp_path)
    fresh = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path)).eval()
    torchq.load_quantized(fresh, tmp_path)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight and torch.equal(logits(fresh), logits(m))


@pytest.mark.parametrize("original_format", [True, False], ids=["renamed-back", "as-loaded"])
def test_save_pretrained_of_a_model_loaded_from_legacy_key_names(tmp_path, original_format):
    """from_pretrained renames BERT's legacy ``LayerNorm.gamma``/``beta``; save_pretrained renames
    them back (unless save_original_format=False): the torchq header records it."""
    src = bert()
    src.config.save_pretrained(tmp_path / "legacy")
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v.contiguous()
              for k, v in src.state_dict().items()}
    safetensors_torch.save_file(legacy, str(tmp_path / "legacy" / "model.safetensors"), metadata={"format": "pt"})
    m = transformers.BertModel.from_pretrained(tmp_path / "legacy").eval()
    torchq.quantize_(m, torchq.int8_weight_only())
    y = outputs(m)
    m.save_pretrained(tmp_path / "q", save_original_format=original_format)
    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f:
        assert any("LayerNorm.gamma" in k for k in f.keys()) == original_format
    fresh = from_folder(bert, tmp_path / "q", True)
    torchq.load_quantized(fresh, tmp_path / "q", init_buffers="auto")
    assert torch.equal(outputs(fresh), y)


def test_the_old_import_paths_of_the_transformers_code_still_work_and_say_where_it_moved():
    import importlib
    import sys

    for old, new, names in (("torchq.interop.transformers", "torchq.hf", ("attach", "prepare_attach", "TorchqConfig")),
                            ("torchq.interop.gguf_transformers", "torchq.hf", ("from_gguf",))):
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to torchq.hf"):
            module = importlib.import_module(old)
        for name in names:
            assert getattr(module, name) is getattr(importlib.import_module(new), name)
