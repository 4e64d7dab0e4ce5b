"""LLM.int8 row-wise ("vectorwise") int8 ops, bitsandbytes-compatible: ``torch.ops.torchq.int8_*``.

* ``int8_vectorwise_quant(A, threshold=0.0) -> (codes int8 [rows, K], row_stats fp32 [rows],
  outlier_cols int64 or None)``. With ``threshold > 0``, elements with ``|a| >= threshold`` are
  outliers: they are left out of the row absmax, and every column holding one is zeroed in the
  codes (its product is computed in floating point by the caller); ``outlier_cols`` lists those
  columns (empty when there are none); with ``threshold == 0`` it is None. Codes are
  ``round(a * (127 / absmax))`` in fp32 (round half to even); an all-zero row gets codes 0.
* ``int8_vectorwise_dequant(A, stats) = A * stats[:, None] / 127`` (fp32).
* ``int8_linear_matmul(A, B) = A @ B.T`` exactly, int32 (``A [M, K]``, ``B [N, K]`` int8), via
  ``torch._int_mm`` (an outer product for K = 1, where ``_int_mm`` is wrong on CPU).
* ``int8_mm_dequant(C, row_stats, col_stats, dtype=fp16, bias=None) = C * (row * col) / 127^2``
  (+ bias) in fp32, cast once to ``dtype``. bitsandbytes multiplies by the literal 6.200124e-05
  where 1/127^2 = 6.2000124e-05, so its results differ from these by ~2e-5 relative.
* ``int8_linear_dequant(A, B, row_stats, col_stats, bias=None, dtype=fp16)``: the two above in
  one op (bitsandbytes calls it ``int8_scaled_mm``).

``A`` may have any leading dimensions (rows = all but the last); outputs keep them.
"""

from __future__ import annotations

import torch

from .dispatch import one_device_fake

