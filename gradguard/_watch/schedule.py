"""When the watch audits: one thread's step boundaries, their signals, and what an audit may cost.

Pure logic: the caller reads the constant-time signals (the oldest stamp alive, the parameters'
reference count), gives each boundary's time, and reports each audit's outcome; the memory figure is
read here, through an injectable reader. The design: ``docs/how-it-works.md`` (*The watch*); what the
schedule promises a user: ``docs/guide/finding-leaks.md``; each constant's reason: its docstring.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Literal

from .allocated import AllocatedReader
from .trigger import RESIDENT_FLOOR, Trigger, TriggerSettings

__all__ = [
    "BACKSTOP_SHARE",
    "FIRST_COST",
    "HUNTING_BACKSTOP_SHARE",
    "HUNTING_FIRST",
    "IDLE_SHARE",
    "OLD",
    "OLD_HUNTING",
    "READ_SHARE",
    "REPEAT_SHARE",
    "STARTUP",
    "Reason",
    "Schedule",
]

STARTUP = 1
"""The start-up check: the first boundaries of a thread are audited whatever the signals say. The audit
stamps every graph alive, so a graph kept from the first step, of any shape, is old, and judged, at the
third boundary."""

OLD = 3
"""A stamp placed ``OLD`` or more boundaries before the current one, still alive, has lived through two:
the criterion's age for a leak, read in constant time."""

OLD_HUNTING = 2
"""With ``every=N``, a stamp that lived through one boundary already asks for an audit: a list that
keeps one record per step is a leak at its second record."""

IDLE_SHARE = 0.001
"""After the start-up check: the most of the thread's wall time that audits finding nothing new may take
(audits a signal asked for, when the one before found nothing new either)."""

REPEAT_SHARE = 0.01
"""The most of the wall time that audits finding only leaks already reported may take (``warn`` or
``detach`` while the program keeps leaking)."""

BACKSTOP_SHARE = 0.0005
"""The most of the wall time the backstop's audits may take, asked for by no signal: for graphs no
signal sees (a record below a backward's root, an activation kept with no parameter saved)."""

HUNTING_BACKSTOP_SHARE = 0.1
"""With ``every=N``: the most of the wall time the audits of the backstop may take. Hunting spends time
to find what no signal sees (a graph kept from a forward that saved no sampled parameter: ``torch.func``'s
transforms), and its first backstop audit comes once the time since the start-up check is
:data:`HUNTING_FIRST` times what that check took, so a short run gets one."""

HUNTING_FIRST = 3
"""With ``every=N``: how many times the start-up check's cost must go by before the backstop's first audit."""

READ_SHARE = 0.0005
"""The most of the wall time the memory readings may take."""

FIRST_COST = 0.25
"""Seconds an audit is assumed to take before the thread timed one: the backstop's first audit waits
until :data:`BACKSTOP_SHARE` of the wall time affords that much."""

_RETRY_CAP = 1024  # boundaries between two looks for old graphs no holder was found for, at most
_HELD = TriggerSettings(floor=1, fraction=0.0, window=64, boundaries=1, backoff=2.0)

Every = int | Literal["auto"]
Reason = Literal["start", "old", "held", "retry", "memory", "time"]


