"""A stack of residual MLP blocks (``x + down(act(up(x)))``), the model of the distributed
tutorials, tests and benchmark: each block's ``up`` / ``down`` linears are what FSDP2 shards per
block and tensor parallelism splits column- / row-wise."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ResidualBlock", "ResidualMLP"]

_ACTIVATIONS = {"gelu": nn.functional.gelu, "relu": torch.relu}


class ResidualBlock(nn.Module):
    def __init__(self, dims: int, hidden: int, *, bias: bool = True, activation: str = "gelu") -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation: expected one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.up, self.down = nn.Linear(dims, hidden, bias=bias), nn.Linear(hidden, dims, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(_ACTIVATIONS[self.activation](self.up(x)))


class ResidualMLP(nn.Module):
    """``depth`` :class:`ResidualBlock` s of ``dims -> hidden -> dims`` in ``self.blocks``, then an
    optional ``self.head`` linear to ``classes`` outputs."""

    def __init__(self, dims: int, hidden: int, depth: int, *, classes: int | None = None, bias: bool = True,
                 activation: str = "gelu") -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResidualBlock(dims, hidden, bias=bias, activation=activation) for _ in range(depth)])
        self.head = None if classes is None else nn.Linear(dims, classes, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)
