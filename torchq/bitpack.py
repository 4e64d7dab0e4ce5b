"""Sub-byte code packing shared by storage formats: one big-endian bit stream per row.

``pack_bits`` turns unsigned ``[N, K]`` values below ``2^bits`` (1 <= bits <= 7) into uint8
``[N, ceil(K/8) * bits]``: a row is padded with zeros to a multiple of 8 values, value ``j``
occupies stream bits ``[j*bits, (j+1)*bits)``, and stream bit 0 is the most significant bit of
the row's first byte (for 4 bits: value 2j in the high nibble, 2j+1 in the low nibble). The
format is device-independent and is what checkpoints store for sub-byte codes.
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_width"]


def packed_width(k: int, bits: int) -> int:
    """Bytes per row of ``k`` values of ``bits`` bits: ``ceil(k / 8) * bits``."""
    return -(-k // 8) * bits


def pack_bits(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``[N, K]`` values < 2^bits into uint8 ``[N, ceil(K/8)*bits]`` (see module doc)."""
    if not 1 <= bits <= 7:
        raise ValueError(f"bits: expected 1..7, got {bits}")
    n, k = u.shape
    groups = -(-k // 8)
    if 8 % bits == 0:  # 1, 2, 4 bits: whole values per byte, uint8 arithmetic only
        per = 8 // bits
        v = torch.zeros(n, groups * 8, dtype=torch.uint8, device=u.device)
        v[:, :k] = u
        v = v.reshape(n, groups * bits, per)
        out = v[..., 0] << (8 - bits)
        for j in range(1, per):
            out |= v[..., j] << (8 - bits * (j + 1))
        return out
    v = torch.zeros(n, groups * 8, dtype=torch.int64, device=u.device)
    v[:, :k] = u.to(torch.int64)
    v = v.reshape(n, groups, 8)
    shifts = torch.arange(7, -1, -1, device=u.device, dtype=torch.int64) * bits
    word = (v << shifts).sum(-1, keepdim=True)  # disjoint bit fields: sum == or
    byte_shifts = torch.arange(bits - 1, -1, -1, device=u.device, dtype=torch.int64) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8).reshape(n, groups * bits)


def unpack_bits(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: uint8 ``[N, K]`` values."""
    if not 1 <= bits <= 7:
        raise ValueError(f"bits: expected 1..7, got {bits}")
    n = packed.shape[0]
    groups = packed.shape[1] // bits
    if 8 % bits == 0:
        per, mask = 8 // bits, (1 << bits) - 1
        shifts = [8 - bits * (j + 1) for j in range(per)]
        u = torch.stack([(packed >> s) & mask for s in shifts], dim=-1)
        return u.reshape(n, groups * 8)[:, :k]
    b = packed.reshape(n, groups, bits).to(torch.int64)
    byte_shifts = torch.arange(bits - 1, -1, -1, device=packed.device, dtype=torch.int64) * 8
    word = (b << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.int64) * bits
    u = (word >> shifts) & ((1 << bits) - 1)
    return u.reshape(n, groups * 8)[:, :k].to(torch.uint8)
