"""torchq's native CPU kernels: the C++ library built from ``csrc/`` when the package is installed.

The library has a plain C ABI (no torch or Python headers), is loaded here with :mod:`ctypes`,
and is called from the CPU implementations of ``torchq::`` ops whose pure-PyTorch references
stay the fallback. It picks AVX-512, AVX2+FMA or a portable path at run time and threads over
``torch.get_num_threads()``.

* :func:`status` says whether it is active, from where, with which ISA, or why not.
* ``TORCHQ_NATIVE=0`` keeps it from loading; ``TORCHQ_NATIVE_ISA=avx2|scalar`` caps the ISA;
  ``TORCHQ_NATIVE_SPIN_US`` lets the kernel threads spin that long for the next call (default 0).
* :func:`disabled` (a context manager) routes calls to the references, for tests and benchmarks.

When the library is absent, the first op that would have used it warns once
(:class:`NativeMissingWarning`) naming the op, so a slow path is never silent.
"""

from __future__ import annotations

import contextvars
import ctypes
import importlib.machinery
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from torchq import dispatch
from torchq.identity_cache import IdentityCache

__all__ = [
    "NativeMissingWarning", "NativeStatus", "available", "check_bias", "checked_bias", "checked_ptr", "checked_tile", "disabled", "library",
    "set_isa", "status", "threads",
]

ABI_VERSION = 3
ISA_NAMES = ("scalar", "avx2", "avx512")
_c_int64, _c_float, _c_int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p

# name -> (restype, argtypes) of every exported function
_SIGNATURES: dict[str, tuple[object, list]] = {
    "tq_abi_version": (_c_int, []),
    "tq_supported_isa": (_c_int, []),
    "tq_active_isa": (_c_int, []),
    "tq_set_isa": (_c_int, [_c_int]),
    "tq_blockwise4bit_linear": (
        _c_int,
        [_ptr, _c_int, _c_int64, _c_int64, _ptr, _c_int64, _c_int64, _ptr, _ptr, _ptr, _ptr, _c_float, _ptr, _ptr, _ptr, _c_int],
    ),
    "tq_blockwise4bit_dequantize": (
        _c_int,
        [_ptr, _c_int64, _c_int64, _c_int64, _ptr, _ptr, _ptr, _ptr, _c_float, _ptr, _c_int64, _c_int64, _ptr, _c_int, _c_int],
    ),
    "tq_int4_linear": (
        _c_int,
        [_ptr, _c_int, _c_int64, _c_int64, _c_int64, _ptr, _c_int64, _c_int64, _ptr, _ptr, _ptr, _ptr, _c_int, _c_int, _ptr, _ptr, _c_int],
    ),
    "tq_int4_dequantize": (
        _c_int,
        [_ptr, _c_int64, _c_int64, _c_int64, _ptr, _ptr, _ptr, _ptr, _c_int, _c_int, _c_int64, _c_int64, _ptr, _c_int, _c_int],
    ),
    "tq_int8_linear": (_c_int, [_ptr, _c_int, _c_int64, _c_int64, _ptr, _c_int64, _ptr, _ptr, _ptr, _c_int]),
    "tq_int8_dequantize": (_c_int, [_ptr, _c_int64, _c_int64, _ptr, _c_int64, _c_int64, _ptr, _c_int, _c_int]),
    "tq_int8_dynamic_linear": (
        _c_int,
        [_ptr, _c_int, _c_int64, _c_int64, _ptr, _c_int64, _ptr, _c_float, _c_float, _c_int, _c_int, _ptr, _c_int],
    ),
    "tq_to_f32": (_c_int, [_ptr, _c_int, _c_int64, _ptr]),
    "tq_from_f32": (_c_int, [_ptr, _c_int64, _c_int, _ptr]),
}


class NativeMissingWarning(UserWarning):
    """An op ran its pure-PyTorch reference because the native library is not available."""


@dataclass(frozen=True)
class NativeStatus:
    available: bool
    path: str | None
    isa: str | None  # the ISA in use
    supported_isa: str | None  # the widest the CPU has
    reason: str | None  # why it is not available

    def __str__(self) -> str:
        if self.available:
            return f"native CPU kernels: active ({self.isa}; CPU supports {self.supported_isa}) from {self.path}"
        return f"native CPU kernels: not available ({self.reason}); ops run their pure-PyTorch references"


