"""When the watch audits: one thread's step boundaries, their signals, and the back-off of each signal.

Pure logic: the caller reads the constant-time signals (the oldest stamp alive, the parameters'
reference count), gives each boundary's time, and reports what each audit found; the memory figure is
read here, through an injectable reader, and what every piece of work may cost is the
:class:`~gradguard._watch.governor.Governor`'s. The design: ``docs/how-it-works.md`` (*The watch*);
what the schedule promises a user: ``docs/guide/finding-leaks.md``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Literal

from .allocated import CPU, AllocatedReader
from .backoff import Backoff
from .governor import BACKSTOP_SHARE, SHARE, Governor
from .trigger import DEFAULT_MEMORY, RESIDENT_FLOOR, Trigger, TriggerSettings
from .tuning import HUNTING_BACKSTOP_SHARE, HUNTING_FIRST, MEMORY_FIRST, OLD, OLD_HUNTING, QUIET, READ_SHARE, STARTUP
from .tuning import STEP_FREE as FREE

__all__ = [
    "FREE",
    "HUNTING_BACKSTOP_SHARE",
    "HUNTING_FIRST",
    "MEMORY_FIRST",
    "OLD",
    "OLD_HUNTING",
    "QUIET",
    "READ_SHARE",
    "STARTUP",
    "Reason",
    "Schedule",
]


_HELD = TriggerSettings(floor=1, fraction=0.0, window=64, boundaries=1, backoff=2.0)

Every = int | Literal["auto"]
Reason = Literal["start", "old", "held", "retry", "memory", "time"]
_SIGNAL: dict[str, str] = {"old": "old", "retry": "retry", "held": "held", "memory": "memory", "time": "time"}


@dataclasses.dataclass
class _Backoff(Backoff):
    """One step signal's requests (see :class:`~gradguard._watch.backoff.Backoff`), and its follow-up."""

    follow: bool = False  # the next request follows up on graphs the last audit left pending
    asked_at: int = 0  # the boundary of its last request


