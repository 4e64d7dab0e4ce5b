"""``.out`` overloads of torchq's bitsandbytes-compatible ops (``torch.ops.torchq.<op>.out``).

An ``.out`` overload takes the functional op's arguments plus ``Tensor! out``, returns nothing and
writes exactly the functional op's result into ``out``, which must already have the result's
shape, dtype and device (checked, in eager mode and under ``torch.compile``). Its kernel runs the
functional op (so on the CPU its native kernel when there is one) and copies the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["check_out", "define_out_overload"]

_LIB = torch.library.Library("torchq", "FRAGMENT")

Expected = tuple[Sequence[int], torch.dtype, torch.device]


def check_out(op: str, out: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
    """Raise unless ``out`` has ``shape``, ``dtype`` and ``device`` (the error names ``out``)."""
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"torchq::{op}.out: out: expected shape {list(shape)}, got {list(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"torchq::{op}.out: out: expected dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"torchq::{op}.out: out: expected device {device}, got {out.device}")


def define_out_overload(op: str, schema: str, expected: Callable[..., Expected]) -> None:
    """Define ``torchq::{op}.out`` with ``schema`` (``"(<op's arguments>, Tensor! out) -> ()"``).

    ``expected(*inputs)`` gives the functional result's ``(shape, dtype, device)`` from the
    inputs alone (it also serves the fake kernel)."""
    functional = getattr(torch.ops.torchq, op).default
    _LIB.define(f"{op}.out{schema}")

    def kernel(*args) -> None:
        *inputs, out = args
        check_out(op, out, *expected(*inputs))
        out.copy_(functional(*inputs))

    def fake(*args) -> None:
        *inputs, out = args
        check_out(op, out, *expected(*inputs))

    _LIB.impl(f"{op}.out", kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"torchq::{op}.out", lib=_LIB)(fake)
