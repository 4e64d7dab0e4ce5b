"""A torchq checkpoint folder as vLLM serves it: its header read and every byte checked, before
vLLM builds the model (imports no vLLM).

vLLM reads ``config.json`` and builds the quantization config in its front process, then loads the
weights in its worker processes. :class:`ServedCheckpoint` runs in the front process
(``TorchqVllmConfig.maybe_update_config``): it opens the folder as :func:`torchq.load_quantized`
does (the torchq header's CRC, the files it names, every record parsed) and checks the CRC-32 of
every stored tensor, quantized parts and float tensors alike, reading ``CRC_CHUNK_BYTES`` at a
time. A corrupted folder is refused there with a :class:`torchq.CheckpointError` naming the file
and tensor, before any worker starts. Workers check each quantized part's CRC again on the bytes
they actually load (:mod:`torchq.vllm.method`).

What it keeps is small and picklable (vLLM sends the config to its workers): the raw record of
each quantized weight and the names of the float ones.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from ..checkpoint import codec
from ..checkpoint.codec import CheckpointError, ParsedRecord
from ..checkpoint.safetensors_io import CheckpointFile, WholeCheckpoint, checkpoint_files, part_key
from ..distributed.sharded_file import SliceReader

__all__ = ["ServedCheckpoint", "local_folder"]


class ServedCheckpoint:
    """The quantized records and float names of a torchq checkpoint folder (``path``).

    ``records``: state-dict name -> raw record (JSON object, see :mod:`torchq.checkpoint.codec`);
    ``floats``: names stored as float tensors; ``aliases``: tied names -> stored name.
    ``verify``: check the CRC-32 of every stored tensor now (the default)."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True) -> None:
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        self.floats: set[str] = set()
        self.aliases: dict[str, str] = {}
        with contextlib.ExitStack() as stack:
            files, _ = checkpoint_files(self.path)
            opened: list[CheckpointFile | WholeCheckpoint] = [CheckpointFile(f, stack) for f in files]
            if any(f.whole for f in opened):
                opened = [WholeCheckpoint(self.path, opened)]
            for f in opened:
                if f.plain:
                    raise CheckpointError(
                        f"{f.path}: config.json says quant_method 'torchq', but this file has no torchq header "
                        f"(save the model with save_pretrained after torchq.quantize_, or torchq.save_quantized)"
                    )
                reader = SliceReader(f)
                for name, raw in f.header["quantized"].items():
                    try:
                        rec = codec.parse_record(raw, name)
                    except CheckpointError as e:
                        raise CheckpointError(f"{f.path}: {e}") from None
                    if verify:
                        for part, (_, _, crc) in rec.parts.items():
                            if crc is None or reader.crc32(part_key(name, part)) != crc:
                                raise CheckpointError(f"{f.path}: quantized tensor {name!r}: part {part!r} is corrupted "
                                                      f"(crc32 mismatch)")
                    self.records[name] = raw
                for name, entry in f.header["float"].items():
                    if verify:
                        crc = entry.get("crc32") if isinstance(entry, dict) else None
                        if crc is None or reader.crc32(name) != crc:
                            raise CheckpointError(f"{f.path}: tensor {name!r} is corrupted (crc32 mismatch)")
                    self.floats.add(name)
                for alias, target in f.header["aliases"].items():
                    if not (isinstance(alias, str) and isinstance(target, str)):
                        raise CheckpointError(f"{f.path}: torchq header 'aliases' must map names to names")
                    self.aliases[alias] = target

    def record(self, name: str) -> ParsedRecord | None:
        """The parsed record of quantized weight ``name`` (an alias resolves to its target), or None."""
        name = self.aliases.get(name, name)
        raw = self.records.get(name)
        return None if raw is None else codec.parse_record(raw, name)

    def holds(self, name: str) -> bool:
        """Whether the checkpoint stores ``name`` at all (quantized, float or as an alias)."""
        return name in self.records or name in self.floats or name in self.aliases


def local_folder(model: str, revision: str | None = None) -> Path:
    """The local folder of ``model``: the folder itself, or its Hugging Face Hub snapshot (the
    safetensors files and JSON, downloaded now, where vLLM's loader will find them)."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, allow_patterns=["*.safetensors", "*.json"]))
    except Exception as e:  # no such repository, offline, no huggingface_hub
        raise CheckpointError(f"{model}: not a local folder, and its Hugging Face Hub snapshot is unavailable ({e})") from None
