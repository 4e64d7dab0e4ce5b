"""GGUF (llama.cpp) Q4_0 / Q4_1 / Q8_0 tensors <-> torchq weights, losslessly.

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

The k-quants (super-blocks of 256 elements along a row, ``K % 256 == 0``; ``d``, ``dmin`` fp16,
sub-block scales ``sc`` and minimums ``m`` small integers; values computed in fp32 as gguf-py does):

* ``Q4_K`` (144 bytes): ``d``, ``dmin``, 12 bytes of eight 6-bit ``sc`` / ``m``, 128 bytes of
  nibbles (32-byte chunk ``j``: sub-block ``2j`` low nibbles, ``2j+1`` high); value
  ``(d·sc)·q − dmin·m``, ``q`` in [0, 15]: codes ``q`` uint8, group 32, FLOAT zero point
  ``zero = 8·s − dmin·m`` (``s = d·sc``, exact in fp32);
* ``Q5_K`` (176 bytes): as ``Q4_K`` plus 32 bytes ``qh`` (bit ``i`` of byte ``l`` is the fifth bit of
  element ``l`` of sub-block ``i``); ``q`` in [0, 31], FLOAT zero ``16·s − dmin·m``;
* ``Q6_K`` (210 bytes): 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 ``sc``, ``d``; value
  ``(d·sc)·(q − 32)``: codes int8 [-32, 31], group 16, zero-point domain NONE, ``scale = d·sc``;
* ``Q3_K`` (110 bytes): 32 bytes ``hmask``, 64 bytes of 2-bit lows, 12 bytes of sixteen 6-bit ``sc``,
  ``d``; value ``(d·(sc − 32))·q``, ``q`` in [-4, 3]: codes int8, group 16, domain NONE;
* ``Q2_K`` (84 bytes): 16 bytes of 4-bit ``sc`` / ``m`` pairs, 64 bytes of 2-bit ``q``, ``d``,
  ``dmin``; value ``(d·sc)·q − dmin·m``, ``q`` in [0, 3]: group 16, FLOAT zero ``2·s − dmin·m``.

A FLOAT zero point reproduces ``s·q − dmin·m`` bit for bit only where ``mid·s − dmin·m`` is exact in
fp32 (and gives +0.0 where a negative ``d`` makes gguf-py's zero −0.0); :func:`from_gguf_blocks` checks every value of the tensor against gguf-py's arithmetic and
raises ValueError where one differs (the file readers then keep that tensor in float, warned).
The k-quants import only (their sub-block scales are not recoverable from a plain form).

Each dequantized value is then, bit for bit, what gguf-py / llama.cpp's reference dequantizer
computes in fp32 (one product, plus one rounding for Q4_1's ``+ m``), and :func:`to_gguf_bytes`
writes the original bytes back. Reading files needs the ``gguf`` package (``pip install gguf``);
the block conversions themselves need only torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..canonical import PlainForm, QuantSpec
from ..primitives import ZeroPointDomain
from ..tensor import AffineQuantizedTensor

__all__ = ["BLOCK_BYTES", "K_QUANTS", "GGUFDequantizedWarning", "from_gguf_blocks", "to_gguf_bytes", "GGUFTensor", "read_gguf",
           "gguf_metadata"]

BLOCK = 32
QK_K = 256  # k-quant super-block
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
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
}


class GGUFDequantizedWarning(UserWarning):
    """A GGUF tensor was imported dequantized to float: its format has no exact torchq form."""


def _check(raw: torch.Tensor, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    if kind not in BLOCK_BYTES:
        raise ValueError(f"kind: expected one of {sorted(BLOCK_BYTES)}, got {kind!r}")
    n, k = shape
    block = QK_K if kind in K_QUANTS else BLOCK
    if n < 0 or k <= 0 or k % block:
        raise ValueError(f"shape: {kind} rows hold whole blocks of {block}, got {list(shape)}")
    want = n * (k // block) * BLOCK_BYTES[kind]
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.numel() != want:
        got = f"{raw.dtype} with {raw.numel()}" if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise ValueError(f"raw: expected {want} uint8 bytes for {kind} {list(shape)}, got {got}")
    return raw.reshape(n, k // block, BLOCK_BYTES[kind])


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


def to_gguf_bytes(plain: PlainForm, kind: str) -> torch.Tensor:
    """Inverse of :func:`from_gguf_blocks` for Q4_0 / Q4_1 / Q8_0: the uint8 bytes ``[N, K/32 · block bytes]``."""
    if kind in K_QUANTS or kind in ("Q5_0", "Q5_1"):
        raise ValueError(f"kind: {kind} imports only (its sub-block scales and minimums are not recoverable from a plain "
                         f"form); export to Q4_0, Q4_1 or Q8_0")
    if plain.spec != _SPECS.get(kind):
        raise ValueError(f"plain: {kind} needs the format {_SPECS[kind].describe() if kind in _SPECS else kind}, got {plain.spec.describe()}")
    n, k = plain.shape
    nb = k // BLOCK
    d = plain.scale.to(torch.float16)
    if not torch.equal(d.to(plain.scale.dtype), plain.scale):
        raise ValueError("plain: scales are not fp16 values (GGUF stores d in fp16)")
    d_bytes = _le_bytes(d, n, nb)
    if kind == "Q8_0":
        return torch.cat([d_bytes, _le_bytes(plain.codes, n, nb)], dim=-1).reshape(n, -1)
    q = plain.codes.to(torch.int16).reshape(n, nb, BLOCK)
    if kind == "Q4_0":
        q = q + 8
    q = q.to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    if kind == "Q4_0":
        return torch.cat([d_bytes, qs], dim=-1).reshape(n, -1)
    m = (plain.zero_point.to(torch.float32) - 8 * plain.scale.to(torch.float32)).to(torch.float16)
    return torch.cat([d_bytes, _le_bytes(m, n, nb), qs], dim=-1).reshape(n, -1)


# -- files (needs the gguf package) ------------------------------------------------------------------
@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: ``value`` is an :class:`AffineQuantizedTensor` for Q4_0 / Q4_1 /
    Q8_0 (losslessly), a float tensor for F32 / F16 / BF16, or for other types gguf-py's
    dequantization to fp32 (``exact`` False)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    value: torch.Tensor
    exact: bool = True


def _reader(path: str | Path):
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ImportError("reading GGUF files needs the gguf package: pip install gguf") from e
    return GGUFReader(str(path))


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF file (arrays of strings and numbers as lists)."""
    reader = _reader(path)
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        try:
            out[name] = field.contents()
        except Exception:  # a type gguf-py cannot render: skip it rather than fail the whole read
            continue
    return out


