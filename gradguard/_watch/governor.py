"""The governor: every second the watch spends in a process, charged to one budget.

The watch's work is of two kinds. The constant-time work at every boundary and every backward (the
stamps, the signals) is what following the graphs costs: it always runs and is charged. Everything
else (audits and their heap searches, reading the holders found before, repairs, memory readings) runs
only when a signal asks, and after the start-up check a request that is not the first of its signal, or
that follows one that found nothing new, runs only when the account allows it: the time charged since
the start-up check, plus the work's own estimated cost, within :data:`SHARE` of the wall time since the
watch's first boundary. One account per watcher, whatever the threads: the share the summary states is
its whole figure.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable

from .tuning import BACKSTOP_SHARE, COSTS_KEPT, SHARE

__all__ = ["BACKSTOP_SHARE", "SHARE", "Account", "Governor", "Ration"]


class Governor:
    """One watcher's account of its own time.

    Args:
        clock: The clock, in seconds (tests inject one).
    """

    __slots__ = ("_lock", "backwards", "below", "clock", "signals", "spent", "started", "startup", "stamping")

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self.started: float | None = None
        """When the first boundary was seen."""
        self.spent = 0.0
        """Seconds of work charged after the start-up check (audits, reads, repairs, readings)."""
        self.startup = 0.0
        """Seconds the start-up checks took."""
        self.stamping = 0.0
        """Seconds of constant-time work at backwards (charged without a lock: a lost update under
        contention costs a rounding error, a lock on every backward costs more)."""
        self.backwards = 0
        """Backwards seen (their roots stamped)."""
        self.below = 0.0
        """Seconds of stamping the nodes below the roots, at the backwards it was due at (without a lock)."""
        self.signals = 0.0
        """Seconds of constant-time work at boundaries (the signals, the boundary's bookkeeping)."""

    def locked(self) -> bool:
        """Whether its account is being written now (an idle look, which must not wait, is then not taken)."""
        return self._lock.locked()

    def start(self, now: float) -> None:
        """The first boundary was seen at ``now`` (later calls change nothing)."""
        if self.started is None:
            self.started = now

    def charge(self, seconds: float, startup: bool = False) -> None:
        """``seconds`` of work done (``startup``: by a start-up check, which the share does not count)."""
        with self._lock:
            if startup:
                self.startup += seconds
            else:
                self.spent += seconds

    def affords(self, estimate: float, now: float, share: float = SHARE) -> bool:
        """Whether work estimated at ``estimate`` seconds fits ``share`` of the wall time since the start.

        Args:
            estimate: The work's expected cost (its last run's, or a comparable one's).
            now: The clock's time.
            share: The share it may use (:data:`SHARE`, or a part of it).

        Returns:
            ``True`` when the time charged so far plus ``estimate`` is within the share.
        """
        if self.started is None:
            return False
        return self.hot + self.spent + estimate <= share * (now - self.started)

    def solvent(self, now: float) -> bool:
        """Whether the work charged after the start-up check is within :data:`SHARE` of the wall time
        since the start (the constant-time work aside): a request that runs at once, whatever it costs,
        runs only then, so that a run of them is repaid before the next."""
        return self.started is not None and self.spent <= SHARE * (now - self.started)

    @property
    def hot(self) -> float:
        """Seconds of constant-time work at backwards (their roots, and below them) and boundaries."""
        return self.stamping + self.below + self.signals

    @property
    def seconds(self) -> float:
        """All the time charged: start-up checks, work, and the constant-time work."""
        return self.startup + self.spent + self.hot

    def elapsed(self) -> float:
        """Wall time since the first boundary (0 before it)."""
        return 0.0 if self.started is None else self.clock() - self.started


class Account:
    """A governor's account as of one boundary, as :func:`~gradguard._watch.decision.decide` asks it (the
    micro-batch clock's: no backstop of its own).

    Args:
        governor: The watcher's governor.
        now: The boundary's time.
    """

    __slots__ = ("governor", "now")

    def __init__(self, governor: Governor, now: float) -> None:
        self.governor, self.now = governor, now

    def affords(self, estimate: float) -> bool:
        """Whether work estimated at ``estimate`` seconds fits :data:`SHARE` now."""
        return self.governor.affords(estimate, self.now)

    def solvent(self) -> bool:
        """Whether the account is not overdrawn now."""
        return self.governor.solvent(self.now)

    def backstop(self) -> bool:
        """Never: the step clock's backstop covers both clocks."""
        return False


class Ration:
    """When a job done at boundaries (a memory reading, the stamps below a backward's roots) may run next,
    to take at most ``share`` of the wall time: once the cheapest of its last :data:`COSTS_KEPT` runs is at
    most ``share`` of the time since the last one ended (the cheapest: one run the scheduler preempted does
    not stall the job). Its first run is due at once.

    Args:
        share: The part of the wall time it may take (a part of :data:`SHARE`).
    """

    __slots__ = ("costs", "next", "seconds", "share")

    def __init__(self, share: float) -> None:
        self.share = share
        self.costs: collections.deque[float] = collections.deque(maxlen=COSTS_KEPT)
        self.next = -math.inf
        """The clock's time from which it is due."""
        self.seconds = 0.0
        """All its runs' time."""

    def ran(self, start: float, end: float) -> None:
        """It ran from ``start`` to ``end``."""
        self.costs.append(end - start)
        self.seconds += end - start
        self.next = end + min(self.costs) / self.share
