"""The quantized optimizer-state formats of :mod:`torchq.optim` and their pure-PyTorch reference.

A state tensor of ``n`` elements (the flattened, row-major local tensor) is cut into blocks of
``B`` consecutive elements (the last block may be partial). Each block stores one fp32 ``absmax``
(the largest ``|x|`` of the block) and one code per element: the index of the nearest value of a
sorted map to ``x * (1 / absmax)`` (fp32; exact fp32 midpoints of neighbouring map values, a tie
goes to the lower value; an all-zero block normalises to 0). Decoding is ``map[code] * absmax``
in fp32.

* **8-bit** (bitsandbytes' blockwise 8-bit optimizers): ``B = 256``; ``exp_avg`` with the signed
  dynamic map (``create_dynamic_map(signed=True)``), ``exp_avg_sq`` with the unsigned one
  (``signed=False``: 0, then 254 values from 3.25e-7 up, then 1.0). One uint8 code per element
  in the parameter's shape plus ``4 * ceil(n / 256)`` bytes of absmax per state:
  ``2 + 8 / 256 = 2.03125`` bytes per parameter for both states.
* **4-bit** (torchao's ``AdamW4bit``, after "Memory Efficient Optimizers with 4-bit States"):
  ``B = 128``; ``exp_avg`` with the signed 4-bit dynamic-exponent map
  (``create_dynamic_map(signed=True, max_exponent_bits=3, total_bits=4)``: 0, +-0.0055,
  +-0.0325, +-0.0775, +-0.2125, +-0.4375, +-0.6625, +-0.8875, 1.0), ``exp_avg_sq`` with the
  linear map ``k / 16, k = 1..16``, which excludes zero (a zero second moment next to a large
  one decodes to ``absmax / 16``, never to 0, so no update divides by ~eps). Two codes per
  byte: element ``2j`` in the high nibble, ``2j + 1`` in the low one, an odd tail padded with
  nibble 0; ``ceil(n / 2)`` bytes plus ``4 * ceil(n / 128)`` bytes of absmax per state:
  ``1 + 8 / 128 = 1.0625`` bytes per parameter for both states.

Sign rule (bitsandbytes' 8-bit kernel): an ``exp_avg`` value below zero whose code would be the
code of 0.0 takes the next lower code instead (the smallest negative value), so the first moment
never loses its sign; applied to both formats.

Zero-free rule (torchq's, not bitsandbytes'): an ``exp_avg_sq`` value above zero whose code would
be the code of 0.0 takes the next code up (8-bit: 3.25e-7 · absmax), so a second moment more than
~6e6 times smaller than its block's largest never decodes to 0 while its first moment does not:
the next step would divide by ~eps (30 steps of gradients ``randn · exp(2 · randn)``: 98,443 lr
from ``torch.optim.AdamW`` with nearest rounding alone, 4.6 lr with the rule). The 4-bit map holds
no 0, so the rule never applies there.

Non-finite values: a block holding NaN or +-inf is stored as the codes of 0.0 (nibble/byte 0 for
``exp_avg_sq``) with ``absmax = NaN``, so it decodes to NaN (see :class:`torchq.optim.AdamW8bit`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..blockwise.codebooks import dynamic_map

__all__ = ["StateFormat", "FORMAT_8BIT", "FORMAT_4BIT", "FORMATS", "midpoints", "quantize_state", "dequantize_state",
           "state_bytes", "pack_nibbles", "unpack_nibbles"]


def midpoints(values: torch.Tensor) -> torch.Tensor:
    """fp32 midpoints of neighbouring sorted ``values`` (computed in fp64, rounded once), as the
    ``quantize_blockwise`` op compares with."""
    v = values.double()
    return ((v[:-1] + v[1:]) / 2).float()


@dataclass(frozen=True)
class StateFormat:
    """One quantized state format: ``bits`` per code (8 or 4), ``block_size``, and the two maps
    by name (see the module docstring)."""

    name: str
    bits: int
    block_size: int

    @property
    def signed_map(self) -> torch.Tensor:
        """The sorted fp32 map of ``exp_avg``."""
        return _maps(self.bits)[0]

    @property
    def unsigned_map(self) -> torch.Tensor:
        """The sorted fp32 map of ``exp_avg_sq``."""
        return _maps(self.bits)[1]

    def code_bytes(self, n: int) -> int:
        """Bytes of the codes of an ``n``-element state."""
        return n if self.bits == 8 else (n + 1) // 2

    def blocks(self, n: int) -> int:
        """Blocks (absmax entries) of an ``n``-element state."""
        return -(-n // self.block_size)


@functools.cache
def _maps(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    if bits == 8:
        return dynamic_map(signed=True), dynamic_map(signed=False)
    return dynamic_map(signed=True, max_exponent_bits=3, total_bits=4), torch.arange(1, 17, dtype=torch.float32) / 16


FORMAT_8BIT = StateFormat("8bit", 8, 256)
FORMAT_4BIT = StateFormat("4bit", 4, 128)
FORMATS = {8: FORMAT_8BIT, 4: FORMAT_4BIT}


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[ceil(n / 2)]``: codes ``2j`` in the high nibble, ``2j + 1`` in the low (pad 0)."""
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.reshape(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` 4-bit codes (uint8) of :func:`pack_nibbles`' bytes."""
    return torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1)[:n]


def quantize_state(x: torch.Tensor, fmt: StateFormat, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8, absmax fp32 [nb])`` of the fp32 state ``x`` (flattened) in ``fmt``: codes
    ``[n]`` for 8 bits, packed ``[ceil(n / 2)]`` for 4; ``signed``: ``exp_avg``'s map and sign
    rule, else ``exp_avg_sq``'s map. Runs ``torch.ops.torchq.quantize_blockwise``."""
    flat = x.reshape(-1).float()
    n, block = flat.numel(), fmt.block_size
    code = fmt.signed_map if signed else fmt.unsigned_map
    nb = fmt.blocks(n)
    padded = torch.cat([flat, flat.new_zeros(nb * block - n)]) if nb * block != n else flat
    finite = torch.isfinite(padded.reshape(nb, block)).all(dim=1)
    all_finite = bool(finite.all())
    if not all_finite:
        padded = torch.where(finite[:, None], padded.reshape(nb, block), 0.0).reshape(-1)
    codes, absmax = torch.ops.torchq.quantize_blockwise(padded, code.to(flat.device), block)
    codes = codes[:n]
    zero = int(torch.nonzero(code == 0)[0, 0]) if bool((code == 0).any()) else None
    if signed and zero:  # the sign rule
        codes = torch.where((padded[:n] < 0) & (codes == zero), zero - 1, codes.int()).to(torch.uint8)
    elif not signed and zero is not None and zero + 1 < code.numel():  # the zero-free rule
        codes = torch.where((padded[:n] > 0) & (codes == zero), zero + 1, codes.int()).to(torch.uint8)
    if not all_finite:
        absmax = torch.where(finite, absmax, float("nan"))
    return (codes if fmt.bits == 8 else pack_nibbles(codes)), absmax


def dequantize_state(codes: torch.Tensor, absmax: torch.Tensor, n: int, fmt: StateFormat, signed: bool) -> torch.Tensor:
    """The fp32 ``[n]`` values of :func:`quantize_state`'s ``(codes, absmax)``. Runs
    ``torch.ops.torchq.dequantize_blockwise``."""
    idx = codes.reshape(-1)[:n] if fmt.bits == 8 else unpack_nibbles(codes.reshape(-1), n)
    code = fmt.signed_map if signed else fmt.unsigned_map
    return torch.ops.torchq.dequantize_blockwise(idx, absmax, code.to(codes.device), fmt.block_size, torch.float32)


def state_bytes(n: int, fmt: StateFormat | None) -> int:
    """Bytes of both AdamW states of an ``n``-element parameter (``fmt`` None: fp32 states)."""
    if fmt is None:
        return 8 * n
    return 2 * (fmt.code_bytes(n) + 4 * fmt.blocks(n))
