"""Loading torchq's native CPU library and its one call path.

The library (``torchq/_native*.so``, built from ``csrc/``) has a plain C ABI and is loaded with
:mod:`ctypes`; :func:`validate` refuses one whose exported functions, ABI version or weight
struct (:mod:`.abi`) differ from what this torchq calls. Every kernel call goes through
:func:`run_linear` and :func:`dequantize_rows` with a :class:`NativeWeight`: the library's
weight struct, built once per weight by :func:`lut4_weight` or :func:`int8_weight`, which check
every buffer against the sizes the struct claims (:func:`checked_ptr`); per call only x, the
output, the bias and M are passed. :func:`weight_args` caches a layout's weight per tensor impl.
:mod:`torchq.native` is the public control module (status, ISA, disabling, warnings).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import importlib.machinery
import os
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ...identity_cache import IdentityCache
from ...prefill import FUSED_MAX_M, use_tiles
from ...tracing import traced
from . import abi

__all__ = [
    "ABI_VERSION", "BIAS_AFTER_FORMATS", "BoundLinear", "DISABLED", "DTYPE_CODES", "ISA_NAMES", "NativeWeight", "bind_linear", "check", "check_bias", "checked_bias", "checked_ptr",
    "checked_tile", "decode_linear", "decode_weight", "dequantize_rows", "eager_cpu", "int8_weight", "library", "load_error", "loaded",
    "bf16_amx", "bf16_amx_calls", "bf16_amx_supported", "BF16_AMX_MODES", "bf16_dp_gemm", "bf16_dp_gemm_calls", "BF16_DP_MODES", "gemm_active", "int8_amx", "int8_amx_calls", "int8_amx_supported", "INT8_AMX_MODES", "int8_dot", "int8_dot_calls", "INT8_DOT_MODES", "int8_panel", "int8_panel_calls", "INT8_PANEL_MODES", "lut4_dot", "lut4_dot_calls", "LUT4_DOT_MODES", "lut4_scaled_dot", "lut4_scaled_dot_calls", "lut4_scaled_dot_values_ok", "lut4_table_dot", "LUT4_TABLE_DOT_MODES", "lut4_table_dot_values_ok", "LUT4_SCALED_DOT_MODES", "LINEAR_ENTRIES", "linear_entry", "lut4_gemm_active", "lut4_paths", "lut4_weight", "min_parallel_work", "RowSums", "THREAD_POOLS", "thread_pool", "cached_op_weight", "op_weight", "ptr", "run_linear", "takes_fused", "threads", "validate", "weight_args",
    "weight_struct",
    "int8_panel_numel",
    "int8_panel_weight",
]

ABI_VERSION = 17
ISA_NAMES = ("scalar", "avx2", "avx512")
# tq_features bits: AVX-512 VNNI int8 kernels, AVX512_BF16 lut4 pair tables, the AMX int8 GEMM, the AMX bf16 GEMM
# (each also needs an active AVX-512 ISA to run)
FEATURE_NAMES = ("avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
INT8_AMX_MODES = ("off", "on", "emulated")  # tq_set_int8_amx
BF16_AMX_MODES = ("off", "on", "emulated")  # tq_set_bf16_amx
INT8_DOT_MODES = ("off", "on", "emulated", "all")  # tq_set_int8_dot
INT8_PANEL_MODES = ("off", "on", "emulated")  # tq_set_int8_panel
LUT4_SCALED_DOT_MODES = ("off", "on", "emulated")  # tq_set_lut4_scaled_dot
LUT4_TABLE_DOT_MODES = ("off", "on")  # tq_set_lut4_table_dot
LUT4_DOT_MODES = ("off", "on", "emulated")  # tq_set_lut4_dot
BF16_DP_MODES = ("off", "on", "emulated", "all")  # tq_set_bf16_dp_gemm
_c_int64, _c_int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p

# name -> (restype, argtypes) of every exported function
_SIGNATURES: dict[str, tuple[object, list]] = {
    "tq_abi_version": (_c_int, []),
    "tq_supported_isa": (_c_int, []),
    "tq_active_isa": (_c_int, []),
    "tq_features": (_c_int, []),  # bits of FEATURE_NAMES: the optional AVX-512 kernels in use
    "tq_set_isa": (_c_int, [_c_int]),
    "tq_set_lut4_paths": (_c_int, [_c_int]),  # Lut4Paths bits (negative: read)
    "tq_set_int8_amx": (_c_int, [_c_int]),  # index into INT8_AMX_MODES (negative: read)
    "tq_amx_int8_supported": (_c_int, []),
    "tq_amx_int8_calls": (_c_int64, []),
    "tq_dot_calls_int8": (_c_int64, []),
    "tq_set_int8_dot": (_c_int, [_c_int]),  # index into INT8_DOT_MODES (negative: read)
    "tq_set_int8_panel": (_c_int, [_c_int]),  # index into INT8_PANEL_MODES (negative: read)
    "tq_panel_calls_int8": (_c_int64, []),
    "tq_scaled_dot_calls_lut4": (_c_int64, []),
    "tq_set_lut4_scaled_dot": (_c_int, [_c_int]),  # index into LUT4_SCALED_DOT_MODES (negative: read)
    "tq_lut4_scaled_dot_values_ok": (_c_int, [_ptr, _ptr, _c_int64]),  # scales, zeros or null, count: 1 / 0 (-1: no kernel)
    "tq_lut4_table_dot_values_ok": (_c_int, [_ptr, _c_int64]),  # NF4 / FP4 absmax, count: 1 / 0 (-1: no kernel)
    "tq_set_lut4_table_dot": (_c_int, [_c_int]),  # index into LUT4_TABLE_DOT_MODES (negative: read)
    "tq_dot_calls_lut4": (_c_int64, []),
    "tq_set_lut4_dot": (_c_int, [_c_int]),  # index into LUT4_DOT_MODES (negative: read)
    "tq_set_bf16_amx": (_c_int, [_c_int]),  # index into BF16_AMX_MODES (negative: read)
    "tq_amx_bf16_supported": (_c_int, []),
    "tq_amx_bf16_calls": (_c_int64, []),
    "tq_set_bf16_dp_gemm": (_c_int, [_c_int]),  # index into BF16_DP_MODES (negative: read)
    "tq_bf16_dp_gemm_calls": (_c_int64, []),
    "tq_gemm_active": (_c_int, [_c_int]),  # weight format
    "tq_dot_max_m": (_c_int, [_ptr, _c_int]),  # weight, x dtype: the most rows its bf16 AMX GEMM or dot path takes (0: none)
    "tq_weight_abi": (_c_int, [_c_int, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_c_int), ctypes.POINTER(_c_int64)]),
    "tq_weight_size": (_c_int64, []),
    "tq_linear": (_c_int, [_ptr, _ptr, _c_int, _c_int64, _ptr, _ptr, _c_int]),  # weight, x, x dtype, M, bias, out, threads
    "tq_dequantize_rows": (_c_int, [_ptr, _c_int64, _c_int64, _ptr, _c_int, _c_int]),  # weight, n0, n1, dst, bf16, threads
    "tq_set_min_parallel_work": (_c_int64, [_c_int64]),  # the least multiply-adds per thread (negative: read)
    "tq_set_thread_pool": (_c_int, [_c_int]),  # 0 own pool, 1 OpenMP (negative: read)
    "tq_to_f32": (_c_int, [_ptr, _c_int, _c_int64, _ptr]),
    "tq_from_f32": (_c_int, [_ptr, _c_int64, _c_int, _ptr]),
}


def _candidates() -> list[Path]:
    here = Path(__file__).resolve().parents[2]  # torchq/
    return [here / f"_native{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]


def _load() -> tuple[ctypes.CDLL | None, str | None, str | None, type[ctypes.Structure] | None]:
    if os.environ.get("TORCHQ_NATIVE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None, None, "disabled by TORCHQ_NATIVE=0", None
    found = [p for p in _candidates() if p.is_file()]
    if not found:
        return None, None, "torchq/_native library not built (reinstall with a C++ compiler: pip install -e .)", None
    path = found[0]
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, str(path), f"cannot load {path.name}: {e}", None
    struct, reason = validate(lib, path.name)
    return (lib if struct else None), str(path), reason, struct


def validate(lib: ctypes.CDLL, name: str) -> tuple[type[ctypes.Structure] | None, str | None]:
    """``(the weight struct's ctypes.Structure, None)`` when ``lib`` (the file ``name``) is the
    library this torchq calls: every exported function present (their signatures set here), the
    same ABI version, and a weight struct with the fields torchq fills, of the same kinds, at
    the offsets ctypes lays out (:mod:`.abi`); else ``(None, why not)``."""
    for fn_name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, fn_name, None)
        if fn is None:
            return None, f"{name} lacks {fn_name} (stale build: reinstall)"
        fn.restype, fn.argtypes = restype, argtypes
    version = lib.tq_abi_version()
    if version != ABI_VERSION:
        return None, f"{name} has ABI {version}, this torchq needs {ABI_VERSION} (stale build: reinstall)"
    struct, reason = abi.weight_structure(*abi.describe(lib))
    if struct is None:
        return None, f"{name}: {reason} (stale build: reinstall)"
    return struct, None


_LIB, _PATH, _REASON, _WEIGHT_STRUCT = _load()
# The bf16 AMX GEMM's mode as the library has it (TORCHQ_NATIVE_AMX at load; bf16_amx changes it).
_BF16_AMX_MODE = "off" if _LIB is None else BF16_AMX_MODES[_LIB.tq_set_bf16_amx(-1)]
# The bf16 dot-product GEMM's (bf16_dp_gemm changes it).
_BF16_DP_MODE = "off" if _LIB is None else BF16_DP_MODES[_LIB.tq_set_bf16_dp_gemm(-1)]


def _python_entry(lib: ctypes.CDLL | None) -> Callable[..., int] | None:
    """``torchq._native.linear`` (csrc/python_entry.cpp: ``tq_linear``'s arguments without ctypes'
    conversions) when the library imports as a CPython module too and that module calls the very
    ``tq_linear`` ctypes loaded (one image, one state); else None (calls go through ctypes)."""
    if lib is None:
        return None
    try:
        module = importlib.import_module("torchq._native")
    except ImportError:  # built without Python.h, or another build's file
        return None
    linear, where = getattr(module, "linear", None), getattr(module, "linear_address", None)
    if linear is None or where is None or where() != ctypes.cast(lib.tq_linear, ctypes.c_void_p).value:
        return None
    return linear


_PYTHON_LINEAR = _python_entry(_LIB)
# what run_linear and BoundLinear call: tq_linear through the module's entry, else through ctypes
_linear_call: Callable[..., int] | None = _PYTHON_LINEAR or (_LIB.tq_linear if _LIB is not None else None)
LINEAR_ENTRIES = ("python", "ctypes")


def linear_entry(kind: str | None = None) -> str:
    """How calls reach ``tq_linear``: ``"python"`` (the library's CPython entry, about 0.1 us per
    call; the default where the build found Python.h) or ``"ctypes"`` (1.5-2 us). With ``kind``, set
    it and return the previous one (for tests and benchmarks). Results are the same bits."""
    global _linear_call
    if _LIB is None:
        raise RuntimeError(f"torchq native library not available: {_REASON}")
    previous = "python" if _linear_call is _PYTHON_LINEAR else "ctypes"
    if kind is not None:
        if kind not in LINEAR_ENTRIES:
            raise ValueError(f"kind: expected one of {LINEAR_ENTRIES}, got {kind!r}")
        if kind == "python" and _PYTHON_LINEAR is None:
            raise RuntimeError("torchq native library has no CPython entry (built without Python.h): only 'ctypes' is available")
        _linear_call = _PYTHON_LINEAR if kind == "python" else _LIB.tq_linear
    return previous


# how many torchq.native.disabled() blocks enclose the calling thread (or task)
DISABLED: contextvars.ContextVar[int] = contextvars.ContextVar("torchq_native_disabled", default=0)


def loaded() -> ctypes.CDLL | None:
    """The loaded library whether or not :func:`torchq.native.disabled` is in effect (None when missing)."""
    return _LIB


def load_error() -> tuple[str | None, str | None]:
    """``(path of the library file found, why it is not loaded)`` (both None when none was looked for or it loaded)."""
    return _PATH, _REASON


def weight_struct() -> type[ctypes.Structure] | None:
    """The ``ctypes.Structure`` of the loaded library's weight struct (None without the library)."""
    return _WEIGHT_STRUCT


def library() -> ctypes.CDLL | None:
    """The loaded library, or None when it is missing or :func:`disabled` is in effect."""
    if _LIB is None or DISABLED.get():
        return None
    return _LIB


def threads() -> int:
    return max(1, torch.get_num_threads())


@contextlib.contextmanager
def lut4_paths(decode: bool = True, gemm: bool = True, lookup_any_isa: bool = False) -> Iterator[None]:
    """Allow or forbid the lut4 kernel's decode paths (AVX2, M <= 4; with them the AVX-512 lookup path,
    M = 1 int4 g32 with fp32 scales, the AVX512_BF16 bf16 dot paths: int4 with bf16 scales, 2-16
    bf16 rows, int4 with fp32 scales and NF4 / FP4 in blocks of 64+, 1-16 (:func:`lut4_scaled_dot`), and int8 weight-only's,
    2-32 (:func:`int8_dot`)) and GEMM
    (M >= 64) paths (see csrc/lut4_linear.h) within the block, process-wide: for tests and benchmarks
    that compare them with the table and panel paths (and tiles). ``gemm`` also switches the GEMM
    forms of the int8-activation 4-bit kernel (M > 8; from 5 with VNNI) and of the int8 dynamic and static kernels
    (M >= 32 on AVX2, 8 with VNNI, and their AMX form from 8: :func:`int8_amx`).
    ``lookup_any_isa`` (with ``decode``) sends the lookup path's calls to it on AVX2 too, where the
    affine decode path is faster: tests run its body on machines without AVX-512."""
    if _LIB is None:
        yield
        return
    before = _LIB.tq_set_lut4_paths(int(decode) | 2 * int(gemm) | 4 * int(lookup_any_isa))
    try:
        yield
    finally:
        _LIB.tq_set_lut4_paths(before)


@contextlib.contextmanager
def _mode(setter: str, modes: tuple[str, ...], mode: str, noted: Callable[[str], None] | None = None) -> Iterator[None]:
    """Within the block (process-wide), the library's switch ``setter`` (a ``tq_set_*`` function
    taking an index into ``modes``, returning the one before) at ``mode``; ``noted`` hears each mode
    set. A mode that is not one of ``modes`` raises ValueError (naming them) when the block starts."""
    if mode not in modes:
        raise ValueError(f"mode: expected one of {modes}, got {mode!r}")
    if _LIB is None:
        yield
        return
    switch = getattr(_LIB, setter)
    before = switch(modes.index(mode))
    if noted:
        noted(mode)
    try:
        yield
    finally:
        switch(before)
        if noted:
            noted(modes[before])


def int8_amx(mode: str) -> contextlib.AbstractContextManager[None]:
    """Within the block (process-wide), the AMX GEMM forms of the int8 dynamic and static kernels
    (``csrc/int8_amx_body.h``, from 8 activation rows) and of nf4a8 / fp4a8
    (``csrc/lut4_q8_amx_body.h``, from 64 rows): ``"on"`` (the default, unless
    ``TORCHQ_NATIVE_AMX=0``) uses them on CPUs with AMX-INT8 whose AVX-512 ISA is active, ``"off"``
    never, ``"emulated"`` runs their bodies on emulated tiles on any CPU (the nf4a8 form's on CPUs
    with AVX2, which unpacks its panels; for tests: the same bits).
    ``lut4_paths(gemm=False)`` turns it off with the other GEMM forms."""
    return _mode("tq_set_int8_amx", INT8_AMX_MODES, mode)


def int8_amx_calls() -> int:
    """How many int8 dynamic / static and nf4a8 / fp4a8 calls have taken an AMX form (AMX or
    emulated tiles) since the library loaded (for tests: which path ran)."""
    return 0 if _LIB is None else int(_LIB.tq_amx_int8_calls())


def int8_dot(mode: str) -> contextlib.AbstractContextManager[None]:
    """Within the block (process-wide), int8 weight-only's bf16 dot path for 2 to 32 rows of bf16
    activations (``csrc/int8_linear.h``): ``"on"`` (the default) on CPUs with AVX512_BF16 whose
    AVX-512 ISA is active, from 5 rows on CPUs with AMX-BF16 (below, the fp32 row kernels are
    faster there); ``"all"`` every row count on those CPUs too; ``"off"`` never (the fp32 row
    kernels or dequantized tiles serve those rows); ``"emulated"`` its body on emulated
    instructions on any CPU, the same bits (for tests). A decode path: ``lut4_paths(decode=False)``
    turns it off in every mode. The mode also picks how int8 rows become bf16 for the AMX GEMM and
    the dequantized tiles (the same bits every way): ``vcvtne2ps2bf16`` where the CPU has it
    (``"on"`` / ``"all"``), the emulated body (``"emulated"``), the generic kernel (``"off"``)."""
    return _mode("tq_set_int8_dot", INT8_DOT_MODES, mode)


def int8_dot_calls() -> int:
    """How many int8 weight-only calls have taken the bf16 dot path (csrc/int8_linear.h) since the
    library loaded (for tests: which path ran)."""
    return 0 if _LIB is None else int(_LIB.tq_dot_calls_int8())


def int8_panel(mode: str) -> contextlib.AbstractContextManager[None]:
    """Within the block (process-wide), the int8 dynamic and static kernels' VNNI panel kernel for
    panel-order weights (``Int8VnniLayout``, ``csrc/int8_panel_body.h``): ``"on"`` (the default) on
    CPUs with AVX-512 VNNI whose AVX-512 ISA is active, ``"off"`` never (chunks of the panels are
    unpacked for the row-major kernels), ``"emulated"`` its body on emulated instructions on any
    CPU, the same bits (for tests). Calls that take the AMX form do not take it."""
    return _mode("tq_set_int8_panel", INT8_PANEL_MODES, mode)


def int8_panel_calls() -> int:
    """How many int8 dynamic / static calls have taken the panel kernel (VNNI or emulated) since
    the library loaded (for tests: which path ran)."""
    return 0 if _LIB is None else int(_LIB.tq_panel_calls_int8())


def lut4_dot(mode: str) -> contextlib.AbstractContextManager[None]:
    """Within the block (process-wide), the lut4 kernel's bf16 dot path for bf16 activations
    (``csrc/lut4_linear.h``: int4 with bf16 scales, 2 to 16 rows in groups of 32 or 64, 1 to 16 in
    groups of 128 or more; the bf16-rounded tables' words into ``vdpbf16ps``): ``"on"`` (the
    default) on CPUs with AVX512_BF16 whose AVX-512 ISA is active, ``"off"`` never (the table path
    or dequantized tiles serve those rows), ``"emulated"`` its body on emulated instructions on any
    CPU, the same bits (for tests). A decode path: ``lut4_paths(decode=False)`` turns it off in
    every mode."""
    return _mode("tq_set_lut4_dot", LUT4_DOT_MODES, mode)


def lut4_dot_calls() -> int:
    """How many lut4 calls have taken the bf16 dot path (csrc/lut4_linear.h) since the library
    loaded (for tests: which path ran)."""
    return 0 if _LIB is None else int(_LIB.tq_dot_calls_lut4())


def lut4_scaled_dot(mode: str) -> contextlib.AbstractContextManager[None]:
    """Within the block (process-wide), the lut4 kernel's scaled dot path for 1 to 16 rows of bf16
    activations (``csrc/lut4_linear.h``: int4 with fp32 scales, any group size, the codes' values as
    bf16 into ``vdpbf16ps``, each block's sum scaled once; and its table kind, NF4 / FP4 in blocks of
    a multiple of 64, each 128 positions' bf16 weights looked up from their blocks' tables; 1-4
    rows where the bf16 AMX or dot-product GEMM takes 5 and more): ``"on"`` (the default) on CPUs with
    AVX512_BF16 whose AVX-512 ISA is active, ``"off"`` never (the lookup, table and decode paths
    or dequantized tiles serve those rows), ``"emulated"`` its body on emulated instructions on any
    CPU, the same bits (for tests). A decode path: ``lut4_paths(decode=False)`` turns it off in
    every mode."""
    return _mode("tq_set_lut4_scaled_dot", LUT4_SCALED_DOT_MODES, mode)


def lut4_table_dot(mode: str) -> contextlib.AbstractContextManager[None]:
    """Within the block (process-wide), the scaled dot path's table kind (NF4 / FP4 in blocks of a
    multiple of 64, ``csrc/lut4_linear.h``) ``"on"`` or ``"off"`` (then the table path serves those
    calls). Its default is the CPU's: on for AMD (measured faster on Zen 4), off for Intel (slower
    there: ``vdpbf16ps`` costs about two FMAs); ``TORCHQ_NATIVE_TABLE_DOT=0`` / ``1`` at load
    overrides. The :func:`lut4_scaled_dot` mode chooses its kernel (``"emulated"``: on any CPU)."""
    return _mode("tq_set_lut4_table_dot", LUT4_TABLE_DOT_MODES, mode)


def lut4_scaled_dot_calls() -> int:
    """How many lut4 calls have taken the scaled dot path (csrc/lut4_linear.h) since the library
    loaded (for tests: which path ran)."""
    return 0 if _LIB is None else int(_LIB.tq_scaled_dot_calls_lut4())


def _guard_answer(op: str, function: str, named: list[tuple[str, torch.Tensor | None]]) -> bool | None:
    """A guard's answer from the library's ``function`` on the fp32 tensors ``named`` (the first
    required, the others of its size or None), then the count: True / False, or None where no
    kernel runs (-1) or the library is not loaded."""
    first_name, first = named[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"torchq {op}: {first_name}: expected a tensor, got {type(first).__name__}")
    if _LIB is None:
        return None
    count = first.numel()
    ptrs = [checked_ptr(name, t, torch.float32, count, op) for name, t in named]
    scratch = None if count else torch.zeros(1)  # an empty tensor's pointer may be null, which the call reads as "no kernel"
    if scratch is not None:
        ptrs = [scratch.data_ptr()] + [None] * (len(named) - 1)
    got = int(getattr(_LIB, function)(*ptrs, count))
    return None if got < 0 else bool(got)


def lut4_scaled_dot_values_ok(scales: torch.Tensor, zeros: torch.Tensor | None = None) -> bool | None:
    """The scaled dot path's guard (csrc/lut4_scaled_dot_body.h's ``values_ok``) as the kernel that
    the current :func:`lut4_scaled_dot` mode runs computes it, on fp32 ``scales`` and ``zeros`` (a
    weight row's; zeros of the same size, or None): True where every value lets the row take the
    path (0, or normal and at most 2^100), False where one sends it to the table path, None where
    no scaled dot kernel runs (for tests: the guard checked directly, as outputs cannot always show
    it)."""
    return _guard_answer("lut4_scaled_dot_values_ok", "tq_lut4_scaled_dot_values_ok", [("scales", scales), ("zeros", zeros)])


def lut4_table_dot_values_ok(absmax: torch.Tensor) -> bool | None:
    """The scaled dot path's guard for its table kind (NF4 / FP4) as the kernel that the current
    :func:`lut4_scaled_dot` mode runs computes it, on fp32 ``absmax`` (a tile's, plain or decoded):
    True where every value is 0 or of magnitude in [2^-40, 2^100], False where one sends the tile to
    the table path, None where no scaled dot kernel runs (for tests)."""
    return _guard_answer("lut4_table_dot_values_ok", "tq_lut4_table_dot_values_ok", [("absmax", absmax)])


def int8_amx_supported() -> bool:
    """Whether this process runs the AMX int8 GEMM: the CPU has AMX-INT8 and Linux granted the tile
    state (asked once, by the library)."""
    return _LIB is not None and bool(_LIB.tq_amx_int8_supported())


def _note_bf16_amx_mode(mode: str) -> None:
    global _BF16_AMX_MODE
    _BF16_AMX_MODE = mode


def bf16_amx(mode: str) -> contextlib.AbstractContextManager[None]:
    """Within the block (process-wide), the bf16 AMX GEMM of the weight-only kernels (lut4: int4,
    NF4, FP4; int8) for 5 to ``BF16_AMX_MAX_M`` rows of bf16 activations (``csrc/bf16_amx.h``): ``"on"`` (the
    default, unless ``TORCHQ_NATIVE_AMX=0``) uses it on CPUs with AMX-BF16 whose AVX-512 ISA is
    active, ``"off"`` never (the paths of other CPUs serve those rows: dequantized tiles +
    ``torch.mm``, the bf16 dot paths, or the fused fp32 paths where the tile switch is off),
    ``"emulated"`` runs its body on emulated tiles on any CPU (for tests). A GEMM form:
    ``lut4_paths(gemm=False)`` turns it off in every mode."""
    return _mode("tq_set_bf16_amx", BF16_AMX_MODES, mode, _note_bf16_amx_mode)


def bf16_amx_calls() -> int:
    """How many weight-only calls have taken the bf16 AMX GEMM (AMX or emulated tiles) since the
    library loaded (for tests: which path ran)."""
    return 0 if _LIB is None else int(_LIB.tq_amx_bf16_calls())


def bf16_amx_supported() -> bool:
    """Whether this process runs the AMX bf16 GEMM: the CPU has AMX-BF16 and Linux granted the tile
    state (asked once, by the library)."""
    return _LIB is not None and bool(_LIB.tq_amx_bf16_supported())


def _note_bf16_dp_mode(mode: str) -> None:
    global _BF16_DP_MODE
    _BF16_DP_MODE = mode


def bf16_dp_gemm(mode: str) -> contextlib.AbstractContextManager[None]:
    """Within the block (process-wide), the bf16 dot-product GEMM of the weight-only kernels (lut4:
    NF4 and FP4 from 5 rows, int4 from 9, or 17 with bf16 scales in groups of 32; int8 from 10, or
    from 1 in panel order) for bf16 activations of any larger row count (``csrc/bf16_dp_gemm.h``:
    panels of 16 weight rows as bf16 pairs, ``vdpbf16ps`` with the activations' pairs broadcast): ``"on"`` (the default) on CPUs with AVX512_BF16 whose
    AVX-512 ISA is active and where the AMX GEMM does not take the call, on CPUs with AMX-BF16 only up
    to ``BF16_DP_AMX_CPU_MAX_M`` rows (there ``torch.mm`` runs on AMX: dequantized tiles + ``torch.mm``
    take more); ``"all"`` the same at every row count on any CPU (tests, A/B runs; ``TORCHQ_NATIVE_BF16_DP=all``
    for a process); ``"off"`` never (the bf16 dot paths, dequantized tiles + ``torch.mm``);
    ``"emulated"`` its body on emulated instructions on any CPU at every row count, the same bits (for
    tests). A GEMM form: ``lut4_paths(gemm=False)`` turns it off in every mode."""
    return _mode("tq_set_bf16_dp_gemm", BF16_DP_MODES, mode, _note_bf16_dp_mode)


def bf16_dp_gemm_calls() -> int:
    """How many weight-only calls have taken the bf16 dot-product GEMM (either kernel) since the
    library loaded (for tests: which path ran)."""
    return 0 if _LIB is None else int(_LIB.tq_bf16_dp_gemm_calls())


def _bf16_native_max_m() -> int:
    """The most bf16 activation rows any weight-only weight's fused kernel may take above the
    decode-sized ones: the largest of the bf16 dot-product GEMM's while it may run (every count, but
    ``BF16_DP_AMX_CPU_MAX_M`` in its mode "on" on AMX CPUs), the bf16 AMX GEMM's while it may and the
    bf16 dot paths' (each weight says which it takes: :meth:`NativeWeight.dot_max_m`)."""
    most = DOT_MAX_M
    if _BF16_DP_MODE == "emulated" or (_BF16_DP_MODE in ("on", "all") and _LIB is not None and ISA_NAMES[_LIB.tq_active_isa()] == "avx512"
                                       and _LIB.tq_features() >> FEATURE_NAMES.index("avx512_bf16") & 1):
        if _BF16_DP_MODE != "on" or not bf16_amx_supported():
            return BF16_DP_MAX_M
        most = max(most, BF16_DP_AMX_CPU_MAX_M)
    if _BF16_AMX_MODE == "emulated" or (_BF16_AMX_MODE == "on" and bf16_amx_supported()):
        most = max(most, BF16_AMX_MAX_M)
    return most


def lut4_gemm_active() -> bool:
    """Whether lut4 calls of many rows run the native GEMM path (AVX2 / AVX-512, allowed): then the native
    kernel beats dequantized tiles + torch.mm at every M (:func:`torchq.prefill.use_tiles`)."""
    return gemm_active(abi.FORMAT_LUT4)


def gemm_active(weight_format: int) -> bool:
    """Whether weight-only calls of many rows for ``weight_format`` (``abi.FORMAT_LUT4``: from 64
    rows, ``abi.FORMAT_INT8``: from 16 on AVX2, 64 on AVX-512; below, the native row tiles) run a
    native fp32 GEMM form (allowed by :func:`lut4_paths`): then the native kernel beats
    dequantized tiles + torch.mm at every M."""
    return _LIB is not None and not DISABLED.get() and bool(_LIB.tq_gemm_active(weight_format))


def min_parallel_work(work: int | None = None) -> int:
    """The least work, in multiply-adds, a native linear gives each of its threads (a smaller
    call runs on the calling thread alone: waking a worker would cost more than the work);
    with ``work``, set it (0: always split by ``torch.get_num_threads()``) and return the
    previous value. Default 1 << 16, or ``TORCHQ_NATIVE_MIN_PARALLEL_WORK`` when the library
    loads. Results are the same bits either way."""
    if _LIB is None:
        raise RuntimeError(f"torchq native library not available: {_REASON}")
    if work is not None and (isinstance(work, bool) or not isinstance(work, int) or work < 0):
        raise ValueError(f"work: expected a non-negative int, got {work!r}")
    return int(_LIB.tq_set_min_parallel_work(-1 if work is None else work))


THREAD_POOLS = ("own", "openmp")


def thread_pool(kind: str | None = None) -> str:
    """Which threads run a split native call: ``"openmp"`` (the default where the library was
    built with OpenMP: it binds to the OpenMP runtime PyTorch loaded, so the ranges run on
    PyTorch's own intra-op threads instead of competing with them) or ``"own"`` (torchq's pool,
    csrc/threadpool.cpp; also ``TORCHQ_NATIVE_POOL=own`` at load). With ``kind``, set it and
    return the previous one. Results are the same bits either way."""
    if _LIB is None:
        raise RuntimeError(f"torchq native library not available: {_REASON}")
    if kind is None:
        return THREAD_POOLS[_LIB.tq_set_thread_pool(-1)]
    if kind not in THREAD_POOLS:
        raise ValueError(f"kind: expected one of {THREAD_POOLS}, got {kind!r}")
    previous = _LIB.tq_set_thread_pool(THREAD_POOLS.index(kind))
    if previous < 0:
        raise RuntimeError("torchq native library was built without OpenMP: only the 'own' thread pool is available")
    return THREAD_POOLS[previous]


def eager_cpu(x: torch.Tensor) -> bool:
    """True when a CPU op can be called as a plain function: ``x`` is on the CPU and no graph is
    being traced. Dispatch kernels then skip the custom-op dispatcher (tens of microseconds per
    call, a tenth of a decode-sized linear); torch.compile still sees the ``torchq::`` op."""
    return x.is_cpu and not traced(x)


# The C ABI's element-type codes for activations and outputs (csrc/common.h DType).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DOT_MAX_M = 32  # the larger of kLut4DotMaxM and kInt8DotMaxM (csrc/lut4_linear.h, int8_linear.h): the most rows of any weight's bf16 dot path
BF16_AMX_MAX_M = 64  # kBf16AmxMaxM (csrc/bf16_amx.h): the most rows of the bf16 AMX GEMM
BF16_DP_MAX_M = 1 << 20  # kBf16DpMaxM (csrc/bf16_dp_gemm.h): the most rows of the bf16 dot-product GEMM
BF16_DP_AMX_CPU_MAX_M = 16  # kBf16DpAmxCpuMaxM: its most in mode "on" on CPUs with AMX-BF16


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


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (bumped by every in-place write), or None for an inference tensor
    (created under ``torch.inference_mode``: it has none)."""
    try:
        return t._version
    except RuntimeError:
        return None


class RowSums:
    """The int32 row sums ``Σ_k codes[n, k]`` of an int8 weight (the static format's zero-point
    correction reads them, ``csrc/weight_abi.h``): computed once, kept in one contiguous int32
    ``[n]`` tensor whose address the library holds, and recomputed in place by :meth:`refresh`
    when the codes were written in place since (``copy_``, ``load_state_dict``: their version
    counter moved). Every call of a static weight refreshes first (:func:`run_linear`,
    :class:`BoundLinear`): a weakref and a counter read. Codes that are inference tensors have no
    counter: an in-place write to them is not seen (rebuild the weight)."""

    __slots__ = ("codes", "n", "k", "tensor", "version")

    def __init__(self, codes: torch.Tensor, n: int, k: int) -> None:
        self.codes, self.n, self.k = weakref.ref(codes), n, k
        self.version = _version(codes)
        self.tensor = codes.reshape(n, k).sum(dim=1, dtype=torch.int32).contiguous()

    def refresh(self) -> None:
        codes = self.codes()
        if codes is None:  # the weight's codes are gone: so is every caller that could use them
            return
        version = _version(codes)
        if version != self.version:
            torch.sum(codes.reshape(self.n, self.k), dim=1, dtype=torch.int32, out=self.tensor)
            self.version = version


class NativeWeight:
    """A weight as the library's ``tq_weight`` struct (``csrc/weight_abi.h``), built once by
    :func:`lut4_weight` or :func:`int8_weight` after checking every buffer with
    :func:`checked_ptr` against the sizes the struct claims; it holds those tensors, so its
    pointers stay valid as long as it lives. Call it with :func:`run_linear` and
    :func:`dequantize_rows`. ``op`` names the torchq op in error messages."""

    __slots__ = ("struct", "address", "op", "format", "n", "k", "row_length", "_tensors", "_dynamic", "_codes", "_row_sums")

    def __init__(self, op: str, tensors: tuple[torch.Tensor, ...], **fields: int | float | None) -> None:
        if _WEIGHT_STRUCT is None:
            raise RuntimeError(f"torchq {op}: native library not available: {_REASON}")
        self.struct = _WEIGHT_STRUCT(**fields)
        self.address = ctypes.addressof(self.struct)
        self.op, self.format = op, self.struct.format
        self.n, self.k, self.row_length = self.struct.n, self.struct.k, self.struct.row_length
        self._tensors = tensors
        self._dynamic: dict[tuple, NativeWeight] = {}
        self._codes: weakref.ref | None = None  # an int8 weight's codes (int8_weight), for its row sums
        self._row_sums: RowSums | None = None  # an int8 weight's, once a static form is built (shared with those)

    def dot_max_m(self, dtype: torch.dtype) -> int:
        """The most activation rows of ``dtype`` the fused kernel takes for this weight above the
        decode-sized ones, instead of dequantized tiles: the largest of the bf16 dot-product GEMM's
        (:func:`bf16_dp_gemm`), the bf16 AMX GEMM's (up to ``BF16_AMX_MAX_M``: bf16 activations, lut4 and
        int8 weight-only weights: :func:`bf16_amx`) and its bf16 dot path's (AVX512_BF16: int4 and
        NF4 / FP4, 16 rows; int8 weight-only, 32); 0 where it has none (asked per call: the ISA and
        modes may change)."""
        if dtype != torch.bfloat16 or self.format not in (abi.FORMAT_LUT4, abi.FORMAT_INT8) or _LIB is None:
            return 0
        return int(_LIB.tq_dot_max_m(self.address, DTYPE_CODES[dtype]))

    def dynamic(self, quant_min: int, quant_max: int, eps: float) -> NativeWeight:
        """This int8 weight with activations quantized per row into ``[quant_min, quant_max]``
        (:class:`torchq.activation.PerTokenInt8`), built once per range and eps."""
        key = (quant_min, quant_max, eps)
        found = self._dynamic.get(key)
        if found is None:
            if self.format != abi.FORMAT_INT8:
                raise ValueError(f"torchq {self.op}: dynamic activations need an int8 weight-only weight, got format {self.format}")
            fields = {name: getattr(self.struct, name) for name, _ in self.struct._fields_}
            fields.update(format=abi.FORMAT_INT8_DYNAMIC, act_denom=(quant_max - quant_min) / 2, act_eps=eps,
                          act_qmin=quant_min, act_qmax=quant_max)
            found = self._dynamic[key] = NativeWeight("int8_dynamic_linear", self._tensors, **fields)
        return found


    def static(self, act_scale: float, act_zero_point: int, quant_min: int, quant_max: int) -> NativeWeight:
        """This int8 weight with activations quantized with one fixed scale and zero point into
        ``[quant_min, quant_max]`` (:class:`torchq.activation.StaticInt8`; ``act_scale`` is rounded
        to fp32, as the scheme does), built once per key (:meth:`static_key`). The weight's row sums
        (:class:`RowSums`) are computed with the first and shared by every static form. The library
        checks the fields (BAD_ARGUMENT: a scale that is not a normal fp32 value, a zero point
        outside the range, quant_min below -127)."""
        key = self.static_key(act_scale, act_zero_point, quant_min, quant_max)
        found = self._dynamic.get(key)
        if found is None:
            if self.format != abi.FORMAT_INT8:
                raise ValueError(f"torchq {self.op}: static activations need an int8 weight-only weight, got format {self.format}")
            if self.struct.codes_order == 1:  # panel order: the row sums are stored beside the panels
                fields = {name: getattr(self.struct, name) for name, _ in self.struct._fields_}
                fields.update(format=abi.FORMAT_INT8_STATIC, act_scale=act_scale, act_zero_point=act_zero_point, act_qmin=quant_min,
                              act_qmax=quant_max, row_sums=self.struct.code_sums)
                found = self._dynamic[key] = NativeWeight("int8_static_linear", self._tensors, **fields)
                return found
            codes = None if self._codes is None else self._codes()
            if codes is None:
                raise ValueError(f"torchq {self.op}: static activations need the weight's codes (an int8_weight)")
            if self._row_sums is None:
                self._row_sums = RowSums(codes, self.n, self.k)
            rows = self._row_sums
            fields = {name: getattr(self.struct, name) for name, _ in self.struct._fields_}
            fields.update(format=abi.FORMAT_INT8_STATIC, act_scale=act_scale, act_zero_point=act_zero_point, act_qmin=quant_min,
                          act_qmax=quant_max, row_sums=checked_ptr("row_sums", rows.tensor, torch.int32, self.n, self.op))
            found = NativeWeight("int8_static_linear", self._tensors, **fields)
            found._codes, found._row_sums = self._codes, rows  # the row sums live as long as any user
            self._dynamic[key] = found
        return found

    @staticmethod
    def static_key(act_scale: float, act_zero_point: int, quant_min: int, quant_max: int) -> tuple:
        """The :meth:`derived` key of :meth:`static`'s weight for these arguments."""
        return ("static", act_scale, act_zero_point, quant_min, quant_max)

    def derived(self, key: tuple) -> NativeWeight | None:
        """The weight :meth:`dynamic` (``key`` its arguments), :meth:`static` (:meth:`static_key`)
        or :meth:`int8_activations` (key ``("int8_activations",)``) built from this one, if built
        already (else None)."""
        return self._dynamic.get(key)

    def int8_activations(self) -> NativeWeight:
        """This 4-bit weight with activations quantized per 32-block to int8
        (:class:`torchq.activation.PerBlockInt8`) and integer dot products, built once."""
        key = ("int8_activations",)
        found = self._dynamic.get(key)
        if found is None:
            if self.format != abi.FORMAT_LUT4:
                raise ValueError(f"torchq {self.op}: int8 activations need a 4-bit (lut4) weight, got format {self.format}")
            fields = {name: getattr(self.struct, name) for name, _ in self.struct._fields_}
            fields.update(format=abi.FORMAT_LUT4_INT8ACT)
            found = self._dynamic[key] = NativeWeight(f"{self.op}_a8", self._tensors, **fields)
        return found


