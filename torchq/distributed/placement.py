"""Where a quantized weight lives across ranks: DTensor placements, each rank's piece of a sharded
dimension, and putting a loaded weight into a model. Shared by :mod:`.checkpoint` and
:mod:`.sharded_file`."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..tensor import AQT

__all__ = ["dtensor_types", "local_and_placement", "shard_width", "set_weight"]


def dtensor_types():
    """``(DTensor, Replicate, Shard)``, imported when first needed."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor, Replicate, Shard


def local_and_placement(value: Any) -> tuple[AQT | None, Any, Any]:
    """``(local quantized weight, mesh, placement)``: placement None for a whole (non-DTensor)
    weight; ``(None, None, None)`` for anything that is not a quantized weight."""
    if isinstance(value, AQT):
        return value, None, None
    DTensor, Replicate, Shard = dtensor_types()
    if isinstance(value, DTensor) and isinstance(value._local_tensor, AQT):
        if len(value.placements) != 1:
            raise NotImplementedError(
                f"torchq: quantized weight on a {len(value.placements)}-D device mesh ({value.placements}): distributed "
                f"checkpoints of quantized weights support 1-D meshes (FSDP2 or tensor parallelism)"
            )
        placement = value.placements[0]
        if not isinstance(placement, (Shard, Replicate)):
            raise NotImplementedError(f"torchq: quantized weight with placement {placement}: expected Shard or Replicate")
        return value._local_tensor, value.device_mesh, placement
    return None, None, None


def shard_width(total: int, mesh: Any) -> tuple[int, int]:
    """``(offset, length)`` of this rank's ``torch.chunk`` piece of ``total`` (DTensor's rule)."""
    world, rank = mesh.size(), mesh.get_local_rank()
    chunk = -(-total // world) if total else 0
    start = min(total, rank * chunk)
    return start, min(total, start + chunk) - start


def set_weight(model: nn.Module, name: str, w: AQT) -> None:
    """Put ``w`` at ``name`` in ``model`` (a frozen parameter where a parameter was)."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    old = getattr(owner, attr)
    if isinstance(old, nn.Parameter):
        owner.register_parameter(attr, nn.Parameter(w, requires_grad=False))
    else:
        setattr(owner, attr, w)
