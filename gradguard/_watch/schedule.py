"""When the watch audits: the schedule of one thread's step boundaries.

An audit searches the whole heap: on a CPU it costs as much as one or several steps of a small
model (``benchmarks/results/watch-cpu.md``), so the watch cannot audit every step of a run it is left
on. What it can afford at every step is a look at the memory figure.

``every=N``
    Every ``N``-th boundary of the thread (``every=1`` for tests and for hunting a leak).

``every="auto"`` with a memory figure (the default where one can be read)
    At every boundary the thread reads the bytes in use per device (:mod:`gradguard._watch.allocated`:
    CUDA's allocated bytes, glibc's in-use bytes on CPU), as long as the readings take at most
    :data:`READ_SHARE` of the wall time, and audits when the memory trigger asks for it
    (:mod:`gradguard._watch.trigger`: the figure rose past its low-water mark by more than a threshold in
    two readings in a row, and the confirming audits after that): a leak that starts at any step
    is audited within a couple of boundaries of its start (more where the readings are spread out)
    and reported at the next. Once a leak was
    found, the trigger's audits are held within :data:`TRIGGER_SHARE` of the wall time (a leak that
    ``detach`` releases and the program makes again is then audited as often as that affords). Behind it, a
    backstop on time: a boundary is also audited when the audits so far, plus one more as long as
    the last one, stay within :data:`BACKSTOP_SHARE` of the wall time since the thread's first
    boundary, for leaks too slow to move the figure (under ``floor / window`` bytes per step).

``every="auto"`` without a memory figure (``memory=False``, or no figure on this platform)
    The thread's first two boundaries (a leak from the first step shows at the second), then a
    boundary whenever the audits so far, plus two more as long as the last one, stay within
    :data:`AUTO_SHARE` of the wall time since the first boundary.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Literal

from .allocated import AllocatedReader
from .trigger import RESIDENT_FLOOR, Request, Trigger, TriggerSettings

__all__ = ["AUTO_SHARE", "BACKSTOP_SHARE", "FIRST_COST", "READ_SHARE", "TRIGGER_SHARE", "Reason", "Schedule"]

AUTO_SHARE = 0.01
"""Without a memory figure: the most of a thread's wall time since its first boundary its audits may take."""

BACKSTOP_SHARE = 0.0005
"""With a memory figure: the most of the wall time the backstop's audits may take (the trigger's
audits are not counted against it: a leak is worth them)."""

TRIGGER_SHARE = 0.05
"""The most of the wall time the trigger's audits may take once a leak was found: a leak the repair
releases again and again (``detach`` mode, while the program keeps leaking) is audited as often as
this affords, which keeps its memory bounded without slowing every step."""

READ_SHARE = 0.0015
"""The most of the wall time the memory readings may take: a step long enough is read at every
boundary; a reading that got expensive (a fragmented heap) is spread out instead of slowing steps."""

FIRST_COST = 0.25
"""Seconds an audit is assumed to take before the thread timed one: the backstop's first audit waits
until :data:`BACKSTOP_SHARE` of the wall time affords that much. It is set above what an audit of a
training process's heap costs (``benchmarks/results/watch-cpu.md``), so that the first audit, whose
cost is not known before it runs, does not take the backstop past its share; an audit of a heap
larger than that can still overrun it once, and the next waits for the share to catch up."""

Every = int | Literal["auto"]
Reason = Literal["every", "first", "time", "memory"]


class Schedule:
    """One thread's schedule (see the module documentation). ``memory``: the trigger's settings, or
    ``None`` for no memory figure; ``reader`` builds the figure's reader (given for tests)."""

    def __init__(
        self,
        every: Every,
        memory: TriggerSettings | None,
        reader: Callable[[], AllocatedReader] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.every = every
        self.boundaries = 0
        self.started = 0.0
        self.spent = 0.0  # seconds the audits took
        self.triggered = 0.0  # of which the trigger's, once a leak was found
        self.repeat_cost = 0.0  # the last of those
        self.found = False  # an audit of this thread found a leak
        self.read_seconds = 0.0  # seconds the memory readings took
        self.last_cost = 0.0
        self.request: Request | None = None  # what the trigger asked at the last boundary
        self._clock = clock
        self._reader: AllocatedReader | None = None
        self._trigger: Trigger | None = None
        self._figure = False  # a figure was read: the trigger rules this thread's schedule
        if every == "auto" and memory is not None:
            made = (reader or (lambda: AllocatedReader(share=READ_SHARE, clock=clock)))()
            if made.cpu_source == "statm" and memory.floor < RESIDENT_FLOOR:
                memory = dataclasses.replace(memory, floor=RESIDENT_FLOOR)
            self._reader, self._trigger = made, Trigger(memory)
            self._figure = made.cpu_source is not None

    @property
    def trigger(self) -> Trigger | None:
        """The memory trigger, when this thread reads a memory figure."""
        return self._trigger if self._figure else None

    @property
    def reader(self) -> AllocatedReader | None:
        return self._reader

    def boundary(self, now: float) -> Reason | None:
        """This thread's next boundary, at ``now``: why to audit it, or ``None`` not to."""
        if not self.boundaries:
            self.started = now
        self.boundaries += 1
        if self.every != "auto":
            return "every" if self.boundaries % self.every == 0 else None
        elapsed = now - self.started
        if self._trigger is not None:
            assert self._reader is not None
            before = self._clock()
            readings = self._reader()
            self.read_seconds += self._clock() - before
            self._figure = self._figure or bool(readings)  # CUDA's figure appears once CUDA is in use
            self.request = self._trigger.observe(readings)
            if self.request is not None:
                if not self.found or self.triggered + self.repeat_cost <= TRIGGER_SHARE * elapsed:
                    return "memory"
                self._trigger.declined()
                self.request = None
        if self._figure:
            return "time" if self.spent + (self.last_cost or FIRST_COST) <= BACKSTOP_SHARE * elapsed else None
        if self.boundaries <= 2:
            return "first"
        return "time" if self.spent + 2 * self.last_cost <= AUTO_SHARE * elapsed else None

    def audited(self, cost: float, new: bool, found: bool = False, reason: Reason | None = None) -> None:
        """The audit of the last boundary (asked for by ``reason``) took ``cost`` seconds; ``new``: it
        found a leak no earlier audit had reported, or released one; ``found``: it found any leak."""
        self.spent += cost
        self.last_cost = cost
        if reason == "memory" and self.found:  # finding the leak is free; going back for it again is not
            self.triggered += cost
            self.repeat_cost = cost
        self.found = self.found or found
        if self._trigger is not None:
            self._trigger.audited(new)
