"""Quantized weights under ``torch.distributed``: FSDP2 (:mod:`.fsdp`), tensor parallelism with
DTensor (:mod:`.shard_ops`, and :mod:`.collectives` for the scatter and broadcast of a source rank's
weight), and distributed checkpoints (:mod:`.checkpoint`)."""

from . import collectives, shard_ops  # noqa: F401  (register the aten and c10d ops on quantized weights)
