"""Rounding inside Triton kernels that the CPU interpreter reproduces bit for bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["ROUND_KINDS", "round_to"]

ROUND_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # rounding kinds of round_to


@triton.jit
def round_to(v, KIND: tl.constexpr):
    """fp32 ``v`` rounded to nearest even bf16 (KIND 1) or fp16 (KIND 2), back in fp32 (KIND 0:
    unchanged). The bf16 rounding is done on the bits (what ``cvt.rn.bf16.f32`` and torch do,
    overflow to inf and NaN kept), since triton's interpreter truncates instead."""
    if KIND == 1:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    elif KIND == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v
