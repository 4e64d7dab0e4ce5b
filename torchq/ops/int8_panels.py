"""int8 linears on weights in VNNI panel order (:class:`torchq.layouts.int8_vnni.Int8VnniLayout`):
schemas, fakes, argument checks and references. The CPU kernels (:mod:`torchq.backends.native_cpu.int8_panels`)
run torchq's native int8 kernels on the panels as stored.

Panel order of an ``[N, K]`` int8 weight (bytes: ``ceil(N / 16) * 16 * Kp``, ``Kp = ceil(K / 64) * 64``):
per 16 weight rows and 4 positions, the 16 rows' 4 codes, so that code ``(n, k)`` sits at byte
``(n // 16) * 16 * Kp + (k // 4) * 64 + (n % 16) * 4 + k % 4``; zero past ``N`` and ``K``. That is
the operand order of AVX-512 VNNI (``vpdpbusd`` over 16 rows at once) and of AMX's B tiles. Beside
the panels: ``code_sums`` int32 ``[N]`` (``Σ_k codes[n, k]``; the kernels' +128 offset and the static
zero point's correction read them) and the per-row scales.

The three ops mean exactly what ``torchq::int8_weight_linear``, ``int8_dynamic_linear`` and
``int8_static_linear`` (:mod:`torchq.ops.int8`) mean on the row-major codes; their references
unpack the panels and call those references.
"""

from __future__ import annotations

import torch

from .devices import check_op_devices
from .int8 import int8_dynamic_reference, int8_static_reference, int8_weight_reference

__all__ = [
    "PANEL_ROWS", "PANEL_STEP", "panel_numel", "pack_panels", "unpack_panels", "check_panel_args", "int8_panel_weight_linear",
    "int8_panel_dynamic_linear", "int8_panel_static_linear", "panel_weight_reference", "panel_dynamic_reference",
    "panel_static_reference",
]

