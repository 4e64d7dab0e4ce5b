"""LLM.int8 row-wise ("vectorwise") int8 ops, bitsandbytes-compatible: ``torch.ops.torchq.int8_*``.

* ``int8_vectorwise_quant(A, threshold=0.0) -> (codes int8 in A's shape, row_stats fp32 [rows],
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
* ``int8_scaled_mm(A, B, row_stats, col_stats, bias=None, dtype=fp16)``: the two above in one
  op; ``int8_linear_dequant`` is the same op under torchq's older name.
* ``int8_double_quant(A, threshold=0.0) -> (row codes, column codes, row_stats [rows],
  col_stats [K], outlier_cols)``: the row-wise quantization above plus the same per column
  (``col_stats`` = column absmax leaving out the outliers, which get column code 0).
* ``int8_mixed_scaled_mm(A, CA, CB, SCA, SCB, outlier_cols=None, bias=None) -> (out, subA)``:
  LLM.int8's linear: ``int8_scaled_mm(CA, CB, SCA, SCB, bias, A.dtype)`` plus, in A's dtype, the
  outlier columns' product ``subA @ dequant(CB[:, outlier_cols]).T`` with
  ``subA = A[:, outlier_cols]`` (``[rows, 0]`` without outliers), which is returned too.
* ``int8_linear_matmul.out(A, B, out)`` writes the int32 product into ``out``.

``A`` may have any leading dimensions (rows = their product): codes and products keep them,
``row_stats`` is always 1-D ``[rows]`` (bitsandbytes' contract), and a stats argument is read
as one value per row whatever its shape.
"""

from __future__ import annotations

import torch

from ..division import divide
from .devices import one_device_fake
from .out_overloads import define_out_overload

