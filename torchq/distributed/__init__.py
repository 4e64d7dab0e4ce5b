"""Quantized weights under ``torch.distributed``: FSDP2 (:mod:`.fsdp`), tensor parallelism with
DTensor (:mod:`.shard_ops`), and distributed checkpoints (:mod:`.checkpoint`)."""

from . import shard_ops  # noqa: F401  (registers the sharding aten ops on quantized weights)
