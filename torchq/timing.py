"""Timing with a spread: interleaved rounds, median / quartiles / extremes, and whether a busy
machine still lets configs be ranked. Shared by ``autoquant``, ``torchq bench`` and the
real-model benchmark.

Interleaving: every function gets a slice of every round (round 1: a, b, c; round 2: a, b, c...),
so a slow phase of a shared machine hits all of them alike instead of one config's whole run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["Timing", "time_interleaved", "overlapping_pairs", "noise_note", "NOISY_SPREAD"]

NOISY_SPREAD = 0.25  # relative interquartile range above which a timing is called noisy
STALLED = 2.0  # median / fastest call above which a timing is called noisy (most calls were held up)


@dataclass(frozen=True)
class Timing:
    """Samples (seconds per call) of one function and their summary."""

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("samples: expected at least one timing, got none")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        """(Q1, Q3); the extremes when there are fewer than 4 samples."""
        if len(self.samples) < 4:
            return self.min, self.max
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q[0], q[2]

    @property
    def spread(self) -> float:
        """Interquartile range / median (with fewer than 4 samples: (max - min) / median)."""
        q1, q3 = self.quartiles
        return (q3 - q1) / self.median if self.median > 0 else 0.0

    @property
    def noisy(self) -> bool:
        """Spread above :data:`NOISY_SPREAD`, or the median over :data:`STALLED` times the fastest
        call (on an oversubscribed machine a parallel region waits for a descheduled thread: most
        calls then take a scheduler slice longer, consistently, so the quartiles stay close)."""
        return self.spread > NOISY_SPREAD or self.median > STALLED * self.min

    def overlaps(self, other: Timing) -> bool:
        """Whether the two interquartile ranges (extremes below 4 samples) overlap."""
        a1, a3 = self.quartiles
        b1, b3 = other.quartiles
        return a1 <= b3 and b1 <= a3

    def to_dict(self, scale: float = 1.0) -> dict:
        q1, q3 = self.quartiles
        return {"median": self.median * scale, "min": self.min * scale, "max": self.max * scale, "q1": q1 * scale,
                "q3": q3 * scale, "n": len(self.samples), "spread": self.spread, "noisy": self.noisy}


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    rounds: int = 3,
    budget_s: float = 0.0,
    min_reps: int = 1,
    max_reps: int = 1000,
    warmup: int = 1,
    sync: Callable[[], object] | None = None,
    on_round: Callable[[int], object] | None = None,
) -> dict[str, Timing]:
    """Time every function of ``fns`` in ``rounds`` interleaved rounds.

    ``warmup`` untimed calls each first. In each round, each function is called at least
    ``min_reps`` times and until ``budget_s / rounds`` seconds are spent, at most ``max_reps``
    times. ``sync`` (e.g. ``torch.cuda.synchronize``) runs after every call, inside the timing.
    ``on_round(i)`` is called after round ``i`` (1-based), e.g. for a progress line.
    Returns name -> :class:`Timing` of seconds per call."""
    if rounds < 1 or min_reps < 1:
        raise ValueError(f"rounds, min_reps: expected >= 1, got {rounds}, {min_reps}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if sync is not None:
        sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            deadline = time.perf_counter() + budget_s / rounds
            reps = 0
            while reps < min_reps or (reps < max_reps and time.perf_counter() < deadline):
                t = time.perf_counter()
                fn()
                if sync is not None:
                    sync()
                samples[name].append(time.perf_counter() - t)
                reps += 1
        if on_round is not None:
            on_round(r + 1)
    return {name: Timing(tuple(v)) for name, v in samples.items()}


def overlapping_pairs(timings: Mapping[str, Timing]) -> list[tuple[str, str]]:
    """Neighbours in median order whose spreads overlap: their order is not significant."""
    order = sorted(timings, key=lambda n: timings[n].median)
    return [(a, b) for a, b in zip(order, order[1:]) if timings[a].overlaps(timings[b])]


def noise_note(timings: Mapping[str, Timing], what: str = "") -> str | None:
    """A note (one line per finding) when the timings cannot all be ranked, None when they can:
    some timing is noisy (:attr:`Timing.noisy`: the machine is too noisy), or neighbours in
    median order overlap (their order is within noise)."""
    if len(timings) < 2:
        return None
    prefix = f"note: {what}: " if what else "note: "
    lines = []
    noisy = sorted(n for n, t in timings.items() if t.noisy)
    if noisy:
        lines.append(f"{prefix}the machine is too noisy to rank configs: spread above {NOISY_SPREAD:.0%} or median above "
                     f"{STALLED:g}x the fastest for {', '.join(noisy)}; rerun on an idle machine")
    pairs = overlapping_pairs(timings)
    if pairs:
        lines.append(f"{prefix}the speed ranges overlap for {', '.join(f'{a}/{b}' for a, b in pairs)}: their order is "
                     "within noise (more rounds may separate them)")
    return "\n".join(lines) or None
