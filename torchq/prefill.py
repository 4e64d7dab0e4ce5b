"""Prefill-sized (many-row) quantized linears on the CPU: dequantize weight tiles, then GEMM.

For more than a few activation rows a fused dequantize-and-dot kernel stops being bound by
memory and loses to a GEMM library, so the native kernels switch to this: weight rows are
dequantized natively tile by tile (L2-sized, into a reused per-thread buffer) and multiplied with
``torch.mm`` (oneDNN / MKL) straight into the columns of a contiguous ``[M, N]`` output. The tiles
hold the reference's weight values exactly; the GEMM runs in bf16 for bf16 inputs on CPUs with
native bf16 matmul (AMX or AVX512_BF16, where that is the fastest float path), else in fp32 (on
other CPUs fp32 GEMMs beat bf16 ones by 2-4x).

``TORCHQ_FAST_BF16_MATMUL=0|1`` (read at import) overrides the CPU detection, so a machine with
bf16 matmul can run the path other CPUs take and the reverse; tests set :data:`FAST_BF16_MATMUL`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

__all__ = ["FUSED_MAX_M", "PANEL_MAX_M", "FAST_BF16_MATMUL", "tile_dtype", "use_tiles", "tiled_linear"]

# Activation rows up to which the fused (decode) kernels run. Above, fp32 GEMMs up to
# PANEL_MAX_M rows still run the native kernels (register-tiled over activation rows, each weight
# decoded once per 4 rows), which beat dequantize + GEMM there; everything else takes tiles + GEMM.
FUSED_MAX_M = 4
PANEL_MAX_M = 16
_TILE_BYTES = 8 << 20
_SCRATCH = threading.local()


def _fast_bf16_matmul() -> bool:
    """``TORCHQ_FAST_BF16_MATMUL`` if set (0/1), else whether the CPU has AMX or AVX512_BF16."""
    forced = os.environ.get("TORCHQ_FAST_BF16_MATMUL", "").strip().lower()
    if forced in ("0", "false", "off", "no"):
        return False
    if forced in ("1", "true", "on", "yes"):
        return True
    if forced:
        raise ValueError(f"TORCHQ_FAST_BF16_MATMUL: expected 0 or 1 (or unset), got {forced!r}")
    cpu = getattr(torch, "cpu", None)
    return bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)() or getattr(cpu, "_is_avx512_bf16_supported", lambda: False)())


FAST_BF16_MATMUL = _fast_bf16_matmul()


def tile_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The GEMM dtype for activations of ``x_dtype``: bf16 for bf16 on fast-bf16 CPUs, else fp32."""
    return torch.bfloat16 if x_dtype == torch.bfloat16 and FAST_BF16_MATMUL else torch.float32


def use_tiles(m: int, x_dtype: torch.dtype, native_gemm: bool = False) -> bool:
    """Whether ``m`` activation rows of ``x_dtype`` go to dequantized tiles + GEMM. ``native_gemm``:
    the kernel has a native fp32 GEMM path (the lut4 and int8 weight-only kernels on AVX2 / AVX-512),
    which beats tiles + GEMM
    whenever the tiles would be fp32."""
    if native_gemm and tile_dtype(x_dtype) == torch.float32:
        return False
    return m > FUSED_MAX_M and (tile_dtype(x_dtype) == torch.bfloat16 or m > PANEL_MAX_M)


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread reusable buffer (fresh large allocations cost more in page faults than the work)."""
    key = f"buf_{dtype}"
    buf = getattr(_SCRATCH, key, None)
    if buf is None or buf.numel() < numel:
        # a normal tensor even when first made under torch.inference_mode(): an inference tensor could
        # not be written in place by a later call outside it
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=dtype)
        setattr(_SCRATCH, key, buf)
    return buf[:numel]


DequantRows = Callable[[int, int, torch.Tensor], None]


def tiled_linear(rows: torch.Tensor, n: int, k: int, dequant_rows: DequantRows, dtype: torch.dtype,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[M, N] = rows @ W.T (+ bias)`` in ``out_dtype``: the GEMM's ``dtype`` output, then (+ an fp32
    bias, in fp32) rounded to ``out_dtype``. ``dequant_rows(n0, n1, out)`` writes weight rows
    ``[n0, n1)`` into ``out`` (``[n1 - n0, k]`` contiguous, in ``dtype``: fp32 or bf16). Without a
    bias a bf16 GEMM's bf16 output is returned as it is (its fp32 round trip is exact: at 256 rows
    of a 3072 x 576 layer it cost as much as dequantizing the weight)."""
    x = rows.to(dtype)
    # the ops promise contiguous outputs (their fake kernels say so): each tile's GEMM writes its
    # columns of a row-major [M, N] (as fast as a transposed output, and no copy afterwards)
    out = torch.empty(rows.shape[0], n, dtype=dtype)
    tile = max(64, _TILE_BYTES // (k * dtype.itemsize) // 64 * 64)
    buf = _scratch(min(tile, n) * k, dtype)
    for n0 in range(0, n, tile):
        n1 = min(n, n0 + tile)
        w = buf[: (n1 - n0) * k].view(n1 - n0, k)
        dequant_rows(n0, n1, w)
        torch.mm(x, w.t(), out=out[:, n0:n1])
    if bias is None:
        return out.to(out_dtype)
    return out.to(torch.float32).add_(bias).to(out_dtype)  # out is this call's own: the bias goes in in place
