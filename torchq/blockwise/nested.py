"""Double quantization of 4-bit absmax statistics ("nested" / ``compress_statistics``).

``offset = mean(absmax)`` (fp32); ``absmax - offset`` is quantized with the signed 8-bit dynamic
map in blocks of 256 (:func:`torch.ops.torchq.quantize_blockwise`). Reconstruction:
``absmax[i] = dyn[q[i]] * absmax2[i // 256] + offset`` in fp32.

Bytes per weight with ``nb`` 4-bit blocks: ``nb`` uint8 codes + ``ceil(nb / 256)`` fp32 + one
fp32 offset, instead of ``4 * nb`` for plain fp32 absmax.
"""

from __future__ import annotations

import torch

from .codebooks import dynamic_map

__all__ = ["NESTED_BLOCKSIZE", "double_quantize", "double_dequantize"]

NESTED_BLOCKSIZE = 256


def double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes uint8 [nb], absmax2 fp32 [ceil(nb/256)], offset fp32 0-d)`` of fp32 ``absmax``."""
    if absmax.dtype != torch.float32 or absmax.dim() != 1 or absmax.numel() == 0:
        raise ValueError(f"absmax: expected a non-empty 1-D fp32 tensor, got {absmax.dtype} {list(absmax.shape)}")
    # the mean as the CPU reduces it, wherever absmax lives: a GPU's reduction order gives other bits
    # (meta tensors, e.g. a model built on the meta device, hold no values to copy)
    on_cpu = absmax.device.type in ("cpu", "meta")
    offset = absmax.mean() if on_cpu else absmax.cpu().mean().to(absmax.device)
    codes, absmax2 = torch.ops.torchq.quantize_blockwise(absmax - offset, dynamic_map().to(absmax.device), NESTED_BLOCKSIZE)
    return codes, absmax2, offset


def double_dequantize(codes: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor, code: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 absmax from its double-quantized form (``code``: the 256-value map, default dynamic)."""
    code = dynamic_map().to(codes.device) if code is None else code
    return torch.ops.torchq.dequantize_blockwise(codes, absmax2, code, NESTED_BLOCKSIZE, torch.float32) + offset
