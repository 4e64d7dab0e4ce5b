"""Moved to :mod:`torchq.hf.gguf` (``torchq.hf.from_gguf``); this alias of the old path warns and
will be removed."""

from __future__ import annotations

import warnings

from ..hf.gguf import from_gguf

__all__ = ["from_gguf"]

warnings.warn("torchq.interop.gguf_transformers moved to torchq.hf.gguf (torchq.hf.from_gguf)", DeprecationWarning,
              stacklevel=2)