def _candidates() -> list[Path]:
    here = Path(__file__).resolve().parent
    return [here / f"_native{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]


def _load() -> tuple[ctypes.CDLL | None, str | None, str | None]:
    if os.environ.get("TORCHQ_NATIVE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None, None, "disabled by TORCHQ_NATIVE=0"
    found = [p for p in _candidates() if p.is_file()]
    if not found:
        return None, None, "torchq/_native library not built (reinstall with a C++ compiler: pip install -e .)"
    path = found[0]
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, str(path), f"cannot load {path.name}: {e}"
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is None:
            return None, str(path), f"{path.name} lacks {name} (stale build: reinstall)"
        fn.restype, fn.argtypes = restype, argtypes
    version = lib.tq_abi_version()
    if version != ABI_VERSION:
        return None, str(path), f"{path.name} has ABI {version}, this torchq needs {ABI_VERSION} (stale build: reinstall)"
    return lib, str(path), None


_LIB, _PATH, _REASON = _load()
# how many torchq.native.disabled() blocks enclose the calling thread (or task)
_DISABLED: contextvars.ContextVar[int] = contextvars.ContextVar("torchq_native_disabled", default=0)
_WARNED: set[str] = set()


def library() -> ctypes.CDLL | None:
    """The loaded library, or None when it is missing or :func:`disabled` is in effect."""
    if _LIB is None or _DISABLED.get():
        return None
    return _LIB


def available() -> bool:
    return library() is not None


# Kernel conditions read available(): make it part of the dispatch cache key.
dispatch.add_selection_state(available)


def status() -> NativeStatus:
    if _LIB is None:
        return NativeStatus(False, _PATH, None, None, _REASON)
    isa, supported = ISA_NAMES[_LIB.tq_active_isa()], ISA_NAMES[_LIB.tq_supported_isa()]
    if _DISABLED.get():
        return NativeStatus(False, _PATH, None, supported, "disabled by torchq.native.disabled()")
    return NativeStatus(True, _PATH, isa, supported, None)


def set_isa(name: str) -> str:
    """Cap the ISA at ``name`` (scalar, avx2, avx512; clamped to the CPU's). Returns the one now active."""
    if name not in ISA_NAMES:
        raise ValueError(f"name: expected one of {ISA_NAMES}, got {name!r}")
    if _LIB is None:
        raise RuntimeError(f"torchq native library not available: {_REASON}")
    return ISA_NAMES[_LIB.tq_set_isa(ISA_NAMES.index(name))]


@contextmanager
def disabled() -> Iterator[None]:
    """Within this block (on this thread), ops use their pure-PyTorch references."""
    token = _DISABLED.set(_DISABLED.get() + 1)
    try:
        yield
    finally:
        _DISABLED.reset(token)


def threads() -> int:
    return max(1, torch.get_num_threads())


def warn_reference(op: str, reason: str | None = None) -> None:
    """Warn once per op that it runs its (slower) reference: because the library is missing, or
    for ``reason`` (an input the native kernel does not take)."""
    key = f"{op}: {reason}" if reason else op
    if key in _WARNED or _DISABLED.get():
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


def eager_cpu(x: torch.Tensor) -> bool:
    """True when a CPU op can be called as a plain function: ``x`` is on the CPU and no graph is
    being traced. Dispatch kernels then skip the custom-op dispatcher (tens of microseconds per
    call, a tenth of a decode-sized linear); torch.compile still sees the ``torchq::`` op."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


# The C ABI's element-type codes for activations and outputs (csrc/common.h DType).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def checked_ptr(name: str, t: torch.Tensor | None, dtype: torch.dtype, numel: int, op: str = "native call") -> int | None:
    """``t``'s data pointer (None for None) once it is safe for C code to access ``numel``
    elements of ``dtype`` there: a contiguous CPU tensor of exactly that dtype and number of
    elements, all inside its storage. Every pointer torchq hands to the library comes from here
    (or from a tensor allocated for the call), so a tensor whose metadata claims more bytes than
    it holds raises a ValueError naming ``name`` instead of letting C read foreign memory."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"torchq {op}: {name}: expected a tensor, got {type(t).__name__}")
    if t.dtype != dtype or not t.is_cpu or t.numel() != numel or not t.is_contiguous():  # the decode path: keep it lean
        raise ValueError(
            f"torchq {op}: {name}: expected a contiguous CPU {dtype} tensor of {numel} elements, got "
            f"{'contiguous' if t.is_contiguous() else 'non-contiguous'} {t.dtype} {list(t.shape)} on {t.device}"
        )
    try:
        held = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError) as e:
        raise ValueError(f"torchq {op}: {name}: expected a tensor with storage, got {type(t).__name__} ({e})") from None
    if (t.storage_offset() + numel) * t.element_size() > held:
        raise ValueError(f"torchq {op}: {name}: its storage holds {held} bytes, the call reads "
                         f"{(t.storage_offset() + numel) * t.element_size()} (offset {t.storage_offset()} + {numel} "
                         f"elements of {t.element_size()} bytes)")
    return t.data_ptr()


def check_bias(bias: torch.Tensor | None, n: int, op: str) -> None:
    """Raise ValueError unless ``bias`` is None or a floating-point CPU tensor of ``n`` elements
    (a meta bias's null pointer would read as "no bias" in C)."""
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor) or not bias.is_cpu or not bias.is_floating_point() or bias.numel() != n:
        got = f"{bias.dtype} {list(bias.shape)} on {bias.device}" if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"torchq {op}: bias: expected a floating-point CPU tensor of {n} elements, got {got}")


