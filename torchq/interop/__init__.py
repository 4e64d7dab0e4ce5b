"""Conversions to and from other libraries' formats (no runtime dependency on them)."""

from .bitsandbytes import from_bitsandbytes, to_bitsandbytes

__all__ = ["from_bitsandbytes", "to_bitsandbytes"]
