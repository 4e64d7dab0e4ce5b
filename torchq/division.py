"""Division by a constant with the same bits on every device.

PyTorch's CUDA division multiplies by the reciprocal when the divisor is a Python number (a CPU
scalar): ``t / 127`` is then ``t · fl(1/127)``, one unit in the last place off the quotient for
some values, where the CPU divides. Quantization scales (``amax / 127``, ``amax / 448``,
``range / 15``) must not depend on the device: a weight quantized on a GPU has the CPU's codes and
scales, and a kernel's activation codes are the reference's. :func:`divide` hands the divisor to the
device as a tensor there, so the quotient is the correctly rounded one everywhere.
"""

from __future__ import annotations

import torch

__all__ = ["divide"]

_REDUCED = (torch.float16, torch.bfloat16)


def divide(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` correctly rounded in ``t``'s arithmetic (fp32 for fp16 / bf16 ``t``, as the
    CPU computes it, then rounded once to ``t``'s dtype), with the same bits on every device."""
    if t.device.type == "cpu" or not t.is_floating_point():
        return t / divisor
    return divide_by_tensor(t, divisor)


def divide_by_tensor(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """:func:`divide`'s form for other devices: the divisor as a 0-d tensor on ``t``'s device (no
    reciprocal), reduced dtypes through fp32. On the CPU it gives ``t / divisor``'s bits too (the
    tests check that there)."""
    if t.dtype in _REDUCED:
        return divide_by_tensor(t.float(), divisor).to(t.dtype)
    return t / torch.full((), divisor, dtype=t.dtype, device=t.device)
