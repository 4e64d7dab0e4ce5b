"""Host-side sizing for the Triton launchers: the device's multiprocessors (read once per device)
and plain integer helpers (``triton.cdiv`` is a constexpr function in recent triton, ~12 us a host
call)."""

from __future__ import annotations

import functools

import torch

__all__ = ["sm_count", "cdiv", "next_pow2", "as_rows"]


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (8 off CUDA: the interpreter runs a few K slices, exercising the split paths)."""
    if device.type != "cuda":
        return 8
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count  # ~25 us a call: once per device


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints."""
    return -(-a // b)


def next_pow2(v: int) -> int:
    """The smallest power of two >= ``v`` (1 for ``v <= 1``)."""
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def as_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x [..., K]`` as ``[M, K]`` rows with unit stride and row stride ``K`` (a view when it is one)."""
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 and x2.stride(0) == k else x2.contiguous()
