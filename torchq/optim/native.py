"""The native fused AdamW step over blockwise-quantized states (``tq_adamw_blockwise``, csrc/optim_adamw.cpp).

One pass over a tensor's memory, parallel over blocks on the library's threads: decode both
states of a block, the AdamW update of the block's parameters, the block's new absmax, encode.
Bit-equal to the reference (:func:`torchq.optim.adamw.reference_update`): the same fp32
operations in the same order (no fused multiply-add), the same midpoints and rounding.
:func:`kernel` is None when the library is missing, disabled (:func:`torchq.native.disabled`) or
built before this kernel existed; the optimizer then runs the reference.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from ..backends.native_cpu.library import library, loaded, threads
from .formats import StateFormat, midpoints

__all__ = ["SYMBOL", "SCALARS", "kernel", "available", "fused_update"]

SYMBOL = "tq_adamw_blockwise"
# the order of the fp32 scalars the kernel reads
SCALARS = ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "decay", "step_size", "bias_correction2_sqrt", "eps")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_p, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_ARGTYPES = [_p, _p, _int, _i64,  # param, grad, dtype, n
             _p, _i64, _p, _i64,  # exp_avg codes, their bytes, absmax, its entries
             _p, _i64, _p, _i64,  # exp_avg_sq codes, bytes, absmax, entries
             _p, _p, _p, _p,  # signed map, its midpoints, unsigned map, its midpoints
             _int, _i64, _p, _int, _int]  # bits, block, scalars [8], maximize, threads


@functools.cache
def _bound(lib: ctypes.CDLL) -> Any:
    fn = getattr(lib, SYMBOL, None)
    if fn is None:  # a library built before csrc/optim_adamw.cpp existed
        return None
    fn.restype, fn.argtypes = ctypes.c_int, _ARGTYPES
    return fn


def kernel() -> Any:
    """The bound ``tq_adamw_blockwise``, or None (library missing, disabled or stale)."""
    lib = library()
    return None if lib is None else _bound(lib)


def available() -> str | None:
    """None when the kernel can run, else why not."""
    lib = loaded()
    if lib is None:
        from ..native import status

        return status().reason
    if _bound(lib) is None:
        return f"the native library lacks {SYMBOL} (built before torchq.optim's kernel: reinstall)"
    if library() is None:
        return "disabled by torchq.native.disabled()"
    return None


@functools.cache
def _tables(fmt: StateFormat) -> tuple[torch.Tensor, ...]:
    s, u = fmt.signed_map.contiguous(), fmt.unsigned_map.contiguous()
    return s, midpoints(s).contiguous(), u, midpoints(u).contiguous()


def _checked(t: torch.Tensor, what: str, dtype: torch.dtype, least: int) -> int:
    """``t``'s address after checking it is a contiguous CPU tensor of ``dtype`` with ``least`` elements."""
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() or t.numel() < least:
        raise ValueError(f"{what}: expected a contiguous CPU {dtype} tensor of at least {least} elements, "
                         f"got {t.dtype} {list(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})")
    return t.data_ptr()


def fused_update(fn: Any, param: torch.Tensor, grad: torch.Tensor, codes1: torch.Tensor, absmax1: torch.Tensor,
                 codes2: torch.Tensor, absmax2: torch.Tensor, fmt: StateFormat, scalars: dict[str, float], maximize: bool) -> None:
    """Run the kernel ``fn`` in place on one local tensor (``param`` and ``grad`` contiguous, fp32
    or bf16, same dtype; every buffer checked against the sizes the kernel will touch)."""
    n = param.numel()
    dtype = param.dtype
    if dtype not in _DTYPES or grad.dtype != dtype:
        raise ValueError(f"param, grad: expected both fp32 or both bf16 for the native kernel, got {dtype} and {grad.dtype}")
    if grad.numel() != n:
        raise ValueError(f"grad: expected {n} elements (the parameter's), got {grad.numel()}")
    nbytes, nb = fmt.code_bytes(n), fmt.blocks(n)
    tables = _tables(fmt)
    args = [
        _checked(param, "param", dtype, n), _checked(grad, "grad", dtype, n), _DTYPES[dtype], n,
        _checked(codes1, "exp_avg", torch.uint8, nbytes), codes1.numel(),
        _checked(absmax1, "exp_avg_absmax", torch.float32, nb), absmax1.numel(),
        _checked(codes2, "exp_avg_sq", torch.uint8, nbytes), codes2.numel(),
        _checked(absmax2, "exp_avg_sq_absmax", torch.float32, nb), absmax2.numel(),
        *(t.data_ptr() for t in tables),
        fmt.bits, fmt.block_size, (ctypes.c_float * len(SCALARS))(*(scalars[k] for k in SCALARS)),
        int(maximize), threads(),
    ]
    status = fn(*args)
    if status != 0:
        raise RuntimeError(f"torchq::{SYMBOL} refused its arguments (status {status}): n={n}, bits={fmt.bits}, "
                           f"block={fmt.block_size}, code bytes {codes1.numel()}/{codes2.numel()}, "
                           f"absmax {absmax1.numel()}/{absmax2.numel()}")