class Schedule:
    """One thread's schedule.

    Args:
        every: ``"auto"``, or a positive ``int`` (hunting: the signals of every ``every``-th boundary
            are acted on at once, whatever they cost; after the start-up check no audit is made
            without a signal but the backstop's, within :data:`HUNTING_BACKSTOP_SHARE`).
        memory: The memory trigger's settings, or ``None`` for no memory figure.
        reader: Builds the memory figure's reader (tests inject one).
        clock: The clock, in seconds (tests inject one).
    """

    def __init__(
        self,
        every: Every,
        memory: TriggerSettings | None,
        reader: Callable[[], AllocatedReader] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.every = every
        self.old = OLD if every == "auto" else OLD_HUNTING
        """How many boundaries back a stamp alive asks for an audit."""
        self.started: float | None = None
        self.spent = 0.0  # seconds all audits took
        self.charged = 0.0  # of which after the start-up check, finding nothing new
        self.repeated = 0.0  # of which finding only leaks already reported
        self.backstop = 0.0  # of which the backstop's
        self.backstops = 0  # the backstop's audits
        self.last_cost = 0.0  # of the last audit that read the whole heap
        self.first_cost = 0.0  # of the start-up check, whatever it read
        self.old_streak = 0  # searches for old graphs in a row that left graphs the signal asks about again
        self.repeating = False  # the last audit found only leaks already reported
        self.retry_at: int | None = None  # the boundary to look again for old graphs no holder was found for
        self._gap = 1
        self.held = Trigger(_HELD)
        self._clock = clock
        self._reader: AllocatedReader | None = None
        self._trigger: Trigger | None = None
        if memory is not None:
            share = None if every != "auto" else READ_SHARE
            made = (reader or (lambda: AllocatedReader(cpu="statm", share=share, clock=clock)))()
            if made.cpu_source == "statm" and memory.floor < RESIDENT_FLOOR:
                memory = dataclasses.replace(memory, floor=RESIDENT_FLOOR)
            self._reader, self._trigger = made, Trigger(memory)
        self._quiet_until = -math.inf  # before this time, a boundary with no signal asks for nothing
        self._retry_due: float = math.inf
        self.readings: dict[str, int] = {}  # the last memory figure read
        self.first_readings: dict[str, int] = {}  # the first one after the start-up check

    @property
    def trigger(self) -> Trigger | None:
        """The memory trigger, when this thread reads a memory figure."""
        return self._trigger

    @property
    def reader(self) -> AllocatedReader | None:
        return self._reader

    @property
    def read_seconds(self) -> float:
        """Wall time this thread's memory readings took."""
        return 0.0 if self._reader is None else self._reader.seconds

    def boundary(self, now: float, boundary: int, old: int | None, held: Mapping[str, int] | None) -> Reason | None:
        """The thread's boundary number ``boundary`` (from 1), at ``now``: why to audit it, or ``None``.

        Args:
            now: The clock's time.
            boundary: The boundary's number in the thread, from 1.
            old: The earliest epoch of a counted stamp alive newer than the last audit's horizon, or ``None``.
            held: The sampled parameters' reference count by name, when it changed (else ``None``).
        """
        if self.started is None:
            self.started = now
        elif old is None and not held and now < self._quiet_until and boundary < self._retry_due:
            return None  # the common boundary: no signal, nothing due on time (see _settle)
        elapsed = now - self.started
        hunting = self.every != "auto"
        if boundary > STARTUP and hunting and boundary % self.every:  # type: ignore[operator]
            return None
        asked = self.held.observe(held) if held else None
        grew = self._read_memory(boundary)
        reason: Reason | None = None
        if boundary <= STARTUP:
            reason = "start"
        elif old is not None and old <= boundary - self.old:
            reason = "old"
        elif asked is not None:
            reason = "held"
        elif self.retry_at is not None and boundary >= self.retry_at:
            reason = "retry"
        elif grew:
            reason = "memory"
        if reason is not None and (reason in ("start", "retry") or hunting or self._affords(reason, elapsed)):
            return reason
        if asked is not None:
            self.held.declined()
        if grew and self._trigger is not None:
            self._trigger.declined()
        if hunting:
            if not self.backstops and HUNTING_FIRST * self.first_cost <= elapsed:
                return "time"
            if self.backstops and self.backstop + self.last_cost <= HUNTING_BACKSTOP_SHARE * elapsed:
                return "time"
        elif self.charged + self.backstop + (self.last_cost or FIRST_COST) <= BACKSTOP_SHARE * elapsed:
            return "time"
        self._settle()
        return None

    def _settle(self) -> None:
        """When the next boundary without a signal can be skipped at once: until the memory figure or the
        backstop is due (hunting checks only its every-th boundaries), and before a retry is due."""
        if self.every != "auto":
            self._quiet_until, self._retry_due = -math.inf, 1 << 62
            return
        if self.started is None:
            return
        backstop = self.started + (self.charged + self.backstop + (self.last_cost or FIRST_COST)) / BACKSTOP_SHARE
        reading = self._reader.next_due() if self._reader is not None else math.inf
        self._quiet_until = min(backstop, reading)
        self._retry_due = math.inf if self.retry_at is None else self.retry_at

    def audited(
        self,
        cost: float,
        reason: Reason,
        *,
        new: bool,
        found: bool,
        unexplained: bool,
        boundary: int,
        pending: bool = False,
        partial: bool = False,
    ) -> None:
        """The audit of boundary ``boundary`` took ``cost`` seconds.

        Args:
            cost: Its wall time.
            reason: Why it ran.
            new: It found a leak no audit had reported.
            found: It found any leak.
            unexplained: Old graphs are still alive that it found no holder for (looked for again later,
                less and less often).
            boundary: The boundary's number.
            pending: It left old graphs that may still become leaks (a variable one boundary short of it, a
                graph another optimizer trains through): the constant-time signal keeps asking about them.
            partial: It read part of the heap (the start-up check of a watcher that followed every step:
                the collector's young generations): its cost is no estimate of the next audit's.
        """
        self.spent += cost
        self.backstops += reason == "time"
        if reason == "start":
            self.first_cost = cost
        elif new:
            self.old_streak = 0
        elif found:
            self.repeated += cost
        elif reason == "time":
            self.backstop += cost
        else:
            self.charged += cost
        if not partial:
            self.last_cost = cost
        if reason == "old" and not new:
            # Only a search that leaves graphs the signal asks about again repeats itself.
            self.old_streak = self.old_streak + 1 if pending else 0
        self.repeating = found and not new
        if unexplained:
            self.retry_at = boundary + self._gap
            self._gap = min(2 * self._gap, _RETRY_CAP)
        else:
            self.retry_at, self._gap = None, 1
        if reason != "start" and not self.first_readings:
            self.first_readings = dict(self.readings)
        if self._trigger is not None:
            self._trigger.audited(new)
        self.held.audited(new)
        self._settle()

    def _affords(self, reason: Reason, elapsed: float) -> bool:
        """Whether an audit a signal asked for fits the budgets (see the module constants). The
        parameters' count backs off by itself (its threshold doubles after each audit that found
        nothing new), and so do the looks for old graphs no holder was found for."""
        cost = self.last_cost or FIRST_COST
        if self.repeating:
            return self.repeated + cost <= REPEAT_SHARE * elapsed
        if reason == "memory" or (reason == "old" and self.old_streak):
            return self.charged + cost <= IDLE_SHARE * elapsed
        return True

    def _read_memory(self, boundary: int) -> bool:
        """Read the memory figure when due; whether the trigger asked for an audit."""
        if self._reader is None or self._trigger is None:
            return False
        readings = self._reader()
        if not readings:
            return False
        self.readings = readings
        if boundary > STARTUP and not self.first_readings:
            self.first_readings = dict(readings)
        return self._trigger.observe(readings) is not None
