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
    # 3, 5, 6, 7 bits: 8 values fill ``bits`` bytes; build byte i from the (at most three) values
    # whose bit fields overlap it, in int16 so shifted values never overflow.
    v = torch.zeros(n, groups * 8, dtype=torch.int16, device=u.device)
    v[:, :k] = u
    v = v.reshape(n, groups, 8)
    out = torch.zeros(n, groups, bits, dtype=torch.int16, device=u.device)
    for j in range(8):
        lo, hi = j * bits, (j + 1) * bits  # stream bits of value j
        for i in range(lo // 8, (hi - 1) // 8 + 1):
            shift = 8 * (i + 1) - hi  # where value j's last bit lands relative to byte i's last bit
            part = v[..., j] << shift if shift >= 0 else v[..., j] >> -shift
            out[..., i] |= part & 0xFF
    return out.to(torch.uint8).reshape(n, groups * bits)


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
    b = packed.reshape(n, groups, bits).to(torch.int16)
    mask = (1 << bits) - 1
    u = torch.empty(n, groups, 8, dtype=torch.uint8, device=packed.device)
    for j in range(8):
        lo, hi = j * bits, (j + 1) * bits
        i0, i1 = lo // 8, (hi - 1) // 8
        window = b[..., i0] if i0 == i1 else (b[..., i0] << 8) | b[..., i1]  # value j lies within 1-2 bytes
        u[..., j] = (window >> (8 * (i1 + 1) - hi)) & mask
    return u.reshape(n, groups * 8)[:, :k]
