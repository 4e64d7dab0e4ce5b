"""A minimal LoRA adapter for the tutorials, tests and benchmarks (PEFT does the same for real
models: see ``torchq.hf``).

``LoRALinear(base)`` computes ``base(x) + (x @ A^T @ B^T) * alpha / rank`` with a frozen ``base``
(a quantized ``nn.Linear`` for QLoRA) and trainable ``A`` (``rank x in``) and ``B`` (``out x
rank``). ``B`` starts at zero (the adapted model starts as the base model) unless ``b_std`` is
given; ``generator`` seeds both.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LoRALinear"]


class LoRALinear(nn.Module):
    """A frozen (quantized) linear plus a trainable low-rank update, scaled by ``alpha / rank``."""

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float | None = None, *, b_std: float = 0.0,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features, generator=generator) / base.in_features**0.5)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank, generator=generator) * b_std)
        self.scale = (rank if alpha is None else alpha) / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_a.to(x.dtype), self.lora_b.to(x.dtype)
        return self.base(x) + (x @ a.t() @ b.t()) * self.scale
