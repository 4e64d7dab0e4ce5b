"""A torchq checkpoint folder as vLLM serves it: its header read and every byte checked, before
vLLM builds the model (imports no vLLM).

vLLM reads ``config.json`` and builds the quantization config in its front process, then loads the
weights in its worker processes. :class:`ServedCheckpoint` runs in the front process
(``TorchqVllmConfig.maybe_update_config``): it opens the folder with :func:`torchq.load_quantized`'s
checks (``checked_entries``: the torchq header's CRC, the files it names against the index, no
name stored twice, every record parsed), checks that each quantized part is stored in the dtype
and shape its record gives (a worker allocates what the record says before reading a byte), that
every alias names a stored tensor and that the folder holds no ``*.safetensors`` file vLLM would
load beside the checkpoint's, and checks the CRC-32 of every stored tensor, quantized parts and
float tensors alike, reading ``CRC_CHUNK_BYTES`` at a time. A bad folder is refused there with a
:class:`torchq.CheckpointError` naming the file and tensor, before any worker starts. Workers
check each quantized part's CRC again on the bytes they actually load (:mod:`torchq.vllm.method`).

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
from ..checkpoint.safetensors_io import INDEX_NAME, checked_entries, checkpoint_files, part_key
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
        with contextlib.ExitStack() as stack:
            files, weight_map = checkpoint_files(self.path)
            if self.path.is_dir():
                # vLLM loads only consolidated*.safetensors files where there are any (Mistral's
                # format), and without an index every *.safetensors file of the folder
                ours = {f.name for f in files}
                extra = sorted(p.name for p in self.path.glob("*.safetensors")
                               if p.name not in ours and (weight_map is None or p.name.startswith("consolidated")))
                if extra:
                    raise CheckpointError(
                        f"{self.path}: holds {extra} beside the checkpoint's {sorted(ours)}; vLLM would load "
                        f"{'them' if weight_map is not None else 'every *.safetensors file of a folder without ' + INDEX_NAME} "
                        f"unchecked, so serve a folder holding only the checkpoint's files"
                    )
            entries, self.aliases = checked_entries(
                self.path, stack, require_header="config.json says quant_method 'torchq' (save the model with "
                                                 "save_pretrained after torchq.quantize_, or torchq.save_quantized)")
            readers: dict[int, SliceReader] = {}
            for f, kind, name, entry in entries:
                reader = readers.get(id(f))
                if reader is None:
                    reader = readers[id(f)] = SliceReader(f)
                if kind == "quantized":
                    try:
                        rec = codec.parse_record(entry, name)
                    except CheckpointError as e:
                        raise CheckpointError(f"{f.path}: {e}") from None
                    for part, (dtype, shape, crc) in rec.parts.items():
                        key = part_key(name, part)
                        # the record sizes what each worker allocates: the file must hold exactly that
                        stored_dtype, stored_shape = reader.stored(key)
                        if stored_dtype != dtype or stored_shape != shape:
                            raise CheckpointError(
                                f"{f.path}: quantized tensor {name!r}: part {part!r} is stored as "
                                f"{stored_dtype} {list(stored_shape)}, its record says {dtype} {list(shape)}")
                        if verify and (crc is None or reader.crc32(key) != crc):
                            raise CheckpointError(f"{f.path}: quantized tensor {name!r}: part {part!r} is corrupted "
                                                  f"(crc32 mismatch)")
                    self.records[name] = entry
                else:
                    if verify:
                        crc = entry.get("crc32") if isinstance(entry, dict) else None
                        if crc is None or reader.crc32(name) != crc:
                            raise CheckpointError(f"{f.path}: tensor {name!r} is corrupted (crc32 mismatch)")
                    self.floats.add(name)
            dangling = sorted(a for a, t in self.aliases.items() if t not in self.records and t not in self.floats)
            if dangling:
                raise CheckpointError(f"{self.path}: aliases {dangling[:8]} name tensors the checkpoint does not store "
                                      f"({[self.aliases[a] for a in dangling[:8]]})")

    def record(self, name: str) -> ParsedRecord | None:
        """The parsed record of quantized weight ``name`` (an alias resolves to its target), or None."""
        name = self.aliases.get(name, name)
        raw = self.records.get(name)
        return None if raw is None else codec.parse_record(raw, name)

    def holds(self, name: str) -> bool:
        """Whether the checkpoint stores ``name`` at all (quantized, float or as an alias)."""
        return name in self.records or name in self.floats or name in self.aliases

    def stores(self, name: str) -> bool:
        """Whether the checkpoint stores ``name`` under its own name (vLLM loads only such tensors:
        an alias is a name in the header, not a tensor in a file)."""
        return name in self.records or name in self.floats


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
