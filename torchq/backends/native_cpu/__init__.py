"""torchq's native CPU kernels as implementations of :mod:`torchq.ops` (the library is loaded
by :mod:`torchq.native`; without it each op runs its reference, with a one-time warning)."""

from . import int8

__all__ = ["int8"]