__all__ = ["int8_vectorwise_quant", "int8_vectorwise_dequant", "int8_linear_matmul", "int8_mm_dequant", "int8_linear_dequant"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _rows(A: torch.Tensor, what: str = "A") -> torch.Tensor:
    """``A`` as ``[rows, K]``; no rows (M = 0) is fine, K = 0 is not."""
    if A.dim() < 1 or A.shape[-1] == 0:
        raise ValueError(f"{what}: expected a tensor with a non-empty last (feature) dimension, got shape {list(A.shape)}")
    return A.reshape(-1, A.shape[-1])


@torch.library.custom_op(
    "torchq::int8_vectorwise_quant", mutates_args=(), schema="(Tensor A, float threshold=0.) -> (Tensor, Tensor, Tensor?)"
)
def int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if A.dtype not in _FLOATS:
        raise TypeError(f"A: expected fp32, bf16 or fp16, got {A.dtype}")
    if not threshold >= 0.0:
        raise ValueError(f"threshold: expected >= 0 (0 disables outliers), got {threshold}")
    x = _rows(A).float()
    outlier_cols = None
    if threshold > 0.0:
        outliers = x.abs() >= threshold
        x = x.masked_fill(outliers, 0.0)
        outlier_cols = torch.nonzero(outliers.any(dim=0)).reshape(-1)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("A: contains NaN or inf (outside the outliers); int8 quantization needs finite values")
    row_stats = x.abs().amax(dim=1)
    scale = torch.where(row_stats > 0, 127.0 / row_stats, torch.zeros_like(row_stats))
    codes = torch.round(x * scale[:, None]).to(torch.int8)
    if outlier_cols is not None and outlier_cols.numel():
        codes[:, outlier_cols] = 0
    return codes.reshape(A.shape), row_stats.reshape(A.shape[:-1]), outlier_cols


@int8_vectorwise_quant.register_fake
@one_device_fake('int8_vectorwise_quant')
def _(A, threshold=0.0):
    cols = None
    if threshold > 0.0:
        ctx = torch.library.get_ctx()
        cols = A.new_empty((ctx.new_dynamic_size(),), dtype=torch.int64)
    return A.new_empty(A.shape, dtype=torch.int8), A.new_empty(A.shape[:-1], dtype=torch.float32), cols


@torch.library.custom_op("torchq::int8_vectorwise_dequant", mutates_args=())
def int8_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    if A.dtype != torch.int8:
        raise TypeError(f"A: expected int8 codes, got {A.dtype}")
    rows = _rows(A)
    if stats.dtype != torch.float32 or stats.numel() != rows.shape[0]:
        raise ValueError(f"stats: expected fp32 with {rows.shape[0]} entries (one per row), got {stats.dtype} with {stats.numel()}")
    return ((rows.float() * stats.reshape(-1, 1)) / 127).reshape(A.shape)


@int8_vectorwise_dequant.register_fake
@one_device_fake('int8_vectorwise_dequant')
def _(A, stats):
    return A.new_empty(A.shape, dtype=torch.float32)


def _check_int8_pair(A: torch.Tensor, B: torch.Tensor) -> None:
    if A.dtype != torch.int8 or B.dtype != torch.int8:
        raise TypeError(f"A, B: expected int8, got {A.dtype} and {B.dtype}")
    if B.dim() != 2 or A.shape[-1] != B.shape[1]:
        raise ValueError(f"B: expected [N, K] with K = {A.shape[-1]} (A's last dimension), got shape {list(B.shape)}")


@torch.library.custom_op("torchq::int8_linear_matmul", mutates_args=())
def int8_linear_matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    _check_int8_pair(A, B)
    a = _rows(A)
    if a.shape[1] == 1:  # torch._int_mm on CPU returns wrong sums for K == 1 (torch 2.13): an outer product
        out = a.to(torch.int32) * B.to(torch.int32).reshape(1, -1)
    elif a.device.type in ("cpu", "cuda"):
        out = torch._int_mm(a, B.t())
    else:
        out = (a.long() @ B.long().t()).to(torch.int32)
    return out.reshape(*A.shape[:-1], B.shape[0])


@int8_linear_matmul.register_fake
@one_device_fake('int8_linear_matmul')
def _(A, B):
    return A.new_empty((*A.shape[:-1], B.shape[0]), dtype=torch.int32)


@torch.library.custom_op("torchq::int8_mm_dequant", mutates_args=())
def int8_mm_dequant(
    A: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor, dtype: torch.dtype | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if A.dtype != torch.int32:
        raise TypeError(f"A: expected int32 accumulators, got {A.dtype}")
    c = _rows(A)
    if row_stats.dtype != torch.float32 or row_stats.numel() != c.shape[0]:
        raise ValueError(f"row_stats: expected fp32 with {c.shape[0]} entries, got {row_stats.dtype} with {row_stats.numel()}")
    if col_stats.dtype != torch.float32 or col_stats.numel() != c.shape[1]:
        raise ValueError(f"col_stats: expected fp32 with {c.shape[1]} entries, got {col_stats.dtype} with {col_stats.numel()}")
    if bias is not None and bias.numel() != c.shape[1]:
        raise ValueError(f"bias: expected {c.shape[1]} entries, got shape {list(bias.shape)}")
    out = c.float() * (row_stats.reshape(-1, 1) * col_stats.reshape(1, -1)) / 16129.0
    if bias is not None:
        out = out + bias.reshape(1, -1).float()
    return out.to(dtype or torch.float16).reshape(A.shape)


@int8_mm_dequant.register_fake
@one_device_fake('int8_mm_dequant')
def _(A, row_stats, col_stats, dtype=None, bias=None):
    return A.new_empty(A.shape, dtype=dtype or torch.float16)


@torch.library.custom_op("torchq::int8_linear_dequant", mutates_args=())
def int8_linear_dequant(
    A: torch.Tensor, B: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor,
    bias: torch.Tensor | None = None, dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return int8_mm_dequant(int8_linear_matmul(A, B), row_stats, col_stats, dtype, bias)


@int8_linear_dequant.register_fake
@one_device_fake('int8_linear_dequant')
def _(A, B, row_stats, col_stats, bias=None, dtype=None):
    return A.new_empty((*A.shape[:-1], B.shape[0]), dtype=dtype or torch.float16)
