"""GGUF (llama.cpp) Q4_0 / Q4_1 / Q8_0 tensors <-> torchq weights, losslessly.

A GGUF weight of logical shape ``[N, K]`` (``ne0 = K`` contiguous, ``K % 32 == 0``) stores each row
as ``K / 32`` blocks of 32 elements, little-endian:

* ``Q4_0`` (18 bytes): fp16 ``d``, 16 bytes ``qs``; element ``j < 16`` is ``qs[j] & 0xF``, element
  ``j + 16`` is ``qs[j] >> 4``; value ``d · (q - 8)``;
* ``Q4_1`` (20 bytes): fp16 ``d``, fp16 ``m``, 16 bytes ``qs`` (same nibble order); value ``d · q + m``;
* ``Q8_0`` (34 bytes): fp16 ``d``, 32 int8 ``q``; value ``d · q``.

As torchq plain forms (groups of 32 along K, fp32 scales holding the fp16 values exactly):

* ``Q4_0``: codes ``q - 8`` int8 in [-8, 7], zero-point domain NONE, ``scale = d``;
* ``Q4_1``: codes ``q`` uint8 in [0, 15], zero-point domain FLOAT with ``zero = m + 8·d`` in fp32
  (torchq's ``(q - 8)·s + zero``), checked to be exact so that ``m = zero - 8·d`` comes back;
* ``Q8_0``: codes ``q`` int8 in [-128, 127], zero-point domain NONE, ``scale = d``.

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

__all__ = ["BLOCK_BYTES", "from_gguf_blocks", "to_gguf_bytes", "GGUFTensor", "read_gguf", "gguf_metadata"]

BLOCK = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
_SPECS = {
    "Q4_0": QuantSpec((1, BLOCK), -8, 7, ZeroPointDomain.NONE),
    "Q4_1": QuantSpec((1, BLOCK), 0, 15, ZeroPointDomain.FLOAT),
    "Q8_0": QuantSpec((1, BLOCK), -128, 127, ZeroPointDomain.NONE),
}


def _check(raw: torch.Tensor, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    if kind not in BLOCK_BYTES:
        raise ValueError(f"kind: expected one of {sorted(BLOCK_BYTES)}, got {kind!r}")
    n, k = shape
    if k % BLOCK:
        raise ValueError(f"shape: {kind} rows hold whole blocks of {BLOCK}, got K={k}")
    want = n * (k // BLOCK) * BLOCK_BYTES[kind]
    if raw.dtype != torch.uint8 or raw.numel() != want:
        raise ValueError(f"raw: expected {want} uint8 bytes for {kind} {list(shape)}, got {raw.dtype} with {raw.numel()}")
    return raw.reshape(n, k // BLOCK, BLOCK_BYTES[kind])


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """fp16 values from their 2 little-endian bytes (last dim), as exact fp32."""
    return b.contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def _le_bytes(t: torch.Tensor, n: int, nb: int) -> torch.Tensor:
    """The little-endian bytes of ``n·nb`` values, as uint8 ``[n, nb, itemsize]``."""
    flat = t.reshape(-1).clone(memory_format=torch.contiguous_format)  # fresh strides (size-1 dims too)
    return flat.view(torch.uint8).reshape(n, nb, -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)  # elements 0..15 low, 16..31 high


def from_gguf_blocks(raw: torch.Tensor, kind: str, shape: tuple[int, int]) -> PlainForm:
    """The plain form of a GGUF ``kind`` tensor of logical ``shape`` ``[N, K]`` from its bytes."""
    blocks = _check(raw, kind, tuple(shape))
    n, k = shape
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
    """Inverse of :func:`from_gguf_blocks`: the uint8 bytes ``[N, K/32 · block bytes]``."""
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


def read_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32, layout=None) -> Iterator[GGUFTensor]:
    """Yield every tensor of a GGUF file (see :class:`GGUFTensor`); quantized weights are packed
    into ``layout`` (default: the device's best for their format) with ``dtype`` as their float dtype."""
    import numpy as np

    reader = _reader(path)
    for t in reader.tensors:
        kind = t.tensor_type.name
        shape = tuple(int(s) for s in reversed([int(v) for v in t.shape]))  # ggml lists ne0 first
        data = np.asarray(t.data)
        if kind in BLOCK_BYTES and len(shape) == 2:
            raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy())
            plain = from_gguf_blocks(raw, kind, shape)
            value = AffineQuantizedTensor.from_plain(plain, dtype, layout=layout, label=t.name)
            yield GGUFTensor(t.name, kind, shape, value)
        elif kind in ("F32", "F16", "BF16"):
            arr = np.ascontiguousarray(data)
            tensor = torch.from_numpy(arr.copy()) if kind != "BF16" else torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
            yield GGUFTensor(t.name, kind, shape, tensor.reshape(shape))
        else:
            from gguf.quants import dequantize

            values = torch.from_numpy(np.ascontiguousarray(dequantize(data, t.tensor_type))).reshape(shape)
            yield GGUFTensor(t.name, kind, shape, values, exact=False)
