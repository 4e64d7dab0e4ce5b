"""Calibration statistics of linear layers, and the scope that hands them to configs.

A calibrated algorithm (GPTQ, AWQ) needs, per linear layer, statistics of its inputs on
calibration data. :func:`torchq.calibrate` gathers them block by block and quantizes that
block's layers inside :func:`calibration_scope`; a config whose ``algorithm`` is calibrated reads
its layer's statistics with :func:`statistics_for` (by the layer's qualified name, the ``label``
``quantize_`` gives it). Outside a scope, such a config raises :class:`CalibrationRequired`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CALIBRATED", "CalibrationRequired", "LayerStatistics", "calibration_scope", "statistics_for"]

#: algorithms that need calibration data (the others run on the weight alone)
CALIBRATED = ("gptq", "awq")


class CalibrationRequired(ValueError):
    """A config asks for a calibrated algorithm (GPTQ, AWQ) outside :func:`torchq.calibrate`."""


@dataclass
class LayerStatistics:
    """What calibration saw at one linear layer's input (``K`` input features).

    * ``hessian``: fp32 ``[K, K]``, ``X X^T / T`` over the ``T`` calibration tokens (GPTQ);
    * ``mean_abs``: fp32 ``[K]``, the mean ``|x|`` per input feature (AWQ's salience);
    * ``sample``: fp32 ``[S, K]``, a fixed subset of the input rows, or None;
    * ``tokens``: ``T``;
    * ``options``: per algorithm, its options (``{"gptq": {"damp": ...}, "awq": {"grid": ...}}``);
    * ``report``: filled in by the algorithm (errors, the codes it kept).
    """

    hessian: torch.Tensor | None
    mean_abs: torch.Tensor | None
    sample: torch.Tensor | None
    tokens: int
    options: dict[str, Any] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)


_SCOPE: ContextVar[dict[str, LayerStatistics] | None] = ContextVar("torchq_calibration_scope", default=None)


@contextlib.contextmanager
def calibration_scope(stats: dict[str, LayerStatistics]) -> Iterator[None]:
    """Within the block, calibrated configs read ``stats[label]``."""
    token = _SCOPE.set(stats)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def statistics_for(label: str | None, algorithm: str) -> LayerStatistics:
    """The statistics of layer ``label`` in the current :func:`calibration_scope`, or
    :class:`CalibrationRequired` naming what to do."""
    scope = _SCOPE.get()
    if scope is None:
        raise CalibrationRequired(
            f"algorithm {algorithm!r} needs calibration data; quantize with "
            f"torchq.calibrate(model, batches, config) instead of quantize_ (or use algorithm='rtn' / 'hqq', which need none)"
        )
    stats = scope.get(label or "")
    if stats is None:
        raise CalibrationRequired(
            f"algorithm {algorithm!r}: no calibration statistics for layer {label!r} (its input was never seen "
            f"during calibration: the layer did not run on the calibration batches)"
        )
    return stats
