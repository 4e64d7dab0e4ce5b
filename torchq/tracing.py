"""Whether a tensor is being traced (torch.compile, export) rather than holding data."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

__all__ = ["traced"]

_TRACED_TYPES = (FakeTensor, FunctionalTensor)


def traced(x: torch.Tensor) -> bool:
    """True under ``torch.compile`` / export: ``torch.compiler.is_compiling()``, or ``x`` a fake
    or functional tensor. The second test matters: some PyTorch versions (2.11) run a graph's
    nodes on fake tensors with symbolic sizes while ``is_compiling()`` is False, and an eager
    path there (a native kernel reading data pointers, a cache keyed by sizes, a data-dependent
    branch) fails."""
    return _is_compiling() or (type(x) is not torch.Tensor and isinstance(x, _TRACED_TYPES))


_is_compiling = torch.compiler.is_compiling
