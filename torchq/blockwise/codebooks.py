"""Codebooks of the bitsandbytes-compatible blockwise formats (all fp32).

* ``NF4``: the 16 NormalFloat-4 values, sorted, index = nibble (``NF4[7] == 0``).
* ``FP4``: bitsandbytes' own 4-bit float (not OCP E2M1): bit 3 is the sign, the low 3 bits
  index the magnitudes ``0, 0.0625, 8, 12, 4, 6, 2, 3`` divided by 12.
* :func:`dynamic_map`: the 8-bit "dynamic" map used for 8-bit blockwise quantization and for
  double quantization of 4-bit absmax statistics (``dynamic_map()[0] == -0.99296875``,
  ``[127] == 0``, ``[255] == 1``).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["NF4", "FP4", "FP4_MAGNITUDES", "codebook", "dynamic_map", "QUANT_TYPES"]

NF4 = torch.tensor(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0],
    dtype=torch.float32,
)
FP4_MAGNITUDES = torch.tensor([0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0], dtype=torch.float32) / 12
FP4 = torch.cat([FP4_MAGNITUDES, -FP4_MAGNITUDES])  # nibble 8 is -0.0: same value as nibble 0
QUANT_TYPES = ("nf4", "fp4")


def codebook(quant_type: str) -> torch.Tensor:
    """The 16 fp32 values of ``quant_type`` ("nf4" or "fp4"), index = nibble."""
    if quant_type == "nf4":
        return NF4
    if quant_type == "fp4":
        return FP4
    raise ValueError(f"quant_type: expected 'nf4' or 'fp4', got {quant_type!r}")


@functools.cache
def _dynamic_map_values(signed: bool, max_exponent_bits: int, total_bits: int) -> tuple[float, ...]:
    # For each exponent e (0 .. max_exponent_bits-1) the map holds the midpoints of an even split
    # of [0.1, 1] into 2^(e + fraction bits) parts, scaled by 10^(e - max_exponent_bits + 1); the
    # signed map mirrors them. What is left of the 2^total_bits values after 0 and 1.0 are added
    # (when the exponent bits do not use all of them) is filled with zeros, then all are sorted.
    fraction_bits = total_bits - 1 - max_exponent_bits
    values: list[float] = []
    for e in range(max_exponent_bits):
        parts = 2 ** (e + fraction_bits + (0 if signed else 1))
        edges = torch.linspace(0.1, 1, parts + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10.0 ** (e - max_exponent_bits + 1)
        values += (scale * mids).tolist()
        if signed:
            values += (-scale * mids).tolist()
    extra = 2**fraction_bits - 1  # values with all exponent bits zero: the top decade again
    if extra > 0:
        edges = torch.linspace(0.1, 1, extra + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 1.0
        values += (scale * mids).tolist()
        if signed:
            values += (-scale * mids).tolist()
    values += [0.0, 1.0]
    if len(values) > 2**total_bits:
        raise ValueError(f"dynamic map: {len(values)} values do not fit {total_bits} bits")
    values += [0.0] * (2**total_bits - len(values))
    return tuple(sorted(values))


def dynamic_map(signed: bool = True, max_exponent_bits: int = 7, total_bits: int = 8) -> torch.Tensor:
    """bitsandbytes' dynamic quantization map (``create_dynamic_map``), sorted fp32 ``[2^total_bits]``."""
    return torch.tensor(_dynamic_map_values(signed, max_exponent_bits, total_bits), dtype=torch.float32)
