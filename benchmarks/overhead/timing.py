"""The paired statistic: both sides timed in the same rounds, compared within each round.

Each round times one batch of calls of each side back to back (the order alternating from round to
round), with ``gc`` disabled while timing. The number of calls per batch is calibrated per side so a
batch lasts about ``batch_ms``. The verdict is the median over rounds of the within-round ratio
candidate / baseline: this machine changes speed by up to 2x within seconds, and a round's two
batches, milliseconds apart, almost always run at the same speed, while each side's median over a
whole case can mix speeds. A microsecond figure is that ratio's excess times the baseline's fastest
round: the overhead at the machine's undisturbed speed. Each side's own median and fastest round are
kept as well, for comparison.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Paired", "Side", "measure", "time_batch"]


@dataclass(frozen=True)
class Side:
    """One side's per-call time in each round, in microseconds, and the calls per batch it was timed with."""

    samples: tuple[float, ...]
    calls_per_batch: int

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        """The fastest round: the least disturbed estimate of this side alone."""
        return min(self.samples)

    @property
    def iqr_rel(self) -> float:
        """``(p75 - p25) / median`` over rounds (0 with fewer than two rounds)."""
        if len(self.samples) < 2:
            return 0.0
        q = statistics.quantiles(self.samples, n=4, method="inclusive")
        return (q[2] - q[0]) / self.median


@dataclass(frozen=True)
class Paired:
    """Both sides of one comparison over the same rounds: ``candidate.samples[i]`` and
    ``baseline.samples[i]`` were timed back to back."""

    candidate: Side
    baseline: Side

    def __post_init__(self) -> None:
        if len(self.candidate.samples) != len(self.baseline.samples) or not self.candidate.samples:
            raise ValueError(
                f"paired samples need the same, non-zero number of rounds on both sides, got "
                f"{len(self.candidate.samples)} and {len(self.baseline.samples)}"
            )

    @property
    def rounds(self) -> int:
        return len(self.candidate.samples)

    @property
    def ratios(self) -> list[float]:
        """candidate / baseline within each round."""
        return [c / b for c, b in zip(self.candidate.samples, self.baseline.samples)]

    @property
    def ratio(self) -> float:
        """The verdict's statistic: the median over rounds of the within-round ratio."""
        return statistics.median(self.ratios)

    @property
    def ratio_quartiles(self) -> tuple[float, float]:
        """p25 and p75 of the within-round ratio (both the ratio itself with fewer than two rounds)."""
        if self.rounds < 2:
            return self.ratio, self.ratio
        q = statistics.quantiles(self.ratios, n=4, method="inclusive")
        return q[0], q[2]

    @property
    def delta_us(self) -> float:
        """The paired overhead per call in microseconds: ``(ratio - 1) x`` the baseline's fastest round."""
        return (self.ratio - 1.0) * self.baseline.best

    @property
    def medians_ratio(self) -> float:
        return self.candidate.median / self.baseline.median

    @property
    def medians_delta_us(self) -> float:
        return self.candidate.median - self.baseline.median

    @property
    def best_ratio(self) -> float:
        return self.candidate.best / self.baseline.best

    @property
    def best_delta_us(self) -> float:
        return self.candidate.best - self.baseline.best


def time_batch(fn: Callable[[Any], Any], arg: Any, n: int) -> int:
    """Nanoseconds for ``n`` calls of ``fn(arg)``; the loop is inside the time, as on both sides."""
    it = range(n)
    t0 = time.perf_counter_ns()
    for _ in it:
        fn(arg)
    return time.perf_counter_ns() - t0


def _calibrate(fn: Callable[[Any], Any], arg: Any, reset: Callable[[], None] | None, batch_ns: int) -> int:
    """Calls per batch so that one batch lasts about ``batch_ns``."""
    n = 1
    while True:
        if reset is not None:
            reset()
        t = time_batch(fn, arg, n)
        if t >= batch_ns / 4 or n >= 1 << 22:
            return max(1, round(n * batch_ns / max(t, 1)))
        n *= 4


def measure(
    sides: Sequence[tuple[Callable[[Any], Any], Any]],
    rounds: int,
    batch_ms: float,
    reset: Callable[[], None] | None = None,
) -> Paired:
    """Time ``sides = [(candidate, arg), (baseline, arg)]`` over ``rounds`` interleaved rounds.

    ``reset`` runs before every batch, outside the timed region (a store that grows is cleared).
    ``gc`` is collected first and disabled while timing; its previous state is restored.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if batch_ms <= 0:
        raise ValueError(f"batch_ms must be > 0, got {batch_ms}")
    (candidate, candidate_arg), (baseline, baseline_arg) = sides
    pairs = [(candidate, candidate_arg), (baseline, baseline_arg)]
    batch_ns = int(batch_ms * 1e6)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for fn, arg in pairs:  # warm-up: caches, container specs, a call site's first-record bookkeeping
            if reset is not None:
                reset()
            time_batch(fn, arg, 8)
        counts = [_calibrate(fn, arg, reset, batch_ns) for fn, arg in pairs]
        samples: list[list[float]] = [[], []]
        for r in range(rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                fn, arg = pairs[i]
                if reset is not None:
                    reset()
                samples[i].append(time_batch(fn, arg, counts[i]) / counts[i] / 1e3)
    finally:
        if reset is not None:
            reset()
        if was_enabled:
            gc.enable()
    return Paired(Side(tuple(samples[0]), counts[0]), Side(tuple(samples[1]), counts[1]))
