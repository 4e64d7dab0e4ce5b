"""Triton kernels: the CUDA implementations of torchq's linear ops, registered against the op
objects of :mod:`torchq.ops` when this module is imported.

* ``torchq::int4_groupwise_linear`` (:class:`~torchq.layouts.Int4NativeLayout`):
  :mod:`.dequant_linear`, format ``AFFINE``;
* ``torchq::blockwise_4bit_linear`` (NF4 / FP4): :mod:`.dequant_linear`, format ``CODEBOOK``;
* ``torchq::int8_dynamic_linear`` (per-token int8 activations x int8 weights) and ``torchq::int8_static_linear``
  (static int8 activations): :mod:`.int8_linear`;
* ``torchq::int8_weight_linear`` (int8 weight-only, per-row scales) and ``torchq::float8_weight_linear``
  (float8_e4m3fn weight-only): :mod:`.int8_weight`;
* ``torchq::int4_groupwise_linear_a8`` / ``torchq::blockwise_4bit_linear_a8`` (4-bit weights x
  per-block int8 activations): :mod:`.a8_linear`;
* ``torchq::int4_tensor_core_mm`` from 32 rows (tinygemm's weight written out, then cuBLAS):
  :mod:`.tiled_dequant`, called by :mod:`torchq.backends.aten`.

Each module states its numeric contract: the tensor-core and dequantize paths form every weight
exactly as the op's pure-PyTorch reference does (results differ by the order of fp32 sums; int8
dynamic bit for bit); the streaming GEMVs factor the scales out of the sums (within the reference's
per-weight roundings).

Triton is imported on the first CUDA call, not with torchq: CPU users never pay for it. Without
triton the dispatch conditions reject CUDA inputs with the reason (see :func:`cuda_rejects`), so
the fallback is visible. Tests run the kernels on CPU tensors with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from ...ops.blockwise import blockwise_4bit_linear
from ...ops.float8 import float8_weight_linear
from ...ops.int4 import int4_groupwise_linear
from ...ops.int8 import int8_dynamic_linear, int8_static_linear, int8_weight_linear
from ...ops.int8act import blockwise_4bit_linear_a8, int4_groupwise_linear_a8
from ...tracing import traced

__all__ = ["available", "unavailable_reason", "cuda_rejects", "interpreting", "eager_cuda", "int4_groupwise_linear_cuda",
           "blockwise_4bit_linear_cuda", "int8_dynamic_linear_cuda", "int8_static_linear_cuda", "int8_weight_linear_cuda", "float8_weight_linear_cuda", "int4_groupwise_linear_a8_cuda",
           "blockwise_4bit_linear_a8_cuda"]


@functools.cache
def unavailable_reason() -> str | None:
    """None when triton imports, else why not."""
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception as e:  # ImportError, or a broken install
        return f"triton is not importable ({type(e).__name__}: {e}); pip install triton"
    return None


def available() -> bool:
    return unavailable_reason() is None


def interpreting() -> bool:
    """Whether triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def cuda_rejects(x: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot run for an input on ``x.device`` (None when they can)."""
    if x.device.type != "cuda":
        return f"no torchq kernel for {x.device.type} tensors"
    reason = unavailable_reason()
    if reason is not None:
        return reason
    if x.dtype == torch.bfloat16 and torch.version.hip is None and _capability(x.device) < (8, 0):
        return f"bf16 tensor-core dot needs compute capability 8.0+, {x.device} has {'.'.join(map(str, _capability(x.device)))}"
    return None


def _lazy_kernel(module: str, fn: str):
    """The CUDA kernel ``fn`` of ``module`` (a Triton module of this package), imported on its first
    call and remembered: later calls go straight to it (no import machinery per call)."""
    resolved: list = []

    def run(*args, **kwargs):
        if not resolved:
            reason = unavailable_reason()
            if reason is not None:
                raise RuntimeError(f"torchq: the CUDA kernel of {fn} is a Triton kernel: {reason}")
            resolved.append(getattr(importlib.import_module(f"{__name__}.{module}"), fn))
        return resolved[0](*args, **kwargs)

    run.__name__ = f"{fn}_cuda"
    return run


int4_groupwise_linear_cuda = _lazy_kernel("dequant_linear", "int4_groupwise_linear")
blockwise_4bit_linear_cuda = _lazy_kernel("dequant_linear", "blockwise_4bit_linear")
int8_dynamic_linear_cuda = _lazy_kernel("int8_linear", "int8_dynamic_linear")
int8_static_linear_cuda = _lazy_kernel("int8_linear", "int8_static_linear")
int8_weight_linear_cuda = _lazy_kernel("int8_weight", "int8_weight_linear")
float8_weight_linear_cuda = _lazy_kernel("int8_weight", "float8_weight_linear")
int4_groupwise_linear_a8_cuda = _lazy_kernel("a8_linear", "int4_groupwise_linear_a8")
blockwise_4bit_linear_a8_cuda = _lazy_kernel("a8_linear", "blockwise_4bit_linear_a8")
int4_groupwise_linear.register_kernel("cuda")(int4_groupwise_linear_cuda)
blockwise_4bit_linear.register_kernel("cuda")(blockwise_4bit_linear_cuda)
int8_dynamic_linear.register_kernel("cuda")(int8_dynamic_linear_cuda)
int8_static_linear.register_kernel("cuda")(int8_static_linear_cuda)
int8_weight_linear.register_kernel("cuda")(int8_weight_linear_cuda)
float8_weight_linear.register_kernel("cuda")(float8_weight_linear_cuda)
int4_groupwise_linear_a8.register_kernel("cuda")(int4_groupwise_linear_a8_cuda)
blockwise_4bit_linear_a8.register_kernel("cuda")(blockwise_4bit_linear_a8_cuda)


def eager_cuda(x: torch.Tensor) -> bool:
    """True when a CUDA op's Triton implementation can be called as a plain function (``x`` on a
    CUDA device, no graph being traced): the layouts then skip the custom-op dispatcher, whose
    Python costs ~80-200 us per call on an H100 host (measured, torch 2.11), more than the
    decode-sized kernel itself. torch.compile still sees the ``torchq::`` op."""
    return x.is_cuda and not traced(x)
