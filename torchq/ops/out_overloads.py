"""``.out`` overloads of torchq's bitsandbytes-compatible ops (``torch.ops.torchq.<op>.out``).

An ``.out`` overload takes the functional op's arguments plus ``Tensor! out``, returns nothing and
writes exactly the functional op's result into ``out``, which must already have the result's
shape, dtype and device (checked, in eager mode and under ``torch.compile``; ``out`` is left
untouched when the check fails). Its kernel runs the functional op (so on the CPU its native
kernel when there is one) and copies the result.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_out", "define_out_overload"]

_LIB = torch.library.Library("torchq", "FRAGMENT")


def check_out(op: str, out: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
    """Raise unless ``out`` has ``shape``, ``dtype`` and ``device`` (the error names ``out``)."""
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"torchq::{op}.out: out: expected shape {list(shape)}, got {list(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"torchq::{op}.out: out: expected dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"torchq::{op}.out: out: expected device {device}, got {out.device}")


def define_out_overload(op: str, schema: str) -> None:
    """Define ``torchq::{op}.out`` with ``schema`` (``"(<op's arguments>, Tensor! out) -> ()"``).

    Kernel and fake both run the functional op (its fake under ``torch.compile``, so the input
    checks are the functional op's) and check ``out`` against its result."""
    functional = getattr(torch.ops.torchq, op).default
    _LIB.define(f"{op}.out{schema}")

    def checked_result(args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        *inputs, out = args
        result = functional(*inputs)
        check_out(op, out, result.shape, result.dtype, result.device)
        return result, out

    def kernel(*args) -> None:
        result, out = checked_result(args)
        out.copy_(result)

    def fake(*args) -> None:
        checked_result(args)

    _LIB.impl(f"{op}.out", kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"torchq::{op}.out", lib=_LIB)(fake)
