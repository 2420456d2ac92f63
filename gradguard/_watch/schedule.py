"""One thread's step-clock state: its signals' readings, their back-offs, and what each audit taught.

The caller reads the constant-time signals (the oldest stamp alive, the parameters' reference count),
gives each boundary's time, and reports what each audit found; the memory figure is read here, through an
injectable reader. What a boundary does is :func:`gradguard._watch.decision.decide`'s, asked through
:meth:`Schedule.decide`; what any work may cost, the :class:`~gradguard._watch.governor.Governor`'s. The
design: ``docs/how-it-works.md`` (*The watch*); what the schedule promises a user:
``docs/guide/finding-leaks.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Literal

from .allocated import CPU, AllocatedReader
from .decision import Decision, Reason, Signal, Signals, decide, reason_of
from .governor import BACKSTOP_SHARE, Governor
from .trigger import DEFAULT_MEMORY, RESIDENT_FLOOR, Trigger, TriggerSettings
from .tuning import HUNTING_BACKSTOP_SHARE, HUNTING_FIRST, MEMORY_FIRST, OLD, QUIET, READ_SHARE, STARTUP
from .tuning import STEP_FREE as FREE

__all__ = [
    "FREE",
    "HUNTING_BACKSTOP_SHARE",
    "HUNTING_FIRST",
    "MEMORY_FIRST",
    "OLD",
    "QUIET",
    "READ_SHARE",
    "STARTUP",
    "Reason",
    "Schedule",
]


_HELD = TriggerSettings(floor=1, fraction=0.0, window=64, boundaries=1, backoff=2.0)

Every = int | Literal["auto"]
_SIGNAL: dict[str, str] = {"old": "old", "retry": "retry", "held": "held", "memory": "memory", "time": "time"}


def _signals() -> dict[str, Signal]:
    """Each signal's back-off, fresh: a retry (a look again for old graphs no holder was found for) is held
    back from its first request, the others ask at once."""
    found = {name: Signal() for name in ("old", "held", "memory", "time")}
    found["retry"] = Signal(misses=FREE)
    return found


class Schedule:
    """One thread's schedule.

    Args:
        every: ``"auto"``, or a positive ``int`` (hunting: the signals of every ``every``-th boundary
            are acted on at once, whatever they cost; after the start-up check no audit is made
            without a signal but the backstop's, within :data:`HUNTING_BACKSTOP_SHARE`).
        memory: The memory trigger's settings, or ``None`` for no memory figure.
        reader: Builds the memory figure's reader (tests inject one).
        clock: The clock, in seconds (tests inject one).
        governor: The watcher's account of its time (one per watcher; a new one by default).
    """

    def __init__(
        self,
        every: Every,
        memory: TriggerSettings | None,
        reader: Callable[[], AllocatedReader] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        governor: Governor | None = None,
    ) -> None:
        self.every = every
        self.old = OLD if every == "auto" else OLD - 1  # hunting: a list's second record asks
        """How many boundaries back a stamp alive asks for an audit."""
        self.governor = governor if governor is not None else Governor(clock)
        self.started: float | None = None
        self.spent = 0.0  # seconds all audits took
        self.backstop_seconds = 0.0  # of which the backstop's
        self.backstops = 0  # the backstop's audits
        self.last_cost = 0.0  # of the last audit that read the whole heap
        self.first_cost = 0.0  # of the start-up check, whatever it read
        self.retry_at: int | None = None  # the boundary to look again for old graphs no holder was found for
        self.startup = STARTUP  # boundaries up to which a boundary is a start-up check
        self.declined = 0  # requests the back-off or the governor declined
        self.held = Trigger(_HELD)
        self._signals = _signals()
        self._clock = clock
        self._reader: AllocatedReader | None = None
        self._trigger: Trigger | None = None
        if memory is not None:
            share = None if every != "auto" else READ_SHARE
            made = (reader or (lambda: AllocatedReader(cpu="statm", share=share, clock=clock)))()
            # The resident set moves by whole mappings: its own floor, for the CPU figure of the default rule
            # only (a CUDA figure, and a floor the user chose, are kept as they are).
            floors = {CPU: RESIDENT_FLOOR} if made.cpu_source == "statm" and memory is DEFAULT_MEMORY else None
            self._reader, self._trigger = made, Trigger(memory, floors)
        self.now = 0.0
        """The time of the boundary being decided."""
        self._asked: object | None = None  # the parameters' count's request at that boundary
        self.seen = 0
        """The number of the last boundary seen."""
        self._grown_at_audit = 0  # how far the memory figure had grown at the last audit it asked for
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

    def restart(self) -> None:
        """A new entry of the watch: its next boundaries are a start-up check again, and every signal asks
        at once again."""
        self.startup = self.seen + STARTUP
        self._signals = _signals()

    def read(
        self,
        now: float,
        boundary: int,
        old: int | None,
        held: Mapping[str, int] | None,
        *,
        known: bool = False,
        refill: bool = False,
    ) -> Signals:
        """The signals of the thread's boundary number ``boundary`` (from 1), at ``now``: the memory figure
        is read here when due, the parameters' count observed.

        Args:
            now: The clock's time.
            boundary: The boundary's number in the thread, from 1.
            old: The earliest epoch of a counted stamp alive above the last audit's horizon, or ``None``.
            held: The sampled parameters' reference count by name, when it changed (else ``None``).
            known: Holders found before can be read by name.
            refill: ``detach``: a holder repaired before fills again.
        """
        self.seen, self.now = boundary, now
        if self.started is None:
            self.started = now
            self.governor.start(now)
        startup = boundary <= self.startup
        hunting = self.every != "auto"
        if hunting and not startup and boundary % self.every:  # type: ignore[operator]
            return Signals("step", boundary, hunting=True, nth=False)
        self._asked = self.held.observe(held) if held else None
        grew = self._read_memory(boundary)
        return Signals(
            "step",
            boundary,
            startup=startup,
            old=old is not None and old <= boundary - self.old,
            held=self._asked is not None,
            retry=self.retry_at is not None and boundary >= self.retry_at,
            memory=grew,
            surge=grew and self._grown() >= max(2 * self._grown_at_audit, MEMORY_FIRST * self._threshold()),
            refill=refill,
            known=known,
            hunting=hunting,
        )

    def decide(self, signals: Signals) -> Decision:
        """:func:`~gradguard._watch.decision.decide` for ``signals`` (read by :meth:`read`), with this
        schedule's back-offs and the governor's account; a declined request is counted, and the signals that
        made it are told (they ask again while their figure stays up)."""
        reason = reason_of(signals)
        decision = decide(signals, self._signals[reason or "time"], self)
        if decision.declined:
            self.declined += 1
            if decision.declined == "signal":
                if self._asked is not None:
                    self.held.declined()
                if signals.memory and self._trigger is not None:
                    self._trigger.declined()
        return decision

    def boundary(self, now: float, boundary: int, old: int | None, held: Mapping[str, int] | None) -> Decision:
        """:meth:`read`, then :meth:`decide` (a caller with nothing to collect or read by name)."""
        return self.decide(self.read(now, boundary, old, held))

    # The account, as :func:`~gradguard._watch.decision.decide` asks it (as of the boundary being read).

    def affords(self, estimate: float) -> bool:
        """Whether work estimated at ``estimate`` seconds (the next audit's, when 0) fits the share now."""
        return self.governor.affords(estimate or self.estimate(), self.now)

    def solvent(self) -> bool:
        """Whether the governor's account is not overdrawn now."""
        return self.governor.solvent(self.now)

    def backstop(self) -> bool:
        """Whether an audit no signal asked for is due: for graphs no signal sees (at doubling gaps while
        they find nothing new, within the governor's share)."""
        if self.started is None or self.seen < self._signals["time"].next_at:
            return False
        elapsed = self.now - self.started
        if self.every != "auto":
            if not self.backstops:
                return HUNTING_FIRST * self.first_cost <= elapsed
            return self.backstop_seconds + self.last_cost <= HUNTING_BACKSTOP_SHARE * elapsed
        return self.governor.affords(self.estimate(), self.now, BACKSTOP_SHARE)

    def estimate(self) -> float:
        """What the next audit of the whole heap is expected to cost: the last one's, else the start-up check's."""
        return self.last_cost or self.first_cost

    def _threshold(self) -> int:
        """The memory trigger's largest threshold now (its floor before it has one)."""
        if self._trigger is None:
            return 0
        return max([*self._trigger.thresholds().values(), self._trigger.settings.floor])

    def audited(
        self,
        cost: float,
        reason: Reason,
        *,
        new: bool,
        unexplained: bool,
        boundary: int,
        pending: bool = False,
        partial: bool = False,
    ) -> None:
        """The audit of boundary ``boundary`` took ``cost`` seconds (already charged to the governor).

        Args:
            cost: Its wall time.
            reason: Why it ran.
            new: It found a leak no audit had reported.
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
            self.first_cost = max(self.first_cost, cost)
        elif reason == "time":
            self.backstop_seconds += cost
        if not partial:
            self.last_cost = cost
        if reason in _SIGNAL:
            self.handled(reason, boundary, cost, new=new, pending=pending)
        if reason == "memory":
            self._grown_at_audit = max(self._grown(), 1)
        if unexplained:
            self.retry_at = boundary + self._signals["retry"].gap
        else:
            self.retry_at = None
        if reason != "start" and not self.first_readings:
            self.first_readings = dict(self.readings)
        if self._trigger is not None:
            self._trigger.audited(new)
        self.held.audited(new)

    def handled(self, reason: Reason, boundary: int, cost: float, *, new: bool, pending: bool = False) -> None:
        """A signal's request was handled at ``boundary`` at ``cost`` (an audit, or a read of the holders
        found before): one that found nothing new doubles the signal's gap, unless it left graphs pending
        and was no follow-up itself (then the next request follows up at once)."""
        signal = self._signals[_SIGNAL[reason]]
        signal.follow = pending and not signal.follow and not new
        signal.handled(boundary, cost, new, FREE)

    def _grown(self) -> int:
        """How far the memory figure grew since the start-up check, all devices."""
        return sum(self.readings.get(d, v) - v for d, v in self.first_readings.items())

    def _read_memory(self, boundary: int) -> bool:
        """Read the memory figure when due; whether the trigger asked for an audit."""
        if self._reader is None or self._trigger is None:
            return False
        readings = self._reader()
        if not readings:
            return False
        self.readings = readings
        if boundary > self.startup and not self.first_readings:
            self.first_readings = dict(readings)
        return self._trigger.observe(readings) is not None
