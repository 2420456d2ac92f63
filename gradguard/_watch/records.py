"""What one watcher found and did: one :class:`HolderHistory` per holder, the counts, and the memory the
repairs measurably gave back.

:class:`Records` is the watcher's memory of its findings, read by :meth:`gradguard.Watcher.history`,
``bounded()``, ``figures()`` and the summary. A holder's row carries the figures of the last read of it
(an audit, or a read of a holder found before by name), its outcome, and what its repairs released.
Thread-safe: every thread's boundaries write here.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable

from .._policy import stats as _stats
from .._policy.message import human
from .allocated import in_use
from .criterion import Leak
from .messages import named
from .repair import PARTLY, REPAIRED, Repair
from .schedule import Schedule
from .summary import BOUNDED, HolderHistory
from .threads import ThreadState

__all__ = ["STORE", "Records"]

STORE = "audit"
"""The store name of the watch's repairs in :func:`gradguard.stats` (the site is the holder's path)."""


class Records:
    """The holders one watcher found, its counts (``audits``, ``memory``, ``searches``), and the seconds
    its audits took."""

    def __init__(self, told: Callable[[str, str, int], None] | None = None) -> None:
        self.lock = threading.Lock()
        self._told = told  # told(kind, holder, bytes) of each event, for the timeline
        self.history: dict[str, HolderHistory] = {}
        self.counts = {"audits": 0, "memory": 0, "searches": 0, "micro": 0}
        self.spent = 0.0

    def keys(self) -> set[str]:
        with self.lock:
            return set(self.history)

    def new_since(self, known: set[str]) -> bool:
        """Whether a leaking holder not in ``known`` was noted since."""
        with self.lock:
            return any(h not in known and e.outcome != BOUNDED for h, e in self.history.items())

    def repaired(self) -> set[str]:
        """The holders whose last outcome was a repair (in whole or in part)."""
        with self.lock:
            return {k for k, e in self.history.items() if e.outcome in (REPAIRED, PARTLY)}

    def note(
        self,
        leaks: Iterable[Leak],
        outcome: str,
        boundaries: int,
        repaired: int = 0,
        why: str = "",
        clock: str = "step",
    ) -> None:
        """The holders of ``leaks`` were read at watch boundary ``boundaries`` and acted on by ``outcome``:
        their rows take this read's figures (a leak found before stays a leak at a read that saw one step
        of it). ``clock``: ``"micro"`` for a leak found growing within a step."""
        with self.lock:
            for leak in leaks:
                r = leak.finding.retention
                entry = self.history.get(leak.finding.key)
                if entry is None:
                    entry = self.history[leak.finding.key] = HolderHistory(leak.finding.key, named(r), r.fix)
                    entry.found_at = boundaries
                elif entry.outcome != BOUNDED and outcome == BOUNDED:
                    continue
                elif entry.outcome == BOUNDED and outcome != BOUNDED:
                    entry.found_at = boundaries  # listed as bounded until now: found leaking here
                entry.path, entry.fix, entry.tensors, entry.pinned_bytes = named(r), r.fix, r.tensors, r.pinned_bytes
                entry.nodes, entry.node_bytes, entry.alive = r.nodes, r.node_bytes, any(leak.alive)
                if clock != "step" and entry.clock == "step" and entry.audits == 0:
                    entry.clock = clock
                if clock == entry.clock:
                    entry.survived = max(entry.survived, leak.survived)
                entry.audits += 1
                entry.repaired += repaired
                entry.outcome, entry.why = outcome, why
                if self._told is not None:
                    if entry.audits == 1 and outcome != BOUNDED:
                        self._told("leak-start", leak.finding.key, r.pinned_bytes + r.node_bytes)
                    kind = BOUNDED if outcome == BOUNDED else "repair" if repaired else "report"
                    self._told(kind, leak.finding.key, repaired and r.pinned_bytes)

    def refilled(self, key: str, released: int) -> tuple[int, int]:
        """A read of holder ``key`` by name released ``released`` tensors; returns the holder's pinned
        bytes and the estimate per tensor of what one releases."""
        with self.lock:
            entry = self.history[key]
            entry.repaired += released
            return entry.pinned_bytes, (entry.pinned_bytes + entry.node_bytes) // max(1, entry.tensors)

    def entries(self, leaks: bool) -> list[HolderHistory]:
        with self.lock:
            entries = [dataclasses.replace(e) for e in self.history.values() if (e.outcome != BOUNDED) == leaks]
        return sorted(entries, key=lambda e: (-e.pinned_bytes, e.holder))

    def pinned(self) -> int:
        with self.lock:
            return sum(e.pinned_bytes + e.node_bytes for e in self.history.values() if e.outcome != BOUNDED)

    def measure_repairs(self, state: ThreadState) -> None:
        """What the repairs since ``state.repairing`` was set gave back, measured (the memory in use before
        and after, once the audit let go of what it saw), shared among the holders by their estimates."""
        repairing, state.repairing = state.repairing, None
        if repairing is None or not repairing[1]:
            return
        after = in_use()
        before, estimates = repairing
        if after is None or before <= after:
            return
        total = sum(estimates.values()) or len(estimates)
        with self.lock:
            for key, estimate in estimates.items():
                entry = self.history.get(key)
                if entry is not None:
                    entry.released_bytes += (before - after) * (estimate or 1) // total


def measure_before_repairs(state: ThreadState) -> None:
    """Read the memory in use before the first repair since :meth:`Records.measure_repairs` last ran."""
    if state.repairing is None:
        before = in_use()
        if before is not None:
            state.repairing = (before, {})


def count_repair(state: ThreadState, key: str, done: Repair, pinned: int, estimate: int) -> None:
    """A repair of holder ``key`` counted in :func:`gradguard.stats`, its holder read again at the next
    boundary, and ``estimate`` (the bytes it should give back) added to what the memory measured is
    shared by."""
    if not done.detached:
        return
    _stats.count_at(STORE, key, done.detached, done.released, pinned)
    state.refilling = state.refilling or done.released > 0
    if state.repairing is not None and done.released:
        estimates = state.repairing[1]
        estimates[key] = estimates.get(key, 0) + estimate


def memory_clause(schedules: Iterable[Schedule], pinned: int) -> str:
    """The memory figure's growth after the start-up check in the threads of ``schedules``, in words:
    ``""`` when it did not grow past the memory rule's threshold; else by how much, and whether the
    ``pinned`` bytes of the holders found account for it."""
    grown: dict[str, int] = {}
    what = ""
    for schedule in schedules:
        if schedule.reader is None or schedule.trigger is None or not schedule.first_readings:
            continue
        floors = schedule.trigger.thresholds()
        for device, first in schedule.first_readings.items():
            growth = schedule.readings.get(device, first) - first
            if growth >= max(floors.get(device, 0), schedule.trigger.settings.floor):
                grown[device] = grown.get(device, 0) + growth
        what = what or schedule.reader.short()
    if not grown:
        return ""
    total = ", ".join(f"{device} +{human(g)}" for device, g in grown.items())
    if pinned:
        return f"memory ({what}) grew after the watch's first audits: {total}; the holders found pin {human(pinned)}"
    return (
        f"memory ({what}) grew after the watch's first audits: {total}, which no autograd graph the audits found "
        "explains (a cache, a buffer, the allocator's own)"
    )