PANEL_ROWS = 16  # weight rows per panel
PANEL_STEP = 64  # a row's positions are padded to a multiple of this
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def panel_numel(n: int, k: int) -> int:
    """Bytes of an ``[n, k]`` weight in panel order."""
    return -(-n // PANEL_ROWS) * PANEL_ROWS * (-(-k // PANEL_STEP) * PANEL_STEP)


def pack_panels(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 ``codes [n, k]`` in panel order (int8, 1-D, :func:`panel_numel` bytes) and their row
    sums (int32 ``[n]``)."""
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"codes: expected int8 [N, K], got {codes.dtype} {list(codes.shape)}")
    n, k = codes.shape
    rows, kp = -(-n // PANEL_ROWS) * PANEL_ROWS, -(-k // PANEL_STEP) * PANEL_STEP
    padded = codes.new_zeros(rows, kp)
    padded[:n, :k] = codes
    panels = padded.view(rows // PANEL_ROWS, PANEL_ROWS, kp // 4, 4).permute(0, 2, 1, 3).reshape(-1)
    return panels.contiguous(), codes.sum(dim=1, dtype=torch.int32).contiguous()


def unpack_panels(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The row-major int8 codes ``[n, k]`` of a weight in panel order (exactly the codes packed)."""
    numel = panel_numel(n, k)
    if panels.dtype != torch.int8 or panels.numel() != numel:
        raise ValueError(f"panels: expected {numel} int8 bytes for a [{n}, {k}] weight, got {panels.dtype} {list(panels.shape)}")
    rows, kp = -(-n // PANEL_ROWS) * PANEL_ROWS, -(-k // PANEL_STEP) * PANEL_STEP
    full = panels.reshape(rows // PANEL_ROWS, kp // 4, PANEL_ROWS, 4).permute(0, 2, 1, 3).reshape(rows, kp)
    return full[:n, :k].contiguous()


def check_panel_args(op: str, x: torch.Tensor, panels: torch.Tensor, code_sums: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> tuple[int, int]:
    """The argument checks every panel op shares; returns ``(n, k)``."""
    check_op_devices(op, x, panels=panels, code_sums=code_sums, scale=scale, bias=bias)
    if x.dtype not in _FLOATS:
        raise TypeError(f"torchq {op}: x: expected fp32, bf16 or fp16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"torchq {op}: x: expected [..., K], got a scalar")
    n, k = scale.numel(), x.shape[-1]
    if scale.dim() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"torchq {op}: scale: expected fp32 [N] (one per row), got {scale.dtype} {list(scale.shape)}")
    if code_sums.dtype != torch.int32 or tuple(code_sums.shape) != (n,):
        raise ValueError(f"torchq {op}: code_sums: expected int32 [{n}], got {code_sums.dtype} {list(code_sums.shape)}")
    if panels.dtype != torch.int8 or panels.dim() != 1 or panels.numel() != panel_numel(n, k):
        raise ValueError(f"torchq {op}: panels: expected int8 [{panel_numel(n, k)}] (a [{n}, {k}] weight in panel order), "
                         f"got {panels.dtype} {list(panels.shape)}")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"torchq {op}: bias: expected {n} entries, got shape {list(bias.shape)}")
    return n, k


def _codes(x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return unpack_panels(panels, scale.numel(), x.shape[-1])


def panel_weight_reference(x, panels, code_sums, scale, bias) -> torch.Tensor:
    """``int8_panel_weight_linear``'s meaning on checked arguments."""
    return int8_weight_reference(x, _codes(x, panels, scale), scale, bias)


def panel_dynamic_reference(x, panels, code_sums, scale, quant_min, quant_max, eps, bias) -> torch.Tensor:
    """``int8_panel_dynamic_linear``'s meaning on checked arguments."""
    return int8_dynamic_reference(x, _codes(x, panels, scale), scale, quant_min, quant_max, eps, bias)


def panel_static_reference(x, panels, code_sums, scale, act_scale, act_zero_point, quant_min, quant_max, bias) -> torch.Tensor:
    """``int8_panel_static_linear``'s meaning on checked arguments."""
    return int8_static_reference(x, _codes(x, panels, scale), scale, act_scale, act_zero_point, quant_min, quant_max, bias)


@torch.library.custom_op("torchq::int8_panel_weight_linear", mutates_args=())
def int8_panel_weight_linear(x: torch.Tensor, panels: torch.Tensor, code_sums: torch.Tensor, scale: torch.Tensor,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torchq::int8_weight_linear`` on a weight in panel order (reference: unpacked)."""
    check_panel_args("int8_panel_weight_linear", x, panels, code_sums, scale, bias)
    return panel_weight_reference(x, panels, code_sums, scale, bias)


@int8_panel_weight_linear.register_fake
def _(x, panels, code_sums, scale, bias=None):
    check_op_devices("int8_panel_weight_linear", x, panels=panels, code_sums=code_sums, scale=scale, bias=bias)
    return x.new_empty((*x.shape[:-1], scale.shape[0]))


def check_panel_dynamic_args(x, panels, code_sums, scale, quant_min, quant_max, eps, bias) -> None:
    """The argument checks of ``int8_panel_dynamic_linear``."""
    check_panel_args("int8_panel_dynamic_linear", x, panels, code_sums, scale, bias)
    if not (-128 <= quant_min < 0 < quant_max <= 127 and quant_min + quant_max in (0, -1)):
        raise ValueError(f"quant_min, quant_max: expected a symmetric int8 range ([-q, q] or [-q-1, q]), got [{quant_min}, {quant_max}]")
    if not eps > 0:
        raise ValueError(f"eps: expected > 0, got {eps}")


@torch.library.custom_op("torchq::int8_panel_dynamic_linear", mutates_args=())
def int8_panel_dynamic_linear(x: torch.Tensor, panels: torch.Tensor, code_sums: torch.Tensor, scale: torch.Tensor, quant_min: int,
                              quant_max: int, eps: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torchq::int8_dynamic_linear`` on a weight in panel order (reference: unpacked)."""
    check_panel_dynamic_args(x, panels, code_sums, scale, quant_min, quant_max, eps, bias)
    return panel_dynamic_reference(x, panels, code_sums, scale, quant_min, quant_max, eps, bias)


@int8_panel_dynamic_linear.register_fake
def _(x, panels, code_sums, scale, quant_min, quant_max, eps, bias=None):
    check_op_devices("int8_panel_dynamic_linear", x, panels=panels, code_sums=code_sums, scale=scale, bias=bias)
    return x.new_empty((*x.shape[:-1], scale.shape[0]))


def check_panel_static_args(x, panels, code_sums, scale, act_scale, act_zero_point, quant_min, quant_max, bias) -> None:
    """The argument checks of ``int8_panel_static_linear`` (the activation scheme's: :class:`~torchq.activation.StaticInt8`)."""
    from ..activation import StaticInt8

    check_panel_args("int8_panel_static_linear", x, panels, code_sums, scale, bias)
    StaticInt8(act_scale, act_zero_point, quant_min, quant_max)


@torch.library.custom_op("torchq::int8_panel_static_linear", mutates_args=())
def int8_panel_static_linear(x: torch.Tensor, panels: torch.Tensor, code_sums: torch.Tensor, scale: torch.Tensor, act_scale: float,
                             act_zero_point: int, quant_min: int, quant_max: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torchq::int8_static_linear`` on a weight in panel order (reference: unpacked)."""
    check_panel_static_args(x, panels, code_sums, scale, act_scale, act_zero_point, quant_min, quant_max, bias)
    return panel_static_reference(x, panels, code_sums, scale, act_scale, act_zero_point, quant_min, quant_max, bias)


@int8_panel_static_linear.register_fake
def _(x, panels, code_sums, scale, act_scale, act_zero_point, quant_min, quant_max, bias=None):
    check_op_devices("int8_panel_static_linear", x, panels=panels, code_sums=code_sums, scale=scale, bias=bias)
    return x.new_empty((*x.shape[:-1], scale.shape[0]))