__all__ = ["int8_vectorwise_quant", "int8_vectorwise_dequant", "int8_linear_matmul", "int8_mm_dequant", "int8_scaled_mm",
           "int8_linear_dequant", "int8_double_quant", "int8_mixed_scaled_mm"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _fp32_rows(A: torch.Tensor) -> torch.Tensor:
    """``A`` as contiguous fp32 ``[rows, K]`` (so every output is contiguous, as the fakes say,
    whatever A's strides)."""
    return _rows(A).contiguous().float()


def _rows(A: torch.Tensor, what: str = "A") -> torch.Tensor:
    """``A`` as ``[rows, K]``; no rows (M = 0) is fine, K = 0 is not."""
    if A.dim() < 1 or A.shape[-1] == 0:
        raise ValueError(f"{what}: expected a tensor with a non-empty last (feature) dimension, got shape {list(A.shape)}")
    return A.reshape(-1, A.shape[-1])


def _check_quant_args(A: torch.Tensor, threshold: float) -> int:
    """The argument checks of the quantize ops (shared with their fakes); returns the row count."""
    if A.dtype not in _FLOATS:
        raise TypeError(f"A: expected fp32, bf16 or fp16, got {A.dtype}")
    if not threshold >= 0.0:
        raise ValueError(f"threshold: expected >= 0 (0 disables outliers), got {threshold}")
    return _rows(A).shape[0]


def _outliers(A: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(A as fp32 [rows, K] with outliers zeroed, outlier mask or None)``."""
    _check_quant_args(A, threshold)
    x = _fp32_rows(A)
    mask = None
    if threshold > 0.0:
        mask = x.abs() >= threshold
        x = x.masked_fill(mask, 0.0)
    if not bool(torch.isfinite(x).all()):
        raise ValueError("A: contains NaN or inf (outside the outliers); int8 quantization needs finite values")
    return x, mask


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 codes, fp32 absmax per row)`` of finite fp32 ``x [rows, K]``."""
    stats = x.abs().amax(dim=1)
    scale = torch.where(stats > 0, 127.0 / stats, torch.zeros_like(stats))
    return torch.round(x * scale[:, None]).to(torch.int8), stats


def _outlier_cols(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else torch.nonzero(mask.any(dim=0)).reshape(-1)


def _dynamic_cols(A: torch.Tensor, threshold: float) -> torch.Tensor | None:
    if threshold > 0.0:
        return A.new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.int64)
    return None


@torch.library.custom_op(
    "torchq::int8_vectorwise_quant", mutates_args=(), schema="(Tensor A, float threshold=0.0) -> (Tensor, Tensor, Tensor?)"
)
def int8_vectorwise_quant(A: torch.Tensor, threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x, mask = _outliers(A, threshold)
    codes, row_stats = _quantize_rows(x)
    outlier_cols = _outlier_cols(mask)
    if outlier_cols is not None and outlier_cols.numel():
        codes[:, outlier_cols] = 0
    return codes.reshape(A.shape), row_stats, outlier_cols


@int8_vectorwise_quant.register_fake
@one_device_fake('int8_vectorwise_quant')
def _(A, threshold=0.0):
    rows = _check_quant_args(A, threshold)
    return A.new_empty(A.shape, dtype=torch.int8), A.new_empty((rows,), dtype=torch.float32), _dynamic_cols(A, threshold)


@torch.library.custom_op(
    "torchq::int8_double_quant", mutates_args=(), schema="(Tensor A, float threshold=0.0) -> (Tensor, Tensor, Tensor, Tensor, Tensor?)"
)
def int8_double_quant(
    A: torch.Tensor, threshold: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Row-wise codes as :func:`int8_vectorwise_quant`, column-wise codes of the same values."""
    row_codes, row_stats, outlier_cols = torch.ops.torchq.int8_vectorwise_quant.default(A, threshold)
    x, _ = _outliers(A, threshold)
    col_codes, col_stats = _quantize_rows(x.t())
    return row_codes, col_codes.t().reshape(A.shape), row_stats, col_stats, outlier_cols


@int8_double_quant.register_fake
@one_device_fake('int8_double_quant')
def _(A, threshold=0.0):
    rows = _check_quant_args(A, threshold)
    codes = A.new_empty(A.shape, dtype=torch.int8)
    return (codes, torch.empty_like(codes), A.new_empty((rows,), dtype=torch.float32),
            A.new_empty((A.shape[-1],), dtype=torch.float32), _dynamic_cols(A, threshold))


def _check_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor) -> None:
    if A.dtype != torch.int8:
        raise TypeError(f"A: expected int8 codes, got {A.dtype}")
    rows = _rows(A).shape[0]
    if stats.dtype != torch.float32 or stats.numel() != rows:
        raise ValueError(f"stats: expected fp32 with {rows} entries (one per row), got {stats.dtype} with {stats.numel()}")


@torch.library.custom_op("torchq::int8_vectorwise_dequant", mutates_args=(), schema="(Tensor A, Tensor stats) -> Tensor")
def int8_vectorwise_dequant(A: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    _check_vectorwise_dequant(A, stats)
    return divide(_fp32_rows(A) * stats.reshape(-1, 1), 127).reshape(A.shape)


@int8_vectorwise_dequant.register_fake
@one_device_fake('int8_vectorwise_dequant')
def _(A, stats):
    _check_vectorwise_dequant(A, stats)
    return A.new_empty(A.shape, dtype=torch.float32)


def _check_int8_pair(A: torch.Tensor, B: torch.Tensor) -> None:
    if A.dtype != torch.int8 or B.dtype != torch.int8:
        raise TypeError(f"A, B: expected int8, got {A.dtype} and {B.dtype}")
    if B.dim() != 2 or A.shape[-1] != B.shape[1]:
        raise ValueError(f"B: expected [N, K] with K = {A.shape[-1]} (A's last dimension), got shape {list(B.shape)}")


# K columns per fp32 GEMM in _exact_int8_mm_cpu: every partial sum of int8 x int8 products over
# them is an integer of magnitude <= 1024 * 128 * 128 = 2^24, exact in fp32 in any order.
_EXACT_FP32_K = 1024


def _exact_int8_mm_cpu(a: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ B [N, K].T`` in exact int32 on the CPU. Not ``torch._int_mm``: on CPUs without
    VNNI its oneDNN kernel multiplies through 16-bit pair sums that saturate (torch 2.13 with
    AVX2 only: sums off by tens of thousands). fp32 GEMMs over blocks of 1024 columns are exact
    (see _EXACT_FP32_K), summed in int32; fp64 when fp32 matmuls may run at reduced precision."""
    if torch.get_float32_matmul_precision() != "highest":
        return (a.double() @ B.double().t()).to(torch.int32)
    out = torch.zeros(a.shape[0], B.shape[0], dtype=torch.int32)
    for k0 in range(0, a.shape[1], _EXACT_FP32_K):
        out.add_((a[:, k0:k0 + _EXACT_FP32_K].float() @ B[:, k0:k0 + _EXACT_FP32_K].float().t()).to(torch.int32))
    return out


@torch.library.custom_op("torchq::int8_linear_matmul", mutates_args=(), schema="(Tensor A, Tensor B) -> Tensor")
def int8_linear_matmul(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    _check_int8_pair(A, B)
    a = _rows(A)
    if a.shape[1] == 1:  # torch._int_mm on CPU returns wrong sums for K == 1 (torch 2.13): an outer product
        out = a.to(torch.int32) * B.to(torch.int32).reshape(1, -1)
    elif a.device.type == "cpu":
        out = _exact_int8_mm_cpu(a, B)
    elif a.device.type == "cuda":
        out = torch._int_mm(a, B.t())
    else:
        out = (a.long() @ B.long().t()).to(torch.int32)
    return out.reshape(*A.shape[:-1], B.shape[0])


@int8_linear_matmul.register_fake
@one_device_fake('int8_linear_matmul')
def _(A, B):
    _check_int8_pair(A, B)
    return A.new_empty((*A.shape[:-1], B.shape[0]), dtype=torch.int32)


define_out_overload("int8_linear_matmul", "(Tensor A, Tensor B, Tensor! out) -> ()")


def _check_stats(rows: int, cols: int, row_stats: torch.Tensor, col_stats: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Checks of the scales (and bias) of an int32 ``[rows, cols]`` product."""
    if row_stats.dtype != torch.float32 or row_stats.numel() != rows:
        raise ValueError(f"row_stats: expected fp32 with {rows} entries, got {row_stats.dtype} with {row_stats.numel()}")
    if col_stats.dtype != torch.float32 or col_stats.numel() != cols:
        raise ValueError(f"col_stats: expected fp32 with {cols} entries, got {col_stats.dtype} with {col_stats.numel()}")
    if bias is not None and bias.numel() != cols:
        raise ValueError(f"bias: expected {cols} entries, got shape {list(bias.shape)}")


@torch.library.custom_op(
    "torchq::int8_mm_dequant", mutates_args=(),
    schema="(Tensor A, Tensor row_stats, Tensor col_stats, ScalarType? dtype=None, Tensor? bias=None) -> Tensor",
)
def int8_mm_dequant(
    A: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor, dtype: torch.dtype | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if A.dtype != torch.int32:
        raise TypeError(f"A: expected int32 accumulators, got {A.dtype}")
    c = _rows(A)
    _check_stats(c.shape[0], c.shape[1], row_stats, col_stats, bias)
    out = divide(_fp32_rows(c) * (row_stats.reshape(-1, 1) * col_stats.reshape(1, -1)), 16129.0)
    if bias is not None:
        out = out + bias.reshape(1, -1).float()
    return out.to(dtype or torch.float16).reshape(A.shape)


@int8_mm_dequant.register_fake
@one_device_fake('int8_mm_dequant')
def _(A, row_stats, col_stats, dtype=None, bias=None):
    if A.dtype != torch.int32:
        raise TypeError(f"A: expected int32 accumulators, got {A.dtype}")
    c = _rows(A)
    _check_stats(c.shape[0], c.shape[1], row_stats, col_stats, bias)
    return A.new_empty(A.shape, dtype=dtype or torch.float16)


_SCALED_MM_SCHEMA = "(Tensor A, Tensor B, Tensor row_stats, Tensor col_stats, Tensor? bias=None, ScalarType? dtype=None) -> Tensor"


def _scaled_mm(
    A: torch.Tensor, B: torch.Tensor, row_stats: torch.Tensor, col_stats: torch.Tensor,
    bias: torch.Tensor | None = None, dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return int8_mm_dequant(int8_linear_matmul(A, B), row_stats, col_stats, dtype, bias)


def _scaled_mm_fake(A, B, row_stats, col_stats, bias=None, dtype=None):
    _check_int8_pair(A, B)
    _check_stats(_rows(A).shape[0], B.shape[0], row_stats, col_stats, bias)
    return A.new_empty((*A.shape[:-1], B.shape[0]), dtype=dtype or torch.float16)


int8_scaled_mm = torch.library.custom_op("torchq::int8_scaled_mm", _scaled_mm, mutates_args=(), schema=_SCALED_MM_SCHEMA)
int8_scaled_mm.register_fake(one_device_fake("int8_scaled_mm")(_scaled_mm_fake))
int8_linear_dequant = torch.library.custom_op("torchq::int8_linear_dequant", _scaled_mm, mutates_args=(), schema=_SCALED_MM_SCHEMA)
int8_linear_dequant.register_fake(one_device_fake("int8_linear_dequant")(_scaled_mm_fake))


def _check_mixed(A, CA, CB, SCA, SCB, outlier_cols, bias) -> None:
    if A.dtype not in _FLOATS:
        raise TypeError(f"A: expected fp32, bf16 or fp16, got {A.dtype}")
    if tuple(CA.shape) != tuple(A.shape):
        raise ValueError(f"CA: expected A's shape {list(A.shape)} (its int8 codes), got {list(CA.shape)}")
    if outlier_cols is not None and (outlier_cols.dim() != 1 or outlier_cols.dtype != torch.int64):
        raise ValueError(f"outlier_cols: expected 1-D int64 column indices, got {outlier_cols.dtype} {list(outlier_cols.shape)}")


@torch.library.custom_op(
    "torchq::int8_mixed_scaled_mm", mutates_args=(),
    schema="(Tensor A, Tensor CA, Tensor CB, Tensor SCA, Tensor SCB, Tensor? outlier_cols=None, Tensor? bias=None) -> (Tensor, Tensor?)",
)
def int8_mixed_scaled_mm(
    A: torch.Tensor, CA: torch.Tensor, CB: torch.Tensor, SCA: torch.Tensor, SCB: torch.Tensor,
    outlier_cols: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """LLM.int8 linear (see module doc): ``(out in A's dtype, subA [rows, len(outlier_cols)])``."""
    _check_mixed(A, CA, CB, SCA, SCB, outlier_cols, bias)
    a = _rows(A)
    cols = outlier_cols if outlier_cols is not None else torch.zeros(0, dtype=torch.int64, device=A.device)
    sub_a = a[:, cols]
    out = _scaled_mm(CA, CB, SCA, SCB, bias, A.dtype)
    if cols.numel():
        sub_b = int8_vectorwise_dequant(CB[:, cols].contiguous(), SCB).to(A.dtype)
        out = out.reshape(-1, CB.shape[0]).addmm(sub_a, sub_b.t()).reshape(out.shape)
    return out, sub_a


@int8_mixed_scaled_mm.register_fake
@one_device_fake('int8_mixed_scaled_mm')
def _(A, CA, CB, SCA, SCB, outlier_cols=None, bias=None):
    _check_mixed(A, CA, CB, SCA, SCB, outlier_cols, bias)
    rows = A.numel() // A.shape[-1]
    n_cols = 0 if outlier_cols is None else outlier_cols.shape[0]
    return A.new_empty((*A.shape[:-1], CB.shape[0])), A.new_empty((rows, n_cols))