def _signals() -> dict[str, _Backoff]:
    """Each signal's back-off, fresh: a retry (a look again for old graphs no holder was found for) is held
    back from its first request, the others ask at once."""
    found = {name: _Backoff() for name in ("old", "held", "memory", "time")}
    found["retry"] = _Backoff(misses=FREE)
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
        self.old = OLD if every == "auto" else OLD_HUNTING
        """How many boundaries back a stamp alive asks for an audit."""
        self.governor = governor if governor is not None else Governor(clock)
        self.started: float | None = None
        self.spent = 0.0  # seconds all audits took
        self.backstop = 0.0  # of which the backstop's
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
        self.quiet_until = -math.inf
        """Before this time, a boundary with no signal, past the start-up check and before
        :attr:`retry_due`, asks for nothing: the caller may skip :meth:`boundary` for it (see
        :meth:`quiet` and :meth:`_plan_quiet`)."""
        self.retry_due: float = math.inf
        self._old_until = 0  # an old request is declined before this boundary (its back-off's gap) ...
        self._old_unaffordable = -math.inf  # ... or before this time (the governor's share)
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
        self.quiet_until = -math.inf
        self._old_until, self._old_unaffordable = 0, -math.inf

    def boundary(self, now: float, boundary: int, old: int | None, held: Mapping[str, int] | None) -> Reason | None:
        """The thread's boundary number ``boundary`` (from 1), at ``now``: why to audit it, or ``None``.

        Args:
            now: The clock's time.
            boundary: The boundary's number in the thread, from 1.
            old: The earliest epoch of a counted stamp alive above the last audit's horizon, or ``None``.
            held: The sampled parameters' reference count by name, when it changed (else ``None``).
        """
        self.seen = boundary
        if self.started is None:
            self.started = now
            self.governor.start(now)
        elif old is None and not held and self.quiet(boundary, now, None):
            return None  # the common boundary: no signal, nothing due on time
        hunting = self.every != "auto"
        if boundary > self.startup and hunting and boundary % self.every:  # type: ignore[operator]
            return None
        asked = self.held.observe(held) if held else None
        grew = self._read_memory(boundary)
        reason: Reason | None = None
        if old is not None and old <= boundary - self.old:
            reason = "old"
        elif asked is not None:
            reason = "held"
        elif self.retry_at is not None and boundary >= self.retry_at:
            reason = "retry"
        elif grew:
            reason = "memory"
        if boundary <= self.startup:
            return reason or "start"  # a signal's request at a start-up boundary is a full audit, at once
        if reason is not None and (hunting or self._affords(reason, boundary, now)):
            return reason
        if reason is not None:
            self.declined += 1
        if asked is not None:
            self.held.declined()
        if grew and self._trigger is not None:
            self._trigger.declined()
        if self._backstop(now, boundary):
            return "time"
        self._plan_quiet()
        return None

    def withdrawn(self, declined: bool) -> None:
        """The caller did not act on the ``old`` request :meth:`boundary` just granted: the collector freed
        its graphs or is yet to run (``declined``: no collection affordable now to tell, counted as a
        declined request). The quiet boundaries are planned again, as after a request :meth:`boundary`
        declines itself: while the collector's ration declines the next ones, they are skipped."""
        self.declined += declined
        self._plan_quiet()

    def _backstop(self, now: float, boundary: int) -> bool:
        """Whether an audit no signal asked for is due: for graphs no signal sees (at doubling gaps while
        they find nothing new, within the governor's share)."""
        if self.started is None or boundary < self._signals["time"].next_at:
            return False
        elapsed = now - self.started
        if self.every != "auto":
            if not self.backstops:
                return HUNTING_FIRST * self.first_cost <= elapsed
            return self.backstop + self.last_cost <= HUNTING_BACKSTOP_SHARE * elapsed
        return self.governor.affords(self.estimate(), now, BACKSTOP_SHARE)

    def estimate(self) -> float:
        """What the next audit of the whole heap is expected to cost: the last one's, else the start-up check's."""
        return self.last_cost or self.first_cost

    def _affords(self, reason: Reason, boundary: int, now: float) -> bool:
        """Whether a signal's request runs now: at once while its audits find something new (or for the
        first :data:`FREE` in a row that find nothing new), else once its doubling gap went by and the
        governor's share allows. A signal quiet for :data:`QUIET` boundaries starts afresh only while the
        governor's account is not overdrawn: a storm of stray requests is repaid before the next."""
        signal = self._signals[_SIGNAL[reason]]
        if reason != "retry" and boundary - signal.asked_at > max(QUIET, signal.gap) and self.governor.solvent(now):
            signal.misses, signal.gap, signal.next_at = 0, 1, 0  # quiet since: a new request is a new story
        signal.asked_at = boundary
        if reason == "memory":
            # Growth alone proves nothing (a replay buffer, a cache): at once only when the figure grew
            # MEMORY_FIRST times its threshold, then twice as far as at its last audit: a leak costs audits
            # logarithmic in its growth.
            if self._grown() >= max(2 * self._grown_at_audit, MEMORY_FIRST * self._threshold()):
                return True
        elif signal.misses < FREE or signal.follow:
            return True
        return boundary >= signal.next_at and self.governor.affords(signal.cost or self.estimate(), now)

    def _threshold(self) -> int:
        """The memory trigger's largest threshold now (its floor before it has one)."""
        if self._trigger is None:
            return 0
        return max([*self._trigger.thresholds().values(), self._trigger.settings.floor])

    def _plan_quiet(self) -> None:
        """When the next boundary without a signal can be skipped at once: until the memory figure or the
        backstop is due (hunting checks only its every-th boundaries), and before a retry is due. And
        while an old request would be declined (see :meth:`_holds_old`)."""
        self._old_until, self._old_unaffordable = 0, -math.inf
        if self.every != "auto":
            self.quiet_until, self.retry_due = -math.inf, 1 << 62
            return
        g = self.governor
        if self.started is None or g.started is None:
            return
        backstop = g.started + (g.hot + g.spent + self.estimate()) / BACKSTOP_SHARE
        reading = self._reader.next_due() if self._reader is not None else math.inf
        self.quiet_until = min(backstop, reading)
        self.retry_due = math.inf if self.retry_at is None else self.retry_at
        old = self._signals["old"]
        if old.misses >= FREE and not old.follow:
            # The governor's account only grows: before this time its share cannot afford the request.
            self._old_until = old.next_at
            self._old_unaffordable = g.started + (g.hot + g.spent + (old.cost or self.estimate())) / SHARE

    def quiet(self, boundary: int, now: float, old: int | None, collecting: bool = False) -> bool:
        """Whether boundary ``boundary``, at ``now``, whose parameters' count did not change, asks for
        nothing for sure: no signal and nothing due on time (see :attr:`quiet_until`), or only an old
        graph whose request is held back (see :meth:`_holds_old`; an old graph's request comes before a
        retry's, so a retry due changes nothing while one is alive). If so, the boundary is seen, as
        :meth:`boundary` would see it, and the caller skips that call: the common boundary, a storm's
        and a known leak's cost no more than a few comparisons.

        Args:
            boundary: The boundary's number in the thread, from 1.
            now: The clock's time.
            old: As :meth:`boundary`'s.
            collecting: Whether the caller would decline an old graph's request after :meth:`boundary`
                (the collector's own collections over their ration).

        Returns:
            ``True`` when :meth:`boundary` would return ``None`` and need not be called.
        """
        if not (now < self.quiet_until and self.startup < boundary):
            return False
        if old is None:
            if boundary >= self.retry_due:
                return False
        elif not self._holds_old(boundary, now, collecting):
            return False
        self.seen = boundary
        return True

    def _holds_old(self, boundary: int, now: float, collecting: bool) -> bool:
        """At a boundary quiet but for an old graph: whether the old signal's request is declined for
        sure, by :meth:`boundary` (its gap not gone by, or the governor's share not reached since the
        last plan) or by the caller after it (``collecting``: the collector's own collections are over
        their ration, see :meth:`~gradguard._watch.garbage.Collector.declines`). If so, it is counted as
        declined here, as either would count it."""
        signal = self._signals["old"]
        if boundary - signal.asked_at > max(QUIET, signal.gap):
            return False  # it was quiet since its last request: this one may start afresh
        if collecting or boundary < self._old_until or now < self._old_unaffordable:
            signal.asked_at = boundary
            self.declined += 1
            return True
        return False

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
            self.backstop += cost
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
        self._plan_quiet()

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
