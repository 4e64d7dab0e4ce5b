"""Device checks shared by the custom ops' fake kernels: an eager call that mixes a meta tensor
with CPU ones dispatches to the fake kernel, whose uninitialized output would otherwise come back
as the result."""

from __future__ import annotations

import functools
import inspect

import torch

__all__ = ["check_op_devices", "one_device_fake"]


def check_op_devices(op: str, x: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """For a custom op's fake kernel: raise unless every tensor argument is on ``x``'s device.
    An eager call with a meta argument among CPU ones (a meta bias, say) dispatches to the fake
    kernel, whose uninitialized output would otherwise come back as the result."""
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise ValueError(f"torchq::{op}: {name}: expected device {x.device} (x's), got {t.device}")


def one_device_fake(op: str):
    """Decorator for a custom op's fake kernel whose tensor arguments must share one device: an
    eager call mixing a meta tensor with CPU ones dispatches to the fake kernel, and its
    uninitialized output would come back as the result (see :func:`check_op_devices`)."""

    def deco(fake):
        signature = inspect.signature(fake)

        @functools.wraps(fake)
        def checked(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            tensors = [(k, v) for k, v in bound.items() if isinstance(v, torch.Tensor)]
            if tensors:
                first = tensors[0][1].device
                for name, t in tensors[1:]:
                    if t.device != first:
                        raise ValueError(f"torchq::{op}: {name}: expected device {first} (the first tensor's), got {t.device}")
            return fake(*args, **kwargs)

        return checked

    return deco
