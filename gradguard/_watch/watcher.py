"""The step-boundary watch's engine: :class:`Watcher`.

At a step boundary (``optimizer.step()`` has just run) the graphs of earlier steps should be gone.
Telling that one outlived its step and naming who holds it are two jobs: the first is done at every
boundary in constant time (stamps in the nodes of each backward's graph, whose deaths are counted;
the reference count of a few parameters, which every forward kept with its graph raises; the memory
figure), the second by an audit, a search of the heap that runs when one of those signals says a
graph is old, in the first boundaries of a thread, and within a small share of the wall time. What
is a leak: :mod:`gradguard._watch.criterion`; when to audit: :mod:`gradguard._watch.schedule`; the
design: ``docs/how-it-works.md``.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch

from .._errors import GraphRetentionError
from .._graph.stamps import Ledger
from .._heap.census import promotions
from .._heap.hold import work_clock
from .._policy.modes import DETACH, OFF, Mode, normalize_mode, resolve
from . import backwards, idle
from .audit import Ignore, RetentionReport, check_ignore
from .auditing import Auditor, Judging, Pile
from .decision import Collected, Reason
from .governor import Governor
from .known import Known
from .options import Every, parse_every, parse_memory, parse_optimizers
from .records import STORE, Records, memory_clause
from .schedule import Schedule
from .summary import HolderHistory, WatchFigures, render
from .threads import ParameterCount, ThreadState, micro_pending, stamp_backward
from .timeline import Timeline
from .trigger import TriggerSettings

__all__ = ["STORE", "Every", "HolderHistory", "Watcher"]

_clock = time.perf_counter
_sequence_nr = torch.autograd._get_sequence_nr
_ident = threading.get_ident


class Watcher:
    """Follows the graphs at step boundaries, audits when they outlive their step, and acts on the leaks.

    What is a leak, the schedule and the modes: the guide's *Finding a leak*. Call :meth:`boundary` at
    each step boundary (the :func:`gradguard.watch` scope does it from every
    ``torch.optim.Optimizer.step``; the framework callbacks from their step-end hooks). The watcher
    follows backwards from its first boundary (or :meth:`start`) until :meth:`close`.

    Args:
        every: ``"auto"`` (the default) or a positive ``int`` N: act on the signals of every N-th
            boundary at any cost, and audit when none asked within a tenth of the wall time (hunting).
        mode: ``"warn"``, ``"raise"``, ``"detach"``, ``"off"`` (aliases as everywhere in gradguard), or
            ``None``: the mode in force (:func:`gradguard.get_mode`) at each boundary, in its thread.
        ignore: Path prefixes or a predicate, as for :func:`gradguard.audit` (an iterable is read once, here).
        memory: ``True`` reads the memory figure with the default :class:`TriggerSettings`; a
            :class:`TriggerSettings` sets its rule; ``False`` reads none.

    Attributes:
        every: ``every``, checked: ``"auto"`` or the positive ``int``.
        mode: ``mode``, normalized to its canonical name, or ``None``.
        ignore: ``ignore`` as given.
        memory: The memory rule's settings, or ``None`` when the memory figure is not read.

    Raises:
        GradGuardError: a bad argument, naming it and what is accepted.
    """

    def __init__(
        self,
        every: int | str = "auto",
        mode: str | None = None,
        ignore: Ignore = None,
        memory: bool | TriggerSettings | None = True,
    ) -> None:
        self.every: Every = parse_every(every)
        self.mode: Mode | None = None if mode is None else normalize_mode(mode)
        self._ignore = check_ignore(ignore)  # a bad ignore is refused now; an iterable is read once
        self.ignore = ignore
        self.memory: TriggerSettings | None = parse_memory(memory, self.every)
        self._local = threading.local()
        self._lock = threading.Lock()
        self.timeline = Timeline()
        """What each boundary of both clocks read (the memory figure) and the events (audits, each holder's
        leak start, report and repair), bounded: ``gradguard run``'s reports and page, the callbacks' scalars."""
        # The timeline's buffers are folded by one thread at a time. Re-entrant: a collection inside a fold may
        # run a finalizer that steps an optimizer in the same thread, a boundary that records its point too.
        self._timeline_lock = threading.RLock()
        self._started = _clock()
        # The parts it owns call back into it weakly: a watcher nobody holds is freed at once (its backward
        # listener with it), not at the collector's next run, so a dropped one never acts at later backwards.
        self._records = Records(_weak(self, Watcher._told, None))
        self._known = Known()
        self._governor = Governor(_clock)
        self._auditor = Auditor(
            self._ignore, self._records, self._known, self._governor, _weak(self, Watcher._boundaries, 0)
        )
        self._states: list[ThreadState] = []
        self._primary: ThreadState | None = None  # the state of the thread that stepped last
        self._entry = 0  # entries of the watch (starts): each one's first boundaries are a start-up check
        self._failures = 0  # the backward listener's failures in the process when the watcher last started
        self._failed = 0  # those while it listened before it last closed
        self._listeners: list[Callable[[Watcher, BaseException | None], None]] = []
        self._backwards: backwards.Handle | None = None
        self._promotions: tuple[int, int] | None = None  # the collector's when the watcher started following
        self._ticked = False  # a boundary of either clock was seen: the idle looks are over
        self._piles: dict[str, Pile] = {}  # what the idle looks saw
        self._idle_error: GraphRetentionError | None = None  # the idle verdict, raised when the scope leaves

    def __repr__(self) -> str:
        return f"gradguard.Watcher(every={self.every!r}, mode={self.mode!r})"

    # ---------------------------------------------------------------------------------------------
    # Following backwards

    def start(self) -> None:
        """Follow every backward from now on (stamp its graph); each call is an entry of the watch, whose
        first boundaries are a start-up check in every thread. :meth:`boundary` starts it too."""
        with self._lock:
            self._entry += 1
            if self._backwards is None:
                self._promotions = promotions()
                self._failures = backwards.failures()
                self._backwards = handle = backwards.listen(_weak_listener(self))
                weakref.finalize(self, handle.remove)  # a watcher dropped without close()
        if not self._ticked:
            idle.follow(self)

    def close(self) -> None:
        """Stop following backwards; what the watcher found stays readable. It starts again at the next boundary.

        A watcher that saw no boundary of either clock concludes its idle looks here (:meth:`conclude`)."""
        self._idle_error = self.conclude()
        idle.retire(self)
        with self._lock:
            handle, self._backwards = self._backwards, None
            if handle is not None:
                self._failed += backwards.failures() - self._failures
        if handle is not None:
            handle.remove()

    def _on_backward(self, roots: Sequence[Any], nested: bool) -> backwards.After | None:
        start = _clock()  # finding the thread's state is the watch's work too
        self._ticked = True
        try:
            state: ThreadState = self._local.state
        except AttributeError:
            state = self._primary or self._state()
        else:
            if not state.clock.boundaries and self._primary is not None:
                state = self._primary  # a thread that never stepped feeds the optimizer of one that does
        governor = self._governor
        below = stamp_backward(state, roots, governor, self.every != "auto", start, nested)
        after = None
        # A worker thread's backward is aged by the boundaries of the thread that steps; this thread's
        # micro-batch boundary runs after the backward only when it has something to do.
        if not nested and state.owner == _ident() and any(micro_pending(state, start)):
            after = lambda: self._micro_boundary(state)  # noqa: E731
        governor.stamping += _clock() - start - below
        return after

    def _micro_boundary(self, state: ThreadState) -> None:
        """A micro-batch boundary: a backward of the thread of ``state`` returned (see
        :mod:`gradguard._watch.micro`). In ``raise`` mode a leak raises here, out of the backward."""
        start = _clock()
        if state.busy or self._backwards is None:
            return
        due, old = micro_pending(state, start)  # asked again: what the backward found may be gone since
        if not due and not old:
            self._governor.signals += _clock() - start
            return
        mode = self.mode or resolve(None)
        if mode == OFF:
            self._governor.signals += _clock() - start
            return
        if due and state.reader is not None:
            readings = state.reader()  # rationed: most boundaries read nothing, and put no point on the timeline
            if readings:
                self._point("micro", state, sum(readings.values()))
        if not old:
            self._governor.signals += _clock() - start
            return
        self._governor.start(start)  # the watch's share counts from its first boundary of either clock
        raised: BaseException | None = None
        acted = False
        try:
            decision, acted = self._auditor.micro(state, mode, self.every != "auto")
            if decision.action == "search":
                self._told("audit", "")
            acted = acted or decision.action == "search"
        except BaseException as error:
            raised = error
            raise
        finally:
            if acted or raised is not None:
                for listener in list(self._listeners):
                    listener(self, raised)

    # ---------------------------------------------------------------------------------------------
    # Boundaries

    def boundary(
        self, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None
    ) -> RetentionReport | None:
        """One step boundary of the calling thread, after the optimizer stepped.

        Args:
            optimizer: The ``torch.optim.Optimizer`` that stepped (or several, in an iterable), or
                ``None``. A graph is aged only by the boundaries of optimizers that update a parameter
                it reaches; ``None`` ages every graph.

        Returns:
            ``None`` when this boundary is not audited (no signal asked, mode ``off``, the same step as
            the thread's previous boundary, or a boundary reached from inside an audit); otherwise the
            report of the leaks the audit found (empty when none), after acting on them: ``warn`` warns
            once per holder (:class:`GraphRetentionWarning`, naming path, bytes and fix); ``detach``
            repairs what is dead (the value replaced, in the program's own state, by its detached
            self), counts it in :func:`gradguard.stats` (store ``"audit"``, site the holder) and warns
            once per holder it leaves alone; ``raise`` raises. Nothing the audit saw stays referenced.

        Raises:
            GraphRetentionError: in ``raise`` mode, naming every leak (its ``report`` attribute is the report).
            GradGuardError: ``optimizer`` is not an optimizer, an iterable of them, or ``None``.
        """
        if isinstance(optimizer, torch.optim.Optimizer):
            return self._boundary((id(optimizer),), (optimizer,))
        optimizers = parse_optimizers(optimizer)
        return self._boundary(tuple(map(id, optimizers)) or None, optimizers)

    def stepped(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """torch's optimizer step post hook (``register_optimizer_step_post_hook``): a boundary of
        ``optimizer``, as :meth:`boundary` (what it finds is acted on by the mode; the hook returns nothing).

        Args:
            optimizer: The optimizer that stepped.
            args: The ``step()`` call's positional arguments (unused).
            kwargs: Its keyword arguments (unused).

        Raises:
            GraphRetentionError: in ``raise`` mode, as :meth:`boundary`.
        """
        self._boundary((id(optimizer),), (optimizer,))

    def _boundary(self, source: Hashable, optimizers: tuple[Any, ...]) -> RetentionReport | None:
        # Every optimizer step of the process comes through here: the common path is kept short.
        start = _clock()
        if self._backwards is None:
            self.start()
            self._promotions = None  # started at a boundary: what the step before made may be anywhere
        try:
            state: ThreadState = self._local.state
        except AttributeError:
            state = self._state()
        if state.busy:
            return None
        self._ticked = True
        sequence = _sequence_nr()
        if sequence == state.sequence and source not in state.stepped:
            # another optimizer (or a callback) at the same step: one boundary, which ages its graphs too
            state.stepped.add(source)
            if source not in state.held:
                self._meet(state, source, optimizers)
            state.clock.also(source)
            state.partners.setdefault(state.first, set()).add(source)
            self._governor.signals += _clock() - start
            return None
        state.stepped = {source}
        state.first = source
        state.sequence = sequence
        held = state.held.get(source) or self._meet(state, source, optimizers)
        boundary = state.clock.tick(source)
        self._primary = state
        # What earlier steps' backwards left alive is the step clock's: the micro-batch clock asks only about
        # the graphs of this step's (it judges growth within one step).
        state.ledger.micro_horizon = max(state.ledger.micro_horizon, state.micro)
        self._point("step", state, sum(state.schedule.readings.values()) if state.schedule.readings else None)
        if not state.backwards and boundary > 1:
            state.unseen += 1
        state.backwards = 0
        if state.entry != self._entry:
            state.entry = self._entry
            if boundary > 1:
                state.schedule.restart()
        mode = self.mode or resolve(None)
        if mode == OFF:
            self._governor.signals += _clock() - start
            return None
        ledger, schedule = state.ledger, state.schedule
        through = boundary - schedule.old
        old = ledger.oldest_alive(through)
        count = held.read()
        changed = None
        if count is not None and count != held.last:
            held.last = count
            changed = {held.name: count}
        auto = self.every == "auto"
        signals = schedule.read(
            start, boundary, old, changed, known=auto and bool(self._known), refill=mode == DETACH and state.refilling
        )
        decision = schedule.decide(signals)
        self._governor.signals += _clock() - start
        judging: Judging | None = None  # the boundary as a read or a search judges it (see _judging)
        while decision.action in ("collect", "read"):  # questions: answered here, then asked again
            if decision.action == "collect":
                garbage = state.collector.garbage(lambda: ledger.oldest_alive(through), boundary)
                collected: Collected = "refused" if garbage is None else "garbage" if garbage else "survived"
                signals = signals._replace(collected=collected)
            else:
                judging = judging or self._judging(state, boundary, source, optimizers, mode)
                refill = decision.reason is None  # the holders repaired before, which fill again
                accounted = self._auditor.revisit(judging, only_refill=refill)
                self._records.measure_repairs(state)
                signals = signals._replace(read=refill or accounted)
            decision = schedule.decide(signals)
        if decision.action != "search":
            return None
        if decision.reason == "start":
            judging = Judging(state, boundary, (source,), optimizers, mode)
        else:
            judging = judging or self._judging(state, boundary, source, optimizers, mode)
        reason = decision.reason
        assert reason is not None  # a search always serves a reason
        return self._run_audit(judging, reason)

    def _point(self, clock: str, state: ThreadState, memory: int | None) -> None:
        """One boundary on the timeline (its step count, the thread's backwards, the memory figure if read)."""
        with self._timeline_lock:
            self.timeline.point(clock, state.clock.boundaries, state.micro, memory, None, _clock() - self._started)

    def _told(self, kind: str, holder: str, bytes: int = 0) -> None:
        """An event on the timeline, at the watch's boundaries so far."""
        micro = sum(s.micro for s in self._states)
        with self._timeline_lock:
            self.timeline.event(kind, holder, self._boundaries(), micro, _clock() - self._started, bytes)

    def ticked(self) -> bool:
        """Whether a boundary of either clock was seen.

        Returns:
            ``True`` once a backward or an optimizer step was seen (the idle looks are over then).
        """
        return self._ticked

    def _idle_look(self) -> bool:
        """An idle look (see :mod:`gradguard._watch.idle`), in the main thread; whether a holder grew."""
        if self._ticked or self._locked():
            return False
        return self._auditor.look_idle(self._piles)

    def _idle_read(self) -> bool:
        """Between idle looks, in the main thread: the holders they found, read by name; whether one grew."""
        if self._ticked or not self._piles or self._locked():
            return False
        return self._auditor.read_idle(self._piles)

    def _locked(self) -> bool:
        """Whether an idle look is not taken now: the mode in force is ``off``, or a lock it takes is held (by
        the thread it interrupted: it must not wait)."""
        if (self.mode or resolve(None)) == OFF:
            return True
        return self._lock.locked() or self._records.lock.locked() or self._governor.locked()

    def conclude(self) -> GraphRetentionError | None:
        """The idle looks' verdict, once: when no boundary of either clock was seen, the holders whose graphs
        grew from one look to the next kept graphs no backward used; they are noted (the summary's rows) and
        acted on by the mode in force: ``warn`` and ``detach`` warn once each (nothing is repaired: no
        backward showed the graphs dead), ``raise`` returns the error for the caller to raise (a
        :class:`watch` scope raises it as it leaves, ``gradguard run`` fails the run with it).

        Returns:
            The :class:`GraphRetentionError` of ``raise`` mode, or ``None``.
        """
        piles, self._piles = self._piles, {}
        if self._ticked or not piles:
            return None
        mode = self.mode or resolve(None)
        if mode == OFF:
            return None
        return self._auditor.conclude_idle(piles, mode)

    def _meet(self, state: ThreadState, source: Hashable, optimizers: tuple[Any, ...]) -> ParameterCount:
        """This optimizer's first boundary in this thread."""
        held = state.held[source] = ParameterCount(optimizers)
        self._auditor.met(optimizers)
        with self._lock:
            self._governor.start(_clock())
        return held

    def _judging(
        self, state: ThreadState, boundary: int, source: Hashable, optimizers: tuple[Any, ...], mode: Mode
    ) -> Judging:
        """The boundary as a read or a search judges it: by the boundaries of every source it is (the
        optimizers that step at the same boundary as ``source``), with their optimizers."""
        partners = state.partners.get(source)
        if not partners:
            return Judging(state, boundary, (source,), optimizers, mode)
        found = list(optimizers)
        for other in partners:
            held = state.held.get(other)
            if held is not None:
                found.extend(o for o in held.optimizers() if o not in found)
        return Judging(state, boundary, (source, *partners), tuple(found), mode)

    def _run_audit(self, at: Judging, reason: Reason) -> RetentionReport:
        state, boundary = at.state, at.boundary
        state.busy = True
        known = self._records.keys()
        start = work_clock()
        raised: BaseException | None = None
        searched: list[bool] = []
        young = False
        state.repairing = None
        try:
            # The start-up check of a watcher that followed every step since it started (or since the audit
            # before, which stamped every graph alive): what was made since is all the collector's young
            # generations hold, unless one was promoted since.
            # The second (what the first step kept after its step()) reads the young generations whatever
            # was promoted since: a full search there would cost a storm's worth at every start.
            if reason == "start" and boundary < state.schedule.startup:  # the first: since the watch started
                young = self._promotions is not None and promotions() == self._promotions
            else:
                young = reason == "start"
            if young and self.every == "auto":
                state.collector.young()  # what the first steps left as cyclic garbage is no holder's to look for
            return self._auditor.audit(at, young, searched)
        except BaseException as error:
            raised = error
            raise
        finally:
            self._records.measure_repairs(state)
            cost = work_clock() - start
            state.busy = False
            state.clock.audited = boundary
            state.promotions = promotions()
            new = self._records.new_since(known)
            self._governor.charge(cost, startup=reason == "start")
            with self._records.lock:
                self._records.spent += cost
                counts = self._records.counts
                counts["audits"] += 1
                counts["memory"] += reason == "memory"
                counts["searches"] += any(searched)
            state.schedule.audited(
                cost,
                reason,
                new=new,
                unexplained=state.unexplained > 0,
                boundary=boundary,
                pending=state.ledger.horizon < boundary - state.schedule.old,
                partial=young,
            )
            state.sequence = torch.autograd._get_sequence_nr()
            self._told("audit", "")
            for listener in list(self._listeners):
                listener(self, raised)
            raised = None

    def _state(self) -> ThreadState:
        try:
            state: ThreadState = self._local.state
        except AttributeError:
            schedule = Schedule(self.every, self.memory, clock=_clock, governor=self._governor)
            state = self._local.state = ThreadState(schedule)
            state.entry = self._entry
            with self._lock:
                self._states.append(state)
        return state

    def on_audit(self, listener: Callable[[Watcher, BaseException | None], None]) -> None:
        """Call ``listener(watcher, error)`` after each audit, in the auditing thread.

        The counts and :meth:`history` are already updated; ``error`` is the exception the audit is about
        to raise (a :class:`GraphRetentionError` in ``raise`` mode) or ``None``. An exception from the
        listener propagates out of ``optimizer.step()``: a listener handles its own. ``gradguard run``
        writes each process's report from here, before a ``raise`` can end the process.

        Args:
            listener: The function to call.
        """
        self._listeners.append(listener)

    # ---------------------------------------------------------------------------------------------
    # A scope's end (the pytest plugin)

    def mark(self) -> Ledger:
        """Stamp every graph alive now: :meth:`outlived`'s starting point.

        Returns:
            The stamps, which keep nothing alive.
        """
        return self._auditor.mark()

    def outlived(self, mark: Ledger, what: str, where: tuple[str, int] | None = None) -> RetentionReport:
        """The graphs made since ``mark`` that are still alive, now that ``what`` (a test, a scope) ended.

        Nothing it made should still hold a graph. Each holder is acted on as at a boundary, by the
        watch's mode (the mode in force when it has none): ``raise`` raises :class:`GraphRetentionError`,
        ``warn`` warns at ``where`` (file, line), ``detach`` repairs what is dead. Costs one pass over the
        heap when nothing outlived it; the holders are searched for only when something did.

        Args:
            mark: What :meth:`mark` returned when ``what`` began.
            what: What ended, for the messages (``"test tests/test_x.py::test_y"``).
            where: The file and line to warn at; the caller's frame by default.

        Returns:
            The report of the holders found.
        """
        return self._auditor.outlived(self._state(), self.mode, mark, what, where)

    # ---------------------------------------------------------------------------------------------
    # What it found

    @property
    def boundaries(self) -> int:
        """Step boundaries counted so far, all threads."""
        with self._lock:
            return self._boundaries()

    def _boundaries(self) -> int:
        return sum(state.clock.boundaries for state in self._states)  # each thread counts its own

    @property
    def audits(self) -> int:
        """Audits run so far (passes over the heap), all threads."""
        return self._records.counts["audits"]

    @property
    def searches(self) -> int:
        """Audits that searched the heap for the holders of old graphs, all threads."""
        return self._records.counts["searches"]

    @property
    def audit_seconds(self) -> float:
        """Wall time the audits took, all threads."""
        return self._records.spent

    @property
    def read_seconds(self) -> float:
        """Wall time the memory readings took, all threads."""
        with self._lock:
            states = list(self._states)
        return sum(state.schedule.read_seconds for state in states)

    @property
    def own_seconds(self) -> float:
        """Wall time of all the watcher's own work, all threads: audits, reads of the holders found before,
        repairs, memory readings, and the stamps and signals at every backward and boundary (the
        governor's account)."""
        return self._governor.seconds

    @property
    def memory_audits(self) -> int:
        """Audits the memory figure asked for, all threads."""
        return self._records.counts["memory"]

    def history(self) -> list[HolderHistory]:
        """Every holder an audit found leaking.

        Returns:
            A copy of each holder's record, most pinned bytes first.
        """
        return self._records.entries(leaks=True)

    def bounded(self) -> list[HolderHistory]:
        """Every holder an audit found keeping one step's graph for one boundary, replaced at every step.

        Such a holder (``self.last_loss = loss`` after ``optimizer.step()``) is listed, never acted on.

        Returns:
            A copy of each holder's record, most pinned bytes first.
        """
        return self._records.entries(leaks=False)

    def figures(self) -> WatchFigures:
        """What the watcher did so far, as the summary renders it.

        Returns:
            The counts, times, coverage and memory clause of all threads, as of now.
        """
        with self._lock:
            states = list(self._states)
        last = max((s.clock.boundaries - s.clock.audited for s in states if s.clock.audited), default=0)
        return WatchFigures(
            boundaries=self.boundaries,
            audits=self.audits,
            searches=self.searches,
            seconds=self.own_seconds,
            elapsed=self._governor.elapsed(),
            memory_audits=self.memory_audits,
            stamped=sum(s.ledger.placed for s in states),
            unexplained=sum(s.unexplained for s in states),
            memory=self.memory_line(),
            unseen=sum(s.unseen for s in states),
            failures=self._failed + (backwards.failures() - self._failures if self._backwards is not None else 0),
            declined=sum(s.schedule.declined for s in states),
            collecting=sum(s.collector.waited for s in states),
            garbage=sum(s.collector.freed for s in states),
            since_audit=last,
            backwards=sum(s.micro for s in states),
            micro_searches=self._records.counts["micro"],
        )

    def summary(self) -> str:
        """What the watch checked and found, in words.

        Returns:
            A few lines: what was checked and at what cost, what was not covered, what is not explained,
            and a table of the holders (leaking, then bounded).
        """
        return render(self.figures(), self.history(), self.bounded())

    def memory_line(self) -> str:
        """The memory figure's growth after the start-up check, in words.

        Returns:
            One clause when it grew by more than the memory rule's threshold: by how much, and whether
            the leaks found account for it; ``""`` otherwise.
        """
        with self._lock:
            states = list(self._states)
        return memory_clause([s.schedule for s in states], self._records.pinned())


def _weak(watcher: Watcher, method: Callable[..., Any], dead: Any) -> Callable[..., Any]:
    """``method`` of ``watcher``, called through a weak reference (``dead`` once the watcher is gone)."""
    ref = weakref.ref(watcher)

    def call(*args: Any) -> Any:
        target = ref()
        return dead if target is None else method(target, *args)

    return call


def _weak_listener(watcher: Watcher) -> backwards.Listener:
    """A backward listener that does not keep ``watcher`` alive."""
    ref = weakref.ref(watcher)

    def listener(roots: Sequence[Any], nested: bool) -> backwards.After | None:
        target = ref()
        return None if target is None else target._on_backward(roots, nested)

    return listener
