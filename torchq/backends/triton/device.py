"""The CUDA device facts the Triton launchers size their grids by, read once per device."""

from __future__ import annotations

import functools

import torch

__all__ = ["sm_count"]


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (8 off CUDA: the interpreter runs a few K slices, exercising the split paths)."""
    if device.type != "cuda":
        return 8
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count  # ~25 us a call: once per device