def checked_bias(bias: torch.Tensor | None, n: int, op: str) -> torch.Tensor | None:
    """``bias`` as the contiguous fp32 ``[N]`` CPU tensor the kernels read (None for None),
    checked with :func:`checked_ptr` (a meta bias, whose null pointer would read as "no bias"
    in C, raises)."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor):
        check_bias(bias, n, op)  # raises, naming what was given
    b = bias if bias.dtype == torch.float32 and bias.dim() == 1 and bias.is_contiguous() else bias.reshape(-1).to(torch.float32).contiguous()
    checked_ptr("bias", b, torch.float32, n, op)
    return b


def checked_tile(w: torch.Tensor, rows: int, cols: int, op: str) -> tuple[int, int]:
    """``(pointer, bf16 flag)`` of a dequantization tile: the library writes ``rows x cols``
    fp32 (flag 0) or bf16 (flag 1) values there."""
    if w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"torchq {op}: tile: expected fp32 or bf16, got {w.dtype}")
    return checked_ptr("tile", w, w.dtype, rows * cols, op), int(w.dtype == torch.bfloat16)


def run_linear(fn: Callable[..., int], op: str, x: torch.Tensor, k: int, n: int, weight: tuple, bias: torch.Tensor | None,
               takes_bias: bool = True) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` through an exported linear ``fn(x, dtype, M, K, *weight,
    [bias,] out, threads)``: x is read and the output written in x's dtype by the library, so
    the only tensor op here is the output allocation (and a copy for a non-contiguous x).

    ``weight`` must come from a builder that checked every buffer against ``n`` and ``k`` with
    :func:`checked_ptr`; x and bias are checked here, on every call."""
    code = DTYPE_CODES.get(x.dtype)
    if code is None:
        raise TypeError(f"torchq {op}: x: expected fp32, bf16 or fp16, got {x.dtype}")
    if x.dim() == 2 and x.is_contiguous():
        rows = x
    elif x.dim() and x.shape[-1] == k:
        rows = x.reshape(-1, k).contiguous()
    else:
        raise ValueError(f"torchq {op}: x: expected last dimension K={k}, got shape {list(x.shape)}")
    m = rows.shape[0]
    xp = checked_ptr("x", rows, x.dtype, m * k, op)  # also checks K for a 2-D x (m * K elements)
    out = torch.empty(m, n, dtype=x.dtype)
    if takes_bias:
        b = checked_bias(bias, n, op)  # referenced until fn returns
        status = fn(xp, code, m, k, *weight, ptr(b), out.data_ptr(), threads())
    else:
        status = fn(xp, code, m, k, *weight, out.data_ptr(), threads())
    check(status, op)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)


_ARGS = IdentityCache()


def weight_args(owner: object, build: Callable[[object], tuple | None]) -> tuple | None:
    """The weight's part of a kernel's C arguments (pointers, sizes), built once per live
    ``owner`` (a layout's tensor impl) so a decode-sized call does not redo it.

    ``build(owner)`` may only point into tensors that ``owner`` holds, never into copies: those
    pointers stay valid, and see the current values, as long as ``owner`` lives (its tensors are
    never re-allocated; ``copy_`` into a quantized weight writes in place). A copy of the owner
    (deepcopy, ``.to``) is a new object and builds its own. ``build`` returns None when the
    arguments cannot be taken in place (a non-contiguous tensor, scales of another dtype); that
    is not remembered, and the caller takes its general path. ``build`` checks every buffer
    with :func:`checked_ptr` against the sizes it passes (once per owner: the pointers, and the
    checks, are then reused)."""
    entry = _ARGS.get(owner)
    shape = getattr(owner, "shape", None)
    if entry is not None and entry[0] == shape:
        return entry[1]
    args = build(owner)
    if args is not None:
        # Built for this shape only (callers size x and the output from owner.shape), and holding
        # every attribute the pointers may point into: reassigning one cannot leave them dangling.
        _ARGS.set(owner, (shape, args, tuple(vars(owner).values())))
    return args


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def check(code: int, op: str) -> None:
    if code != 0:
        raise RuntimeError(f"torchq native {op} failed with status {code} (1: bad argument, 2: out of memory)")
