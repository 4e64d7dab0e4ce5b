"""torchq's native CPU kernels: the C++ library built from ``csrc/`` when the package is installed.

The library has a plain C ABI (no torch or Python headers), is loaded with :mod:`ctypes`,
and is called from the CPU implementations of ``torchq::`` ops (:mod:`torchq.backends.native_cpu`) whose pure-PyTorch references
stay the fallback. It picks AVX-512, AVX2+FMA or a portable path at run time and splits calls over
``torch.get_num_threads()`` threads: PyTorch's own OpenMP threads where it was built with OpenMP,
else (and with ``TORCHQ_NATIVE_POOL=own``, and in a forked child) a small pool of its own.

* :func:`status` says whether it is active, from where, with which ISA, or why not.
* ``TORCHQ_NATIVE=0`` keeps it from loading; ``TORCHQ_NATIVE_ISA=avx2|scalar`` caps the ISA;
  ``TORCHQ_NATIVE_POOL=own`` selects the library's own thread pool, whose threads
  ``TORCHQ_NATIVE_SPIN_US`` lets spin that long for the next call (default 0).
  ``TORCHQ_NATIVE_VNNI=0`` and ``TORCHQ_NATIVE_AVX512BF16=0`` turn off the optional AVX-512 kernels
  (int8 and the int4a8 / nf4a8 GEMM with VNNI; int4 tables with bf16 scales built by AVX512_BF16), so a CPU that has them also
  runs the paths of one that does not (``status().features`` lists those in use).
  ``TORCHQ_NATIVE_AMX=0`` turns off the AMX GEMM form of the int8 dynamic / static kernels (from
  8 rows on CPUs with AMX-INT8; ``library.int8_amx`` switches it within a block) and the bf16 AMX
  GEMM of the weight-only kernels (5-64 bf16 rows on CPUs with AMX-BF16; ``library.bf16_amx``).
* :func:`disabled` (a context manager) routes calls to the references, for tests and benchmarks.

The loading, validation and call path (``NativeWeight``, ``run_linear`` ...) are in
:mod:`torchq.backends.native_cpu.library`; this module is the public control surface.

When the library is absent, the first op that would have used it warns once
(:class:`NativeMissingWarning`) naming the op, so a slow path is never silent.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .backends.native_cpu.library import DISABLED, FEATURE_NAMES, ISA_NAMES, library, load_error, loaded, threads

__all__ = ["NativeMissingWarning", "NativeStatus", "available", "disabled", "reset_warnings", "set_isa", "status", "threads",
           "warn_reference"]

class NativeMissingWarning(UserWarning):
    """An op ran its pure-PyTorch reference because the native library is not available."""


@dataclass(frozen=True)
class NativeStatus:
    available: bool
    path: str | None
    isa: str | None  # the ISA in use
    supported_isa: str | None  # the widest the CPU has
    reason: str | None  # why it is not available
    # optional kernels in use with the active ISA (FEATURE_NAMES: "avx512_vnni", "avx512_bf16", "amx_int8",
    # "amx_bf16"; TORCHQ_NATIVE_VNNI=0 / TORCHQ_NATIVE_AVX512BF16=0 turn them off at load, TORCHQ_NATIVE_AMX=0
    # or library.int8_amx / library.bf16_amx the AMX ones)
    features: tuple[str, ...] = ()

    def __str__(self) -> str:
        if self.available:
            extra = f" with {', '.join(self.features)}" if self.features else ""
            return f"native CPU kernels: active ({self.isa}{extra}; CPU supports {self.supported_isa}) from {self.path}"
        return f"native CPU kernels: not available ({self.reason}); ops run their pure-PyTorch references"


_WARNED: set[str] = set()


def available() -> bool:
    return library() is not None


def status() -> NativeStatus:
    lib, (path, reason) = loaded(), load_error()
    if lib is None:
        return NativeStatus(False, path, None, None, reason)
    isa, supported = ISA_NAMES[lib.tq_active_isa()], ISA_NAMES[lib.tq_supported_isa()]
    if DISABLED.get():
        return NativeStatus(False, path, None, supported, "disabled by torchq.native.disabled()")
    bits = lib.tq_features() if isa == "avx512" else 0
    features = tuple(name for i, name in enumerate(FEATURE_NAMES) if bits >> i & 1)
    return NativeStatus(True, path, isa, supported, None, features)


def set_isa(name: str) -> str:
    """Cap the ISA at ``name`` (scalar, avx2, avx512; clamped to the CPU's). Returns the one now active."""
    if name not in ISA_NAMES:
        raise ValueError(f"name: expected one of {ISA_NAMES}, got {name!r}")
    lib = loaded()
    if lib is None:
        raise RuntimeError(f"torchq native library not available: {load_error()[1]}")
    return ISA_NAMES[lib.tq_set_isa(ISA_NAMES.index(name))]


@contextmanager
def disabled() -> Iterator[None]:
    """Within this block (on this thread), ops use their pure-PyTorch references."""
    token = DISABLED.set(DISABLED.get() + 1)
    try:
        yield
    finally:
        DISABLED.reset(token)


def warn_reference(op: str, reason: str | None = None) -> None:
    """Warn once per op that it runs its (slower) reference: because the library is missing, or
    for ``reason`` (an input the native kernel does not take)."""
    key = f"{op}: {reason}" if reason else op
    if key in _WARNED or DISABLED.get():
        return
    _WARNED.add(key)
    warnings.warn(
        f"torchq::{op} runs its pure-PyTorch reference on the CPU: {reason or status().reason}. "
        "It is correct but several times slower than the native kernel.",
        NativeMissingWarning,
        stacklevel=3,
    )


def reset_warnings() -> None:
    """Forget which ops already warned (each warns once per process otherwise)."""
    _WARNED.clear()


