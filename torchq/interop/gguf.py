"""GGUF (llama.cpp) Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and k-quant (Q2_K-Q6_K) tensors <-> torchq weights, losslessly.

A GGUF weight of logical shape ``[N, K]`` (``ne0 = K`` contiguous, ``K % 32 == 0``) stores each row
as ``K / 32`` blocks of 32 elements, little-endian:

* ``Q4_0`` (18 bytes): fp16 ``d``, 16 bytes ``qs``; element ``j < 16`` is ``qs[j] & 0xF``, element
  ``j + 16`` is ``qs[j] >> 4``; value ``d · (q - 8)``;
* ``Q4_1`` (20 bytes): fp16 ``d``, fp16 ``m``, 16 bytes ``qs`` (same nibble order); value ``d · q + m``;
* ``Q8_0`` (34 bytes): fp16 ``d``, 32 int8 ``q``; value ``d · q``;
* ``Q5_0`` (22 bytes) / ``Q5_1`` (24 bytes): fp16 ``d`` (and ``m``), 4 bytes ``qh`` (bit ``j`` of the
  little-endian word: the fifth bit of element ``j``), 16 bytes ``qs`` as Q4; value ``d · (q - 16)``
  / ``d · q + m``: codes int8 [-16, 15] domain NONE / uint8 [0, 31] FLOAT zero ``m + 16·d`` (checked).

As torchq plain forms (groups of 32 along K, fp32 scales holding the fp16 values exactly):

* ``Q4_0``: codes ``q - 8`` int8 in [-8, 7], zero-point domain NONE, ``scale = d``;
* ``Q4_1``: codes ``q`` uint8 in [0, 15], zero-point domain FLOAT with ``zero = m + 8·d`` in fp32
  (torchq's ``(q - 8)·s + zero``), checked to be exact so that ``m = zero - 8·d`` comes back;
* ``Q8_0``: codes ``q`` int8 in [-128, 127], zero-point domain NONE, ``scale = d``.

``Q8_K`` (292 bytes per 256 elements: fp32 ``d``, 256 int8 ``q``, 16 int16 sums of 16 ``q`` each; value
``d · q``; llama.cpp's dot-product type, which gguf-py cannot dequantize): codes ``q`` int8, group 256,
domain NONE, fp32 ``scale = d``; the sums are recomputed on export.

The k-quants (super-blocks of 256 elements along a row, ``K % 256 == 0``; fp16 ``d`` (and ``dmin``),
sub-block scales ``sc`` and minimums ``m`` small integers; values computed in fp32 as gguf-py does:
the products ``s = d·sc`` and ``dmin·m`` first, both exact in fp32):

* ``Q4_K`` (144 bytes): ``d``, ``dmin``, 12 bytes of eight 6-bit ``sc`` and ``m`` (bytes 0-3: the low
  6 bits of ``sc[0..3]``, bits 6-7 the bits 4-5 of ``sc[4..7]``; bytes 4-7 the same for ``m``; bytes
  8-11: low nibble ``sc[4..7] & 15``, high nibble ``m[4..7] & 15``), 128 bytes of nibbles (32-byte
  chunk ``j``: sub-block ``2j`` in the low nibbles, ``2j+1`` in the high); value ``s·q − dmin·m``, ``q``
  in [0, 15]: codes ``q`` uint8, group 32, FLOAT zero point ``zero = 8·s − dmin·m``;
* ``Q5_K`` (176 bytes): ``d``, ``dmin``, the 12 scale bytes, 32 bytes ``qh`` (bit ``i`` of byte ``l``:
  the fifth bit of element ``l`` of sub-block ``i``), the 128 nibble bytes; ``q`` in [0, 31], FLOAT zero
  ``16·s − dmin·m``;
* ``Q6_K`` (210 bytes): 128 bytes ``ql``, 64 bytes ``qh``, 16 int8 ``sc``, ``d``; element
  ``128·h + r`` has its low 4 bits in nibble ``r // 64`` of ``ql[64·h + r % 64]`` and its high 2 bits
  at bits ``2·(r // 32)`` of ``qh[32·h + r % 32]``; value ``(d·sc)·(q − 32)``: codes int8 [-32, 31],
  group 16, domain NONE, ``scale = d·sc``;
* ``Q3_K`` (110 bytes): 32 bytes ``hmask`` (bit ``i`` of byte ``l``: ``hbit`` of element ``32·i + l``),
  64 bytes of 2-bit lows (element ``128·h + r``: bits ``2·(r // 32)`` of byte ``32·h + r % 32``), 12
  bytes of sixteen 6-bit ``u`` (``u[i]``'s low nibble: nibble ``i // 8`` of byte ``i % 8``; its high 2
  bits: bits ``2·(i // 4)`` of byte ``8 + i % 4``), ``d``; value ``(d·(u − 32))·q`` with
  ``q = low − 4·(1 − hbit)`` in [-4, 3]: codes int8, group 16, domain NONE, ``scale = d·(u − 32)``;
* ``Q2_K`` (84 bytes): 16 bytes of (``sc`` low nibble, ``m`` high nibble), 64 bytes of 2-bit ``q``
  (as Q3_K's lows), ``d``, ``dmin``; value ``s·q − dmin·m``, ``q`` in [0, 3]: codes uint8, group 16,
  FLOAT zero ``2·s − dmin·m``.

A FLOAT zero point reproduces ``s·q − dmin·m`` bit for bit only where ``mid·s − dmin·m`` is exact in
fp32 (and gives +0.0 where a negative ``d`` makes gguf-py's value −0.0): :func:`from_gguf_blocks`
checks every value of the tensor against gguf-py's arithmetic and raises ValueError where one
differs (the file readers then keep that tensor in float, warned). Every other GGUF type (IQ*,
TQ*, Q8_K, MXFP4, ...) has no exact torchq form: :func:`read_gguf` yields it dequantized by
gguf-py, with a :class:`GGUFDequantizedWarning` naming the tensor and its type.

Each dequantized value is then, bit for bit, what gguf-py / llama.cpp's reference dequantizer
computes in fp32, and :func:`to_gguf_bytes` writes the bytes back: the legacy formats byte for
byte; the k-quants by factoring each super-block's sub-block scales (and minimums) into fp16 ``d``
(``dmin``) times integers, llama.cpp's factorization first (its largest sub-block gets the extreme
integer: −128 Q6_K, −32 Q3_K, 63 Q4_K / Q5_K, 15 Q2_K), so the bytes llama.cpp's quantizer wrote come
back byte for byte and any other block with equal values. Reading files needs the ``gguf`` package
(``pip install gguf``); the block conversions themselves need only torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..canonical import PlainForm, QuantSpec
from ..checkpoint.codec import CheckpointError
from ..primitives import ZeroPointDomain
from ..tensor import AffineQuantizedTensor

__all__ = ["BLOCK_BYTES", "K_QUANTS", "GGUFDequantizedWarning", "NonFiniteScaleError", "from_gguf_blocks", "to_gguf_bytes",
           "GGUFTensor", "read_gguf", "gguf_metadata"]

BLOCK = 32
QK_K = 256  # k-quant super-block
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210,
               "Q8_K": 292}
_SPECS = {
    "Q4_0": QuantSpec((1, BLOCK), -8, 7, ZeroPointDomain.NONE),
    "Q4_1": QuantSpec((1, BLOCK), 0, 15, ZeroPointDomain.FLOAT),
    "Q5_0": QuantSpec((1, BLOCK), -16, 15, ZeroPointDomain.NONE),
    "Q5_1": QuantSpec((1, BLOCK), 0, 31, ZeroPointDomain.FLOAT),
    "Q8_0": QuantSpec((1, BLOCK), -128, 127, ZeroPointDomain.NONE),
    "Q2_K": QuantSpec((1, 16), 0, 3, ZeroPointDomain.FLOAT),
    "Q3_K": QuantSpec((1, 16), -4, 3, ZeroPointDomain.NONE),
    "Q4_K": QuantSpec((1, 32), 0, 15, ZeroPointDomain.FLOAT),
    "Q5_K": QuantSpec((1, 32), 0, 31, ZeroPointDomain.FLOAT),
    "Q6_K": QuantSpec((1, 16), -32, 31, ZeroPointDomain.NONE),
    "Q8_K": QuantSpec((1, QK_K), -128, 127, ZeroPointDomain.NONE),
}


def _elements(kind: str) -> int:
    """Elements per block of ``kind``: 256 for the k-quants and Q8_K, else 32."""
    return QK_K if kind in K_QUANTS or kind == "Q8_K" else BLOCK


class GGUFDequantizedWarning(UserWarning):
    """A GGUF tensor was imported dequantized to float: its format has no exact torchq form."""


class NonFiniteScaleError(ValueError):
    """A GGUF block holds a NaN or infinite scale (``d``, ``dmin`` or ``m``): no exact form, no float form."""


# where each kind keeps its float block fields: (name, byte offset, bytes); fp16, or fp32 for 4 bytes
_SCALE_FIELDS = {
    "Q4_0": (("d", 0, 2),), "Q4_1": (("d", 0, 2), ("m", 2, 2)), "Q5_0": (("d", 0, 2),), "Q5_1": (("d", 0, 2), ("m", 2, 2)),
    "Q8_0": (("d", 0, 2),), "Q2_K": (("d", 80, 2), ("dmin", 82, 2)), "Q3_K": (("d", 108, 2),),
    "Q4_K": (("d", 0, 2), ("dmin", 2, 2)), "Q5_K": (("d", 0, 2), ("dmin", 2, 2)), "Q6_K": (("d", 208, 2),), "Q8_K": (("d", 0, 4),),
}


def _check_scales(blocks: torch.Tensor, kind: str) -> None:
    """NonFiniteScaleError naming the first block ``[n, nb, bytes]`` whose ``d`` / ``dmin`` / ``m`` is NaN or inf."""
    for field, at, size in _SCALE_FIELDS[kind]:
        v = blocks[..., at:at + size].contiguous().view(torch.float16 if size == 2 else torch.float32).squeeze(-1)
        bad = ~torch.isfinite(v)
        if bool(bad.any()):
            row, block = (int(i) for i in bad.nonzero()[0])
            raise NonFiniteScaleError(f"{kind} block {block} of row {row} has {field} = {float(v[row, block])!r}; "
                                      f"a scale must be finite")


def _check(raw: torch.Tensor, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    if kind not in BLOCK_BYTES:
        raise ValueError(f"kind: expected one of {sorted(BLOCK_BYTES)}, got {kind!r}")
    n, k = shape
    block = _elements(kind)
    if n < 0 or k <= 0 or k % block:
        raise ValueError(f"shape: {kind} rows hold whole blocks of {block}, got {list(shape)}")
    want = n * (k // block) * BLOCK_BYTES[kind]
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.numel() != want:
        got = f"{raw.dtype} with {raw.numel()}" if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise ValueError(f"raw: expected {want} uint8 bytes for {kind} {list(shape)}, got {got}")
    blocks = raw.reshape(n, k // block, BLOCK_BYTES[kind])
    _check_scales(blocks, kind)
    return blocks


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """fp16 values from their 2 little-endian bytes (last dim), as exact fp32."""
    return b.contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def _le_bytes(t: torch.Tensor, n: int, nb: int) -> torch.Tensor:
    """The little-endian bytes of ``n·nb`` values, as uint8 ``[n, nb, itemsize]``."""
    flat = t.reshape(-1).clone(memory_format=torch.contiguous_format)  # fresh strides (size-1 dims too)
    return flat.view(torch.uint8).reshape(n, nb, -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)  # elements 0..15 low, 16..31 high


def _bits(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """``(b >> shift) & mask`` for each shift, stacked on a new dim before the last."""
    sh = torch.tensor(shifts, dtype=torch.uint8, device=b.device).reshape(len(shifts), 1)
    return (b.unsqueeze(-2) >> sh) & mask


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the eight 6-bit scales and minimums packed in 12 bytes, as ints [.., 8]."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.to(torch.float32), mn.to(torch.float32)


def _k_quant_parts(blocks: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q, s, mm)`` of k-quant super-blocks ``[n, nb, bytes]``: integer values ``q`` ``[n, nb, G, g]``
    (before any offset), fp32 sub-block scales ``s`` and minimums ``mm`` ``[n, nb, G]`` (None: none),
    the value being ``s·q − mm`` (or ``s·q``), exactly gguf-py's fp32 products."""
    n, nb, _ = blocks.shape
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _fp16(blocks[..., 0:2]).unsqueeze(-1), _fp16(blocks[..., 2:4]).unsqueeze(-1)
        sc, mn = _k_scale_min(blocks[..., 4:16])
        s, mm = d * sc, dmin * mn
        qs = blocks[..., -128:].reshape(n, nb, 4, 32)
        q = _bits(qs, [0, 4], 0x0F).reshape(n, nb, 8, 32)
        if kind == "Q5_K":
            qh = _bits(blocks[..., 16:48], list(range(8)), 0x01).reshape(n, nb, 8, 32)
            q = q | (qh << 4)
        return q, s, mm
    if kind == "Q6_K":
        ql = _bits(blocks[..., 0:128].reshape(n, nb, 2, 64), [0, 4], 0x0F).reshape(n, nb, 8, 32)
        qh = _bits(blocks[..., 128:192].reshape(n, nb, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, nb, 8, 32)
        q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, nb, 16, 16)
        sc = blocks[..., 192:208].contiguous().view(torch.int8).to(torch.float32)
        return q, _fp16(blocks[..., 208:210]).unsqueeze(-1) * sc, None
    if kind == "Q3_K":
        hmask, qs, scales = blocks[..., 0:32], blocks[..., 32:96], blocks[..., 96:108]
        d = _fp16(blocks[..., 108:110]).unsqueeze(-1)
        low = _bits(scales[..., 0:8], [0, 4], 0x0F).reshape(n, nb, 16)
        high = _bits(scales[..., 8:12], [0, 2, 4, 6], 0x03).reshape(n, nb, 16)
        sc = ((low | (high << 4)).to(torch.int8) - 32).to(torch.float32)
        ql = _bits(qs.reshape(n, nb, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, nb, 16, 16)
        qh = _bits(hmask.reshape(n, nb, 1, 32), list(range(8)), 0x01).reshape(n, nb, 16, 16) ^ 1
        return ql.to(torch.int8) - (qh << 2).to(torch.int8), d * sc, None
    # Q2_K
    scales, qs = blocks[..., 0:16], blocks[..., 16:80]
    d, dmin = _fp16(blocks[..., 80:82]).unsqueeze(-1), _fp16(blocks[..., 82:84]).unsqueeze(-1)
    s, mm = d * (scales & 0x0F).to(torch.float32), dmin * (scales >> 4).to(torch.float32)
    q = _bits(qs.reshape(n, nb, 2, 32), [0, 2, 4, 6], 0x03).reshape(n, nb, 16, 16)
    return q, s, mm


def _from_k_quant(blocks: torch.Tensor, kind: str, shape: tuple[int, int]) -> PlainForm:
    n, k = shape
    spec = _SPECS[kind]
    q, s, mm = _k_quant_parts(blocks, kind)
    codes = q.reshape(n, k).to(spec.code_dtype).contiguous()
    scale = s.reshape(n, -1).contiguous()
    if mm is None:  # value s·q: one product on both sides
        return PlainForm(codes, scale, None, spec)
    mid = (spec.quant_min + spec.quant_max + 1) // 2
    zero = mid * s - mm
    plain = PlainForm(codes, scale, zero.reshape(n, -1).contiguous(), spec)
    reference = (s.unsqueeze(-1) * q.to(torch.float32) - mm.unsqueeze(-1)).reshape(n, k)  # gguf-py's order
    return _checked(plain, reference, kind, mid)


def _checked(plain: PlainForm, reference: torch.Tensor, kind: str, mid: int) -> PlainForm:
    """``plain`` if its float zero point reproduces gguf-py's values ``reference``, else ValueError."""
    k = plain.codes.shape[1]
    got = plain.dequantize(torch.float32)
    # bit for bit, but for the sign of a zero (+0.0 where gguf-py's 0·s − 0 with a negative d gives −0.0)
    differ = (got.view(torch.int32) != reference.view(torch.int32)) & ~(torch.isnan(got) & torch.isnan(reference))
    differ &= ~((got == 0) & (reference == 0))
    if bool(differ.any()):
        i = int(differ.reshape(-1).nonzero()[0])
        raise ValueError(
            f"{kind} element {i} (row {i // k}, column {i % k}): torchq's float zero point gives {float(got.reshape(-1)[i])!r} "
            f"where gguf-py computes {float(reference.reshape(-1)[i])!r} ({mid}·scale − min is not exact in fp32), so "
            f"this tensor has no exact torchq form"
        )
    return plain


def from_gguf_blocks(raw: torch.Tensor, kind: str, shape: tuple[int, int]) -> PlainForm:
    """The plain form of a GGUF ``kind`` tensor of logical ``shape`` ``[N, K]`` from its bytes."""
    blocks = _check(raw, kind, tuple(shape))
    n, k = shape
    if kind in K_QUANTS:
        return _from_k_quant(blocks, kind, (n, k))
    if kind == "Q8_K":  # fp32 d, 256 int8 q, 16 int16 sums of 16 q (unused); value d·q
        d = blocks[..., 0:4].contiguous().view(torch.float32).squeeze(-1)
        return PlainForm(blocks[..., 4:260].contiguous().view(torch.int8).reshape(n, k), d, None, _SPECS[kind])
    if kind in ("Q5_0", "Q5_1"):  # d [, m], 4 bytes qh (bit j: the fifth bit of element j), 16 bytes nibbles
        d = _fp16(blocks[..., 0:2])
        qh = blocks[..., -20:-16]
        high = _bits(qh, list(range(8)), 0x01).transpose(-1, -2).reshape(n, k // BLOCK, 32)  # byte b, bit i -> element 8b + i
        q = _nibbles(blocks[..., -16:]) | (high << 4)
        if kind == "Q5_0":
            return PlainForm((q.to(torch.int8) - 16).reshape(n, k).contiguous(), d, None, _SPECS[kind])
        m = _fp16(blocks[..., 2:4])
        zero = m + 16 * d
        plain = PlainForm(q.reshape(n, k).contiguous(), d, zero, _SPECS[kind])
        reference = (d.unsqueeze(-1) * q.to(torch.float32) + m.unsqueeze(-1)).reshape(n, k)
        return _checked(plain, reference, kind, 16)
    d = _fp16(blocks[..., 0:2])
    if kind == "Q8_0":
        codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return PlainForm(codes, d, None, _SPECS[kind])
    q = _nibbles(blocks[..., -16:]).reshape(n, k)
    if kind == "Q4_0":
        return PlainForm((q.to(torch.int8) - 8), d, None, _SPECS[kind])
    m = _fp16(blocks[..., 2:4])
    zero = m + 8 * d
    inexact = (zero - 8 * d != m) | (zero - m != 8 * d)
    if bool(inexact.any()):
        i = int(inexact.reshape(-1).nonzero()[0])
        raise ValueError(
            f"Q4_1 block {i}: m + 8·d is not exact in fp32 (d={float(d.reshape(-1)[i])!r}, m={float(m.reshape(-1)[i])!r}), "
            "so torchq's float zero point cannot hold this block without loss"
        )
    return PlainForm(q.contiguous(), d, zero, _SPECS[kind])


def _pack(values: torch.Tensor, shifts: list[int]) -> torch.Tensor:
    """Inverse of :func:`_bits`: OR of ``values[..., i, :] << shifts[i]`` over the dim before the last (uint8)."""
    v = values.to(torch.uint8)
    out = torch.zeros_like(v[..., 0, :])
    for i, shift in enumerate(shifts):
        out |= v[..., i, :] << shift
    return out


def _pivot_unit(v: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    """``|pivot| / gcd(v)`` per row of ``v`` ``[B, G]`` (the values as integers over a common power of
    two): the integer of the pivot is a multiple of it in any factorization ``v = f·c``. 0 where the
    magnitudes of a row's nonzero values span more than 2^9 (no integers of at most 128 can give them)."""
    _, ex = torch.frexp(v)
    nz = v != 0
    emin = torch.where(nz, ex, 1 << 20).amin(dim=1)
    emax = torch.where(nz, ex, -(1 << 20)).amax(dim=1)
    feasible = (emax - emin) <= 9
    unit = torch.pow(2.0, (24 - emin.clamp(-1000, 1000)).to(torch.float64)).unsqueeze(1)
    m = torch.where(feasible.unsqueeze(1), v.to(torch.float64) * unit, 0.0).abs().round().to(torch.int64)
    g = m[:, 0]
    for j in range(1, m.shape[1]):
        g = torch.gcd(g, m[:, j])
    mp = torch.where(feasible, pivot.to(torch.float64).abs() * unit.squeeze(1), 0.0).round().to(torch.int64)
    return torch.where(g > 0, mp // g.clamp(min=1), 0)


def _factor(v: torch.Tensor, lo: int, hi: int, prefer: int, empty: int, kind: str, what: str,
            k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per super-block (row of ``v`` ``[B, G]``, fp32): an fp16 ``f`` ``[B]`` and integers ``c`` ``[B, G]``
    in ``[lo, hi]`` with ``f·c == v`` exactly in fp32 (ValueError naming the first block with none).

    llama.cpp's quantizers give the sub-block of largest magnitude the integer ``prefer`` (−128 for
    Q6_K, −32 for Q3_K, 63 for Q4_K / Q5_K, 15 for Q2_K), so that choice is tried first and gives the
    file's bytes back; blocks it does not fit try the other integers for their largest value, largest
    magnitude first (the sign giving a positive ``f`` first), among the multiples of its
    :func:`_pivot_unit` only. An all-zero block gets ``f = 0`` and ``c = empty`` (what llama.cpp writes)."""
    per_row = k // QK_K
    if not bool(torch.isfinite(v).all()):
        bad = int((~torch.isfinite(v)).any(dim=1).nonzero()[0])
        raise ValueError(f"plain: {kind} super-block {bad} (row {bad // per_row}) has a {what} that is not finite")
    f = torch.zeros(v.shape[0], dtype=torch.float32)
    c = torch.full(tuple(v.shape), empty, dtype=torch.int32)
    pivot = v.gather(1, v.abs().argmax(dim=1, keepdim=True)).squeeze(1)

    def attempt(idx: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
        """Fill the blocks ``idx`` that ``cand`` (their pivot's integer) factors; the mask of those."""
        vt = v[idx]
        ft = (pivot[idx] / cand).to(torch.float16).to(torch.float32)
        ct = torch.round(vt / ft.unsqueeze(1)).nan_to_num(0.0)
        ok = (ct >= lo).all(dim=1) & (ct <= hi).all(dim=1) & (ft.unsqueeze(1) * ct == vt).all(dim=1) & (ft != 0)
        f[idx[ok]], c[idx[ok]] = ft[ok], ct[ok].to(torch.int32)
        return ok

    todo = (pivot != 0).nonzero().squeeze(1)
    todo = todo[~attempt(todo, torch.full_like(pivot[todo], float(prefer)))]
    if todo.numel():
        unit = _pivot_unit(v[todo], pivot[todo])
        open_ = unit > 0
        for mag in range(max(-lo, hi), 0, -1):
            for side in (1, -1):
                sel = (open_ & (mag % unit.clamp(min=1) == 0)).nonzero().squeeze(1)
                if sel.numel():
                    cand = torch.sign(pivot[todo[sel]]) * float(side * mag)
                    open_[sel[attempt(todo[sel], cand)]] = False
        todo = todo[open_ | (unit == 0)]
    if todo.numel():
        b = int(todo[0])
        col = b % per_row * QK_K
        raise ValueError(
            f"plain: {kind} super-block {b} (row {b // per_row}, columns {col}..{col + QK_K - 1}): its sub-block {what}s "
            f"{v[b].tolist()} are not one fp16 value times integers in [{lo}, {hi}], so it has no {kind} bytes"
        )
    return f, c


def _k_quant_bytes(plain: PlainForm, kind: str) -> torch.Tensor:
    n, k = plain.shape
    nb = k // QK_K
    spec = _SPECS[kind]
    groups = QK_K // spec.block_size[1]
    s = plain.scale.to(torch.float32).reshape(n * nb, groups)
    codes = plain.codes.reshape(n, nb, QK_K)
    if kind == "Q6_K":
        d, sc = _factor(s, -128, 127, -128, 0, kind, "scale", k)
        q = (codes.to(torch.int16) + 32).to(torch.uint8)
        ql = _pack((q & 0x0F).reshape(n, nb, 2, 2, 64), [0, 4]).reshape(n, nb, 128)
        qh = _pack((q >> 4).reshape(n, nb, 2, 4, 32), [0, 2, 4, 6]).reshape(n, nb, 64)
        scales = sc.to(torch.int8).view(torch.uint8).reshape(n, nb, 16)
        return torch.cat([ql, qh, scales, _le_bytes(d.to(torch.float16), n, nb)], dim=-1).reshape(n, -1)
    if kind == "Q3_K":
        d, sc = _factor(s, -32, 31, -32, -32, kind, "scale", k)
        u = (sc + 32).to(torch.uint8).reshape(n, nb, 16)
        low = _pack((u & 0x0F).reshape(n, nb, 2, 8), [0, 4])
        high = _pack((u >> 4).reshape(n, nb, 4, 4), [0, 2, 4, 6])
        q = codes.to(torch.int16)
        hbit = (q >= 0).to(torch.uint8)
        ql = (q + 4 * (1 - hbit.to(torch.int16))).to(torch.uint8)
        hmask = _pack(hbit.reshape(n, nb, 8, 32), list(range(8)))
        qs = _pack(ql.reshape(n, nb, 2, 4, 32), [0, 2, 4, 6]).reshape(n, nb, 64)
        return torch.cat([hmask, qs, low, high, _le_bytes(d.to(torch.float16), n, nb)], dim=-1).reshape(n, -1)
    mid = (spec.quant_min + spec.quant_max + 1) // 2
    mm = mid * s - plain.zero_point.to(torch.float32).reshape(n * nb, groups)  # exact where the import's zero was
    top = 15 if kind == "Q2_K" else 63
    d, sc = _factor(s, 0, top, top, 0, kind, "scale", k)
    dmin, m = _factor(mm, 0, top, top, 0, kind, "minimum", k)
    d_bytes, dmin_bytes = _le_bytes(d.to(torch.float16), n, nb), _le_bytes(dmin.to(torch.float16), n, nb)
    sc, m = sc.to(torch.uint8).reshape(n, nb, groups), m.to(torch.uint8).reshape(n, nb, groups)
    q = codes.to(torch.uint8)
    if kind == "Q2_K":
        qs = _pack(q.reshape(n, nb, 2, 4, 32), [0, 2, 4, 6]).reshape(n, nb, 64)
        return torch.cat([sc | (m << 4), qs, d_bytes, dmin_bytes], dim=-1).reshape(n, -1)
    scales = torch.cat([(sc[..., :4] & 0x3F) | ((sc[..., 4:] >> 4) << 6), (m[..., :4] & 0x3F) | ((m[..., 4:] >> 4) << 6),
                        (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], dim=-1)
    qs = _pack((q & 0x0F).reshape(n, nb, 4, 2, 32), [0, 4]).reshape(n, nb, 128)
    if kind == "Q4_K":
        return torch.cat([d_bytes, dmin_bytes, scales, qs], dim=-1).reshape(n, -1)
    qh = _pack((q >> 4).reshape(n, nb, 8, 32), list(range(8)))
    return torch.cat([d_bytes, dmin_bytes, scales, qh, qs], dim=-1).reshape(n, -1)


def to_gguf_bytes(plain: PlainForm, kind: str) -> torch.Tensor:
    """Inverse of :func:`from_gguf_blocks`: the uint8 bytes ``[N, K/block · block bytes]`` of ``plain`` as
    GGUF ``kind`` (one of :data:`BLOCK_BYTES`; ``plain`` must have that kind's spec, see the module docstring).

    Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 come back byte for byte. The k-quants store each super-block's
    sub-block scales (and minimums) as one fp16 ``d`` (``dmin``) times small integers: those are
    recovered by factoring, choosing llama.cpp's factorization first (its largest sub-block gets the
    extreme integer), so a file's bytes come back byte for byte where llama.cpp's quantizer wrote them
    and equal values otherwise. ValueError where a block has no such bytes (e.g. scales that are not
    fp16 multiples, or an inexact float zero point); the values of the bytes written are checked to be
    the plain form's."""
    if kind not in _SPECS:
        raise ValueError(f"kind: expected one of {sorted(_SPECS)}, got {kind!r}")
    if plain.spec != _SPECS[kind]:
        raise ValueError(f"plain: {kind} needs the format {_SPECS[kind].describe()}, got {plain.spec.describe()}")
    n, k = plain.shape
    block = _elements(kind)
    if k % block:
        raise ValueError(f"plain: {kind} rows hold whole blocks of {block}, got shape {list(plain.shape)}")
    plain = plain.map(lambda t: t.detach().cpu())
    if kind in K_QUANTS:
        out = _k_quant_bytes(plain, kind)
        _check_values(out, plain, kind)
        return out
    if kind == "Q8_K":
        if plain.scale.dtype != torch.float32:
            raise ValueError(f"plain: Q8_K stores d in fp32, got scales of {plain.scale.dtype}")
        nb = k // QK_K
        sums = plain.codes.to(torch.int16).reshape(n, nb, 16, 16).sum(dim=-1, dtype=torch.int16)
        return torch.cat([_le_bytes(plain.scale, n, nb), _le_bytes(plain.codes, n, nb), _le_bytes(sums, n, nb)], dim=-1).reshape(n, -1)
    nb = k // BLOCK
    d = plain.scale.to(torch.float16)
    if not torch.equal(d.to(plain.scale.dtype), plain.scale):
        raise ValueError("plain: scales are not fp16 values (GGUF stores d in fp16)")
    d_bytes = _le_bytes(d, n, nb)
    if kind == "Q8_0":
        return torch.cat([d_bytes, _le_bytes(plain.codes, n, nb)], dim=-1).reshape(n, -1)
    mid = (plain.spec.quant_max - plain.spec.quant_min + 1) // 2  # 8 for Q4_0 / Q4_1, 16 for Q5_0 / Q5_1
    q = plain.codes.to(torch.int16).reshape(n, nb, BLOCK)
    if plain.spec.zero_point_domain is ZeroPointDomain.NONE:
        q = q + mid  # Q4_0 / Q5_0 codes are q − 8 / q − 16
    q = q.to(torch.uint8)
    qs = (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)
    head = [d_bytes]
    if plain.zero_point is not None:  # Q4_1 / Q5_1: m = zero − mid·d (exact: checked on import)
        m = (plain.zero_point.to(torch.float32) - mid * plain.scale.to(torch.float32)).to(torch.float16)
        head.append(_le_bytes(m, n, nb))
    if kind in ("Q5_0", "Q5_1"):
        head.append(_pack((q >> 4).reshape(n, nb, 4, 8).transpose(-1, -2), list(range(8))))  # element 8b + i -> byte b, bit i
    out = torch.cat([*head, qs], dim=-1).reshape(n, -1)
    if plain.zero_point is not None:
        _check_values(out, plain, kind)
    return out


def _check_values(raw: torch.Tensor, plain: PlainForm, kind: str) -> None:
    """ValueError unless the bytes ``raw`` decode (gguf-py's arithmetic) to ``plain``'s values."""
    n, k = plain.shape
    try:
        back = from_gguf_blocks(raw.reshape(-1), kind, (n, k)).dequantize(torch.float32)
    except ValueError as e:
        raise ValueError(f"plain: its {kind} bytes do not decode exactly ({e})") from None
    want = plain.dequantize(torch.float32)
    differ = (back != want) & ~(torch.isnan(back) & torch.isnan(want))
    if bool(differ.any()):
        i = int(differ.reshape(-1).nonzero()[0])
        raise ValueError(f"plain: element {i} (row {i // k}, column {i % k}) is {float(want.reshape(-1)[i])!r} but its {kind} "
                         f"bytes give {float(back.reshape(-1)[i])!r} (the float zero point is not exactly mid·scale − min)")


# -- files (needs the gguf package) ------------------------------------------------------------------
@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: ``value`` is an :class:`AffineQuantizedTensor` (or with
    ``plain=True`` its :class:`PlainForm`) for 2-D Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K-Q6_K / Q8_K
    tensors (losslessly), the tensor as stored for F32 / F16 / BF16 / F64 / I8-I64, or for other types
    (and a tensor whose float zero point is not exact) gguf-py's dequantization to fp32 (``exact`` False)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    value: torch.Tensor
    exact: bool = True


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (arrays of strings and numbers as lists), read by the
    bounded reader (:class:`~torchq.interop.gguf_file.GGUFFile`: a malformed file is a
    :class:`~torchq.CheckpointError` naming the file and the field)."""
    from .gguf_file import open_gguf

    with open_gguf(path) as f:
        return f.metadata()


def _finite(values: torch.Tensor, path: str, t: Any, what: str) -> torch.Tensor:
    """``values``, or CheckpointError naming the first element that is NaN or infinite."""
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        i = int((~torch.isfinite(values)).reshape(-1).nonzero()[0])
        raise CheckpointError(f"{path}: tensor {t.name!r} ({t.kind} {list(t.shape)}): {what} element {i} is "
                              f"{float(values.reshape(-1)[i])!r}; a model's weights must be finite")
    return values


def _dequantized(path: str, f: Any, t: Any, why: str) -> torch.Tensor:
    import warnings

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        values = torch.from_numpy(np.ascontiguousarray(dequantize(f.tensor_array(t), GGMLQuantizationType(t.type_id))))
    except NotImplementedError:  # gguf-py has no dequantizer for it (Q8_K): torchq's where it reads the blocks
        if t.kind not in BLOCK_BYTES:
            raise CheckpointError(f"{path}: tensor {t.name!r} ({t.kind}): neither gguf-py nor torchq can decode this type") from None
        raw = torch.from_numpy(f.tensor_bytes(t))
        rows = t.numel // t.shape[-1] if t.shape[-1] else 0
        values = _plain(path, t, raw, (rows, t.shape[-1])).dequantize(torch.float32)
    values = _finite(values.reshape(t.shape), path, t, "dequantized")
    warnings.warn(f"GGUF tensor {t.name!r} ({t.kind}): {why}; imported dequantized to float (gguf-py's values)",
                  GGUFDequantizedWarning, stacklevel=3)
    return values


def _plain(path: str, t: Any, raw: torch.Tensor, shape: tuple[int, int]) -> PlainForm:
    """from_gguf_blocks, a non-finite scale raised as CheckpointError naming the file and tensor."""
    try:
        return from_gguf_blocks(raw, t.kind, shape)
    except NonFiniteScaleError as e:
        raise CheckpointError(f"{path}: tensor {t.name!r} ({t.kind} {list(t.shape)}): {e}") from None


def read_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32, layout=None, plain: bool = False) -> Iterator[GGUFTensor]:
    """Yield every tensor of a GGUF file (see :class:`GGUFTensor`); quantized weights are packed
    into ``layout`` (default: the device's best for their format) with ``dtype`` as their float
    dtype (``plain=True``: their :class:`PlainForm` instead of a packed tensor); F32 / F16 / BF16 / F64
    / I8-I64 tensors come as they are. A tensor of a type torchq cannot hold exactly (IQ*, TQ*, MXFP4,
    ...; a Q4_1 / Q5_1 / Q2_K / Q4_K / Q5_K tensor whose float zero point is not exact; a quantized
    tensor that is not 2-D) comes dequantized to fp32 by gguf-py with a :class:`GGUFDequantizedWarning`
    naming it and its format.

    The whole header is checked first (:class:`~torchq.interop.gguf_file.GGUFFile`); a NaN or infinite
    block scale (``d``, ``dmin``, ``m``) or float value is a :class:`~torchq.CheckpointError` naming the
    file, the tensor and the element, as is any malformed header."""
    from .gguf_file import open_gguf

    with open_gguf(path) as f:
        yield from read_tensors(f, dtype=dtype, layout=layout, plain=plain)


def read_tensors(f: Any, *, dtype: torch.dtype = torch.float32, layout=None, plain: bool = False) -> Iterator[GGUFTensor]:
    """:func:`read_gguf` of an open :class:`~torchq.interop.gguf_file.GGUFFile`."""
    path = f.path
    for t in f.tensors:
        kind, shape = t.kind, t.shape
        if kind in BLOCK_BYTES:
            if len(shape) != 2:
                yield GGUFTensor(t.name, kind, shape, _dequantized(path, f, t, f"{len(shape)}-D"), exact=False)
                continue
            raw = torch.from_numpy(f.tensor_bytes(t))
            try:
                form = _plain(path, t, raw, shape)
            except CheckpointError:  # a non-finite scale: no form at all
                raise
            except ValueError as e:  # a float zero point that is not exact: gguf-py's values in float
                yield GGUFTensor(t.name, kind, shape, _dequantized(path, f, t, str(e)), exact=False)
                continue
            try:
                value = form if plain else AffineQuantizedTensor.from_plain(form, dtype, layout=layout, label=t.name)
            except ValueError as e:
                raise CheckpointError(f"{path}: tensor {t.name!r} ({kind} {list(shape)}): {e}") from None
            yield GGUFTensor(t.name, kind, shape, value)  # type: ignore[arg-type]
        elif kind in ("F32", "F16", "BF16"):
            raw = torch.from_numpy(f.tensor_bytes(t))
            tensor = raw.view({"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]).reshape(shape)
            yield GGUFTensor(t.name, kind, shape, _finite(tensor, path, t, "its"))
        elif kind in ("F64", "I8", "I16", "I32", "I64"):  # plain numbers, kept as they are
            tensor = torch.from_numpy(f.tensor_array(t))
            yield GGUFTensor(t.name, kind, shape, _finite(tensor, path, t, "its"))
        else:
            yield GGUFTensor(t.name, kind, shape, _dequantized(path, f, t, "torchq has no exact form for this type"), exact=False)