def lut4_weight(op: str, n: int, k: int, block: int, packed: torch.Tensor, codebook: torch.Tensor, *,
                scales: torch.Tensor | None = None, nested: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                shifts: torch.Tensor | None = None, zeros: torch.Tensor | None = None, round_mul: int = 0,
                round_add: int = 0) -> NativeWeight:
    """An ``[n, k]`` 4-bit weight for the lut4 kernel: rows of ``row_length`` = k rounded up to a
    multiple of ``block`` elements, zero-padded; ``packed`` uint8 ``[n * row_length / 2]`` (two
    codes a byte, the first in the high nibble); ``codebook`` fp32 ``[16]``; per block of a row
    either ``scales`` fp32 or ``nested = (codes uint8, absmax fp32 per 256 codes, offset fp32
    [1], map fp32 [256])`` (scale = map[code] * absmax + offset, the offset read at each call);
    optional ``shifts`` / ``zeros`` fp32 per block; ``round_mul`` / ``round_add`` 0 none, 1 bf16,
    2 fp16. All contiguous CPU tensors."""
    if (scales is None) == (nested is None):
        raise ValueError(f"torchq {op}: scales, nested: pass exactly one")
    row_length = -(-k // block) * block
    groups = n * row_length // block
    tensors = [packed, codebook, scales, shifts, zeros]
    fields = {
        "packed": checked_ptr("packed", packed, torch.uint8, n * row_length // 2, op),
        "codebook": checked_ptr("codebook", codebook, torch.float32, 16, op),
        "scales": checked_ptr("scales", scales, torch.float32, groups, op),
        "shifts": checked_ptr("shifts", shifts, torch.float32, groups, op),
        "zeros": checked_ptr("zeros", zeros, torch.float32, groups, op),
    }
    if nested is not None:
        codes, absmax, offset, table = nested
        tensors += nested
        fields.update(
            nested_codes=checked_ptr("nested_codes", codes, torch.uint8, groups, op),
            nested_absmax=checked_ptr("nested_absmax", absmax, torch.float32, -(-groups // 256), op),
            nested_offset=checked_ptr("nested_offset", offset, torch.float32, 1, op),
            nested_map=checked_ptr("nested_map", table, torch.float32, 256, op),
        )
    return NativeWeight(op, tuple(t for t in tensors if t is not None), format=abi.FORMAT_LUT4, n=n, k=k,
                        row_length=row_length, block=block, round_mul=round_mul, round_add=round_add, **fields)


def int8_weight(op: str, codes: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> NativeWeight:
    """An ``[n, k]`` int8 weight-only weight: ``codes`` int8 ``[n * k]`` row-major, ``scales``
    fp32 ``[n]`` (one per row), contiguous CPU tensors; :meth:`NativeWeight.dynamic` and
    :meth:`NativeWeight.static` add int8 activations."""
    weight = NativeWeight(op, (codes, scales), format=abi.FORMAT_INT8, n=n, k=k, row_length=k,
                          codes=checked_ptr("codes", codes, torch.int8, n * k, op),
                          scales=checked_ptr("scales", scales, torch.float32, n, op))
    weight._codes = weakref.ref(codes)
    return weight


INT8_PANEL_ROWS = 16  # weight rows per panel
INT8_PANEL_STEP = 64  # positions: a panel-order row is padded to a multiple of this


def int8_panel_numel(n: int, k: int) -> int:
    """Bytes of an ``[n, k]`` int8 weight in panel order: ``ceil(n / 16) * 16 * kp``, ``kp = ceil(k / 64) * 64``."""
    return -(-n // INT8_PANEL_ROWS) * INT8_PANEL_ROWS * (-(-k // INT8_PANEL_STEP) * INT8_PANEL_STEP)


def int8_panel_weight(op: str, panels: torch.Tensor, code_sums: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> NativeWeight:
    """An ``[n, k]`` int8 weight-only weight in panel order (``csrc/int8_linear.h``, "Panel order";
    :class:`torchq.layouts.int8_vnni.Int8VnniLayout` holds it): ``panels`` int8
    (:func:`int8_panel_numel` bytes), ``code_sums`` int32 ``[n]`` (each row's sum of codes),
    ``scales`` fp32 ``[n]``, contiguous CPU tensors; :meth:`NativeWeight.dynamic` and
    :meth:`NativeWeight.static` add int8 activations (the static form reads ``code_sums`` as its row sums)."""
    return NativeWeight(op, (panels, code_sums, scales), format=abi.FORMAT_INT8, n=n, k=k, row_length=k,
                        codes=checked_ptr("panels", panels, torch.int8, int8_panel_numel(n, k), op),
                        scales=checked_ptr("scales", scales, torch.float32, n, op), codes_order=1,
                        code_sums=checked_ptr("code_sums", code_sums, torch.int32, n, op))


# the formats whose bias torchq adds after the rounding to x's dtype (the library takes none)
BIAS_AFTER_FORMATS = (abi.FORMAT_INT8_DYNAMIC, abi.FORMAT_INT8_STATIC)


def run_linear(weight: NativeWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` in x's dtype through ``tq_linear``: x is read and the output
    written by the library, so the only tensor op here is the output allocation (and a copy for
    a non-contiguous x). x and bias are checked here, on every call; the weight was checked
    when it was built. A dynamic- or static-activation weight's bias is added after the rounding to
    x's dtype, as its reference does; a static weight's row sums are refreshed first
    (:class:`RowSums`)."""
    op, k, n = weight.op, weight.k, weight.n
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
    out = rows.new_empty(m, n)  # x's dtype, CPU (checked above)
    if weight.format not in BIAS_AFTER_FORMATS:
        b = checked_bias(bias, n, op)  # referenced until the call returns
        check(_linear_call(weight.address, xp, code, m, ptr(b), out.data_ptr(), threads()), op)
    else:
        check_bias(bias, n, op)
        if weight._row_sums is not None:  # a static weight's
            weight._row_sums.refresh()
        check(_linear_call(weight.address, xp, code, m, None, out.data_ptr(), threads()), op)
        if bias is not None:
            out = out + bias.to(x.dtype)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)


def dequantize_rows(weight: NativeWeight, n0: int, n1: int, out: torch.Tensor) -> None:
    """Weight rows ``[n0, n1)`` dequantized into ``out``, a contiguous fp32 or bf16
    ``[n1 - n0, weight.row_length]`` tensor, through ``tq_dequantize_rows``: exactly the
    reference's values (rounded to nearest even for bf16)."""
    op = f"{weight.op} dequantize"
    dst, bf16 = checked_tile(out, n1 - n0, weight.row_length, op)
    check(_LIB.tq_dequantize_rows(weight.address, n0, n1, dst, bf16, threads()), op)


_ARGS = IdentityCache()


def weight_args(owner: object, build: Callable[[object], NativeWeight | None]) -> NativeWeight | None:
    """The :class:`NativeWeight` of ``owner`` (a layout's tensor impl), built once per live
    ``owner`` so a decode-sized call does not redo it.

    ``build(owner)`` may only point into tensors that ``owner`` holds, never into copies: those
    pointers stay valid, and see the current values, as long as ``owner`` lives and its tensors
    keep their data pointers (``copy_`` into a quantized weight writes in place; FSDP2 frees and
    re-allocates a gathered weight's storages between forward and backward, which moves them:
    the pointers are compared at every call and the weight rebuilt when one moved). A copy of the
    owner (deepcopy, ``.to``) is a new object and builds its own. ``build`` returns None when the
    weight cannot be taken in place (a non-contiguous tensor, scales of another dtype); that
    is not remembered, and the caller takes its general path."""
    entry = _ARGS.get(owner)
    shape = getattr(owner, "shape", None)
    if entry is not None and entry[0] == shape and entry[3] == _data_pointers(entry[2]):
        return entry[1]
    weight = build(owner)
    if weight is not None:
        # Built for this shape only, and holding every attribute the pointers may point into:
        # reassigning one cannot leave them dangling.
        held = tuple(vars(owner).values())
        _ARGS.set(owner, (shape, weight, held, _data_pointers(held)))
    return weight


def _data_pointers(values: tuple) -> tuple[int, ...]:
    return tuple(v.data_ptr() for v in values if isinstance(v, torch.Tensor))


_DATA_PTR = torch.Tensor.data_ptr  # tuple(map(_DATA_PTR, tensors)): 0.7 us for three, a generator 1.4


_OP_WEIGHTS = IdentityCache()


def cached_op_weight(key: torch.Tensor, others: tuple[torch.Tensor | None, ...], params: tuple) -> NativeWeight | None:
    """The weight :func:`op_weight` cached for these arguments, or None (nothing built): an op's
    kernel calls it before its argument checks, which passed when the weight was built for the
    same tensors (the per-call arguments, x and bias, are checked by :func:`run_linear`). None
    too while the library is disabled."""
    if _LIB is None or DISABLED.get():
        return None
    entry = _OP_WEIGHTS.get(key)
    if (entry is not None and entry[1] == params and entry[2] == key.data_ptr() and entry[3] == key.shape
            and entry[4] == key.dtype and len(entry[5]) == len(others)
            and all(a is b and (a is None or a.data_ptr() == p) for a, b, p in zip(others, entry[5], entry[6]))):
        return entry[0]
    return None


def takes_fused(weight: NativeWeight, x: torch.Tensor) -> bool:
    """Whether ``x @ W.T`` runs the fused kernel (:func:`run_linear`) for ``weight``: x has rows,
    and for a weight-only 4-bit or int8 weight no more than dequantized tiles + ``torch.mm`` would
    take (:func:`torchq.prefill.use_tiles`; the int8-activation formats always run fused)."""
    m = x.numel() // weight.k
    if m <= 0:
        return False
    if weight.format in (abi.FORMAT_LUT4, abi.FORMAT_INT8):  # decode-sized: fused whatever the GEMM switch
        return m <= FUSED_MAX_M or not use_tiles(m, x.dtype, gemm_active(weight.format)) or m <= weight.dot_max_m(x.dtype)
    return True


def op_weight(key: torch.Tensor, others: tuple[torch.Tensor | None, ...], params: tuple,
              build: Callable[[], tuple[NativeWeight, bool]]) -> NativeWeight:
    """The :class:`NativeWeight` an op's CPU kernel builds from its arguments, built once per live
    ``key`` tensor (the packed codes) and reused while ``key`` keeps its data pointer, shape and
    dtype, every tensor of ``others`` is the same object at the same data pointer, and ``params``
    (the op's other arguments the weight depends on) are equal. The layouts' eager paths cache
    per impl (:func:`weight_args`); this is the same saving for calls through the dispatcher (a
    ``torch.compile`` graph passes the same tensors at every call).

    ``build()`` returns ``(weight, in_place)``: ``in_place`` when the weight points only into the
    memory of ``key`` and ``others`` (no contiguous or dtype copies, which would not see in-place
    updates); only such a weight is cached. The cache holds ``key`` weakly (the entry goes with
    it: the cached weight keeps no tensor of ``key``'s storage, so a model can be freed) and the
    tensors of ``others`` strongly through the weight."""
    found = cached_op_weight(key, others, params)
    if found is not None:
        return found
    weight, in_place = build()
    if in_place:
        storage = key.untyped_storage().data_ptr()
        weight._tensors = tuple(t for t in weight._tensors if t.untyped_storage().data_ptr() != storage)
        for derived in weight._dynamic.values():
            derived._tensors = weight._tensors
        _OP_WEIGHTS.set(key, (weight, params, key.data_ptr(), key.shape, key.dtype, others,
                              tuple(None if t is None else t.data_ptr() for t in others)))
    return weight


def decode_weight(owner: object, x: torch.Tensor, build: Callable[[object], NativeWeight | None],
                  every_row_count: bool = False) -> NativeWeight | None:
    """``owner``'s cached :class:`NativeWeight` (:func:`weight_args`) when the fused kernel takes
    ``x @ W.T`` directly (eager CPU callers): the library is active and x has a non-zero number of
    rows, decode-sized (:func:`torchq.prefill.use_tiles`) unless ``every_row_count`` (int8
    dynamic and static weights: their kernels take every row count; only weight-only formats hand
    larger inputs to dequantized tiles + GEMM); else None. ``owner.shape`` is ``[N, K]``."""
    if _LIB is None or DISABLED.get():
        return None
    m = x.numel() // owner.shape[1]
    if not m:
        return None
    if not every_row_count and use_tiles(m, x.dtype):  # unless the weight's bf16 dot path takes these rows
        if x.dtype != torch.bfloat16 or m > _bf16_native_max_m():
            return None
        weight = weight_args(owner, build)
        return weight if weight is not None and m <= weight.dot_max_m(x.dtype) else None
    return weight_args(owner, build)


def decode_linear(owner: object, x: torch.Tensor, bias: torch.Tensor | None, build: Callable[[object], NativeWeight | None],
                  dynamic: tuple[int, int, float] | None = None,
                  static: tuple[float, int, int, int] | None = None) -> torch.Tensor | None:
    """``x @ W.T (+ bias)`` through the fused kernel (:func:`run_linear`) with ``owner``'s cached
    weight (:func:`decode_weight`; ``dynamic``: :meth:`NativeWeight.dynamic`'s arguments,
    ``static``: :meth:`NativeWeight.static`'s) when an eager CPU caller can take it
    (:func:`eager_cpu`), else None (the caller takes its general path). :func:`eager_cpu`, :func:`decode_weight` and :func:`run_linear` in one call: this is
    every decode-sized layer's path, and every eager int8 dynamic or static call's."""
    if _LIB is None or DISABLED.get() or not x.is_cpu or traced(x):
        return None
    weight = decode_weight(owner, x, build, every_row_count=dynamic is not None or static is not None)
    if weight is None:
        return None
    if dynamic is not None:
        weight = weight.dynamic(*dynamic)
    elif static is not None:
        weight = weight.static(*static)
    return run_linear(weight, x, bias)


class BoundLinear:
    """:func:`run_linear` of one :class:`NativeWeight` for inputs of one signature (dtype, shape,
    CPU), prepared once: a decode-sized call then costs an output allocation, the checks of x and
    the bias that change per call, and the library call (the dispatch's bound form of a native
    kernel, :attr:`torchq.dispatch.LinearKernel.bind`). Calling it with ``(x, weight, bias)`` of
    that signature gives :func:`run_linear`'s bits, or None (the caller takes its general path)
    for a weight whose tensor impl now claims another shape than the one checked, or whose tensors
    moved (FSDP2 re-allocates a gathered weight's storages: the general path rebuilds its pointers
    there), an x that is not contiguous or whose storage holds less than its
    sizes claim, or an fp32 bias that is not contiguous or whose storage is short (run_linear
    then copies or raises)."""

    __slots__ = ("weight", "shape", "address", "op", "code", "dtype", "m", "n", "nbytes", "element_size", "out_shape", "bias_after",
                 "recheck_tiles", "held", "pointers", "row_sums")

    def __init__(self, weight: NativeWeight, shape: object, x: torch.Tensor, recheck_tiles: bool = False,
                 held: tuple[torch.Tensor, ...] = ()) -> None:
        self.weight, self.shape, self.address, self.op, self.n = weight, shape, weight.address, weight.op, weight.n
        self.held, self.pointers = held, _data_pointers(held)  # the owner's tensors the weight points into
        self.code, self.dtype = DTYPE_CODES[x.dtype], x.dtype
        self.m = x.numel() // weight.k
        self.element_size = x.element_size()  # the signature fixes x's dtype
        self.nbytes = x.numel() * x.element_size()
        self.out_shape = (*x.shape[:-1], weight.n)
        self.bias_after = weight.format in BIAS_AFTER_FORMATS  # added after the rounding to x's dtype
        # a static weight's row sums: refreshed per call (RowSums)
        self.row_sums = weight._row_sums if weight.format == abi.FORMAT_INT8_STATIC else None
        # rows above FUSED_MAX_M: whether tiles + GEMM take them reads global state (the bf16 tile
        # switch, the bf16 AMX mode), so it is asked again per call, as the impl asks it
        self.recheck_tiles = recheck_tiles

    def __call__(self, x: torch.Tensor, quantized_weight: Any, bias: torch.Tensor | None) -> torch.Tensor | None:
        # the signature (dtype, shape, CPU; the bias's dtype and shape) is the dispatch key's
        if (quantized_weight.tensor_impl.shape != self.shape or tuple(map(_DATA_PTR, self.held)) != self.pointers
                or not x.is_contiguous()
                or x.storage_offset() * self.element_size + self.nbytes > x.untyped_storage().nbytes()
                or (self.recheck_tiles and use_tiles(self.m, self.dtype) and self.m > self.weight.dot_max_m(self.dtype))):
            return None
        bp = None
        if bias is not None and not self.bias_after:
            if bias.dtype != torch.float32:  # the kernel adds an fp32 bias (a bf16 model's: converted per call, 1 us)
                bias = bias.to(torch.float32).contiguous()
            elif not bias.is_contiguous() or (bias.storage_offset() + self.n) * 4 > bias.untyped_storage().nbytes():
                return None
            bp = bias.data_ptr()
        out = x.new_empty(*self.out_shape)  # x's dtype, CPU (0.9 us; torch.empty with a dtype: 1.1-1.6)
        if self.row_sums is not None:
            self.row_sums.refresh()
        status = _linear_call(self.address, x.data_ptr(), self.code, self.m, bp, out.data_ptr(), threads())
        if status:
            check(status, self.op)
        if bias is not None and self.bias_after:
            out = out + bias.to(self.dtype)
        return out


def bind_linear(owner: object, x: torch.Tensor, build: Callable[[object], NativeWeight | None],
                dynamic: tuple[int, int, float] | None = None, int8_activations: bool = False,
                static: tuple[float, int, int, int] | None = None) -> BoundLinear | None:
    """The :class:`BoundLinear` of ``owner``'s cached weight (:func:`weight_args`; ``dynamic``:
    :meth:`NativeWeight.dynamic`'s arguments; ``static``: :meth:`NativeWeight.static`'s;
    ``int8_activations``: :meth:`NativeWeight.int8_activations`) for inputs like ``x``, when every
    such eager CPU call runs the fused kernel: the library is active, x has a non-zero number of
    rows and, for a weight-only weight, a decode-sized number (:func:`torchq.prefill.use_tiles`),
    as :func:`decode_linear` requires (int8 dynamic and static kernels take every row count);
    else None."""
    if not x.is_cpu or traced(x) or x.dtype not in DTYPE_CODES:
        return None
    m = x.numel() // owner.shape[1]
    if not int8_activations:
        weight = decode_weight(owner, x, build, every_row_count=dynamic is not None or static is not None)
    elif _LIB is None or DISABLED.get() or not m:
        return None
    else:  # every row count runs the int8-activation kernel
        weight = weight_args(owner, build)
    if weight is None:
        return None
    if int8_activations:
        weight = weight.int8_activations()
    elif dynamic is not None:
        weight = weight.dynamic(*dynamic)
    elif static is not None:
        weight = weight.static(*static)
    held = tuple(v for v in vars(owner).values() if isinstance(v, torch.Tensor))
    # weight-only formats above the fused rows: tiles + GEMM may take them (the int8 dynamic / static
    # and int8-activation formats run the fused kernel at every row count)
    recheck = not int8_activations and dynamic is None and static is None and m > FUSED_MAX_M
    return BoundLinear(weight, owner.shape, x, recheck_tiles=recheck, held=held)


def ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def check(code: int, op: str) -> None:
    if code != 0:
        raise RuntimeError(f"torchq native {op} failed with status {code} (1: bad argument, 2: out of memory)")