def _dequantized(t: Any, kind: str, shape: tuple[int, ...], why: str) -> torch.Tensor:
    import warnings

    import numpy as np
    from gguf.quants import dequantize

    warnings.warn(f"GGUF tensor {t.name!r} ({kind}): {why}; imported dequantized to float (gguf-py's values)",
                  GGUFDequantizedWarning, stacklevel=3)
    return torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type))).reshape(shape)


def read_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32, layout=None, plain: bool = False) -> Iterator[GGUFTensor]:
    """Yield every tensor of a GGUF file (see :class:`GGUFTensor`); quantized weights are packed
    into ``layout`` (default: the device's best for their format) with ``dtype`` as their float
    dtype (``plain=True``: their :class:`PlainForm` instead of a packed tensor). A tensor of a type
    torchq cannot hold exactly (IQ*, Q5_0, ...; a k-quant block whose float zero point is not exact)
    comes dequantized to fp32 with a :class:`GGUFDequantizedWarning` naming it and its format."""
    import numpy as np

    reader = _reader(path)
    for t in reader.tensors:
        kind = t.tensor_type.name
        shape = tuple(int(s) for s in reversed([int(v) for v in t.shape]))  # ggml lists ne0 first
        data = np.asarray(t.data)
        if kind in BLOCK_BYTES:
            if len(shape) != 2:
                yield GGUFTensor(t.name, kind, shape, _dequantized(t, kind, shape, f"{len(shape)}-D"), exact=False)
                continue
            raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy())
            try:
                form = from_gguf_blocks(raw, kind, shape)
            except ValueError as e:
                yield GGUFTensor(t.name, kind, shape, _dequantized(t, kind, shape, str(e)), exact=False)
                continue
            value = form if plain else AffineQuantizedTensor.from_plain(form, dtype, layout=layout, label=t.name)
            yield GGUFTensor(t.name, kind, shape, value)  # type: ignore[arg-type]
        elif kind in ("F32", "F16", "BF16"):
            arr = np.ascontiguousarray(data)
            tensor = torch.from_numpy(arr.copy()) if kind != "BF16" else torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
            yield GGUFTensor(t.name, kind, shape, tensor.reshape(shape))
        else:
            yield GGUFTensor(t.name, kind, shape, _dequantized(t, kind, shape, "torchq has no exact form for this type"),
                             exact=False)
