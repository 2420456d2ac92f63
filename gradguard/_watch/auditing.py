"""The audit and what follows it: every graph alive aged by its stamps, the holders of the old ones
searched for and judged, and the leaks acted on by the mode; the holders found before read again by name.

:class:`Auditor` is the half of a :class:`~gradguard._watch.watcher.Watcher` that runs when a signal
asked (the other half follows backwards and boundaries in constant time). It searches the heap
(:func:`~gradguard._watch.audit.scan_tensors`), judges each holder by the criterion
(:mod:`gradguard._watch.criterion`), settles what the old-graph signal asks about from then on, and
acts: raises, warns, or repairs (:mod:`gradguard._watch.repair`) what is dead. Its findings go to the
watcher's :class:`~gradguard._watch.records.Records`; the holders it found, to its
:class:`~gradguard._watch.known.Known`. Every second it takes is charged to the governor.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from .._errors import GraphRetentionError, GraphRetentionWarning
from .._graph.liveness import Liveness
from .._graph.stamps import Ledger, epochs_below, oldest_below
from .._heap.census import live_graph_tensors
from .._heap.paths import Path
from .._policy import stats as _stats
from .._policy.modes import DETACH, OFF, RAISE, WARN, Mode, resolve
from .._policy.site import user_frame, warn_at
from .audit import Retention, RetentionReport, scan_lock, scan_tensors
from .criterion import Leak, ages, judge
from .governor import Governor
from .known import Known
from .messages import raise_message, unrepaired_message, warn_message
from .records import STORE, Records, count_repair, measure_before_repairs
from .repair import REPAIRED, repair
from .summary import BOUNDED
from .threads import ThreadState, arm

__all__ = ["OPTIMIZER_RESCAN", "Auditor"]

OPTIMIZER_RESCAN = 30.0
"""Seconds between two looks for live optimizers in the heap (at an audit): a graph that reaches no
known optimizer's parameters is judged at every boundary. Every optimizer that steps is known at once."""

_clock = time.perf_counter


class Auditor:
    """Audits, reads of the holders found before, judgement and action, for one watcher.

    Args:
        ignore: The watcher's ``ignore``, as a predicate (or ``None``).
        records: Where the holders found and the counts go.
        known: The holders found before, by name.
        governor: The watcher's account of its time.
        boundaries: The watcher's boundaries so far, all threads (a holder's row says where it was found).
    """

    def __init__(
        self,
        ignore: Callable[[Retention], bool] | None,
        records: Records,
        known: Known,
        governor: Governor,
        boundaries: Callable[[], int],
    ) -> None:
        self._ignore = ignore
        self._records = records
        self._known = known
        self._governor = governor
        self._boundaries = boundaries
        self._lock = threading.Lock()
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()  # the live optimizers known
        self._rescan_at = 0.0

    def met(self, optimizers: tuple[Any, ...]) -> None:
        """These optimizers stepped: they are known from now on."""
        with self._lock:
            self._optimizers.update(optimizers)

    def audit(
        self,
        state: ThreadState,
        boundary: int,
        sources: tuple[Hashable, ...],
        optimizers: tuple[Any, ...],
        mode: Mode,
        young: bool,
        searched: list[bool],
    ) -> RetentionReport:
        """Every graph alive now, aged by its stamps; when one is old, the holders of the stamped ones are
        searched for, judged and acted on. ``young``: only what the collector's young generations hold
        (the start-up check, when nothing made since the watcher started can be older). ``searched``
        receives whether the heap was searched for holders."""
        with scan_lock:
            found: list[Any] | None = None
            now = _clock()
            with self._lock:
                if now >= self._rescan_at and not young:  # the optimizers made before the watch, or since
                    found, self._rescan_at = [], now + OPTIMIZER_RESCAN
            views: list[Any] = []
            tensors = live_graph_tensors(set(), found, young, views)
            with self._lock:
                self._optimizers.update(found or ())
            model = set(views)
            for node in model:  # the model's own nodes have no age of their own
                state.ledger.judged(node)
            del views
            born_at = ages(tensors, state.ledger, model)
            for t in tensors:  # what is alive now is followed from here on, and for a backward using it
                state.ledger.place(t.grad_fn, boundary - 1)
                arm(state, t.grad_fn, boundary)
            survived = _survived(state, sources)
            stamped = [t for t in tensors if id(t) in born_at]
            search = any(survived(born_at[id(t)].born) >= 1 for t in stamped)
            searched.append(search)
            # When a graph is old, every graph alive is searched for (in one pass): a holder is named by its
            # container and counted in full, its newest records (not stamped yet) included.
            judged = tensors if search else stamped
            del tensors, stamped
            leaks = self.judge(state, boundary, sources, optimizers, judged, born_at, {}, model, search=search)
            del judged, model
        return self.act(state, leaks, mode, user_frame())

    def revisit(
        self,
        state: ThreadState,
        boundary: int,
        sources: tuple[Hashable, ...],
        optimizers: tuple[Any, ...],
        mode: Mode,
        only_refill: bool = False,
    ) -> bool:
        """Read the holders found before by name (no heap pass), stamp what they took since, and act on
        their old graphs; whether that accounted for every old graph the signal saw. In ``detach`` mode,
        while the holders repaired before keep filling, this runs at every boundary (``only_refill``:
        those alone), so they stay bounded."""
        recipes = self._known.recipes()
        if not recipes:
            return False
        start = _clock()
        with scan_lock:
            if mode == DETACH:
                recipes = self._known.refill(state, recipes, boundary, sources[0], self._records)
            if only_refill:
                recipes = []
            pairs = [pair for recipe in recipes for pair in recipe.resolve()]
            tensors = [t for t, _ in pairs]
            known = {id(t): path for t, path in pairs}
            del pairs
            for t in tensors:  # what the holder took since it was last read is followed from here on
                state.ledger.place(t.grad_fn, boundary - 1)
                arm(state, t.grad_fn, boundary)
            born_at = ages(tensors, state.ledger)
            survived = _survived(state, sources)
            leaks: list[Leak] = []
            if any(survived(age.born) >= 1 for age in born_at.values()):
                leaks = self.judge(state, boundary, sources, optimizers, tensors, born_at, known, partial=True)
            del tensors, known
        cost = _clock() - start
        self._governor.charge(cost)
        if leaks:
            self.act(state, leaks, mode, user_frame())
        accounted = state.ledger.oldest_alive(boundary - state.schedule.old) is None
        if not only_refill:
            state.schedule.handled("old", boundary, cost, new=False)
        return accounted

    def judge(
        self,
        state: ThreadState,
        boundary: int,
        sources: tuple[Hashable, ...],
        optimizers: tuple[Any, ...],
        tensors: list[torch.Tensor],
        born_at: dict[int, Any],
        known: dict[int, Path],
        model: set[Any] | None = None,
        partial: bool = False,
        search: bool = True,
    ) -> list[Leak]:
        """Judge the holders of ``tensors`` (stamped graphs; ``known``: paths already found), note the
        bounded ones, and settle what the constant-time signal looks at from now on: the leaks' old stamps
        stop counting, graphs that may still become leaks keep it asking. ``partial``: ``tensors`` are
        some holders' only (a revisit), not everything alive. ``search``: whether to search for their holders
        at all (not when none of them is old yet: they may all still become leaks). Call holding
        :data:`scan_lock`."""
        ledger = state.ledger
        horizon = boundary - state.schedule.old
        leaks: list[Leak] = []
        lost: list[torch.Tensor] = []
        if tensors and not search:
            horizon = min(horizon, min(born_at[id(t)].born for t in tensors) - 1)
            lost_old: list[torch.Tensor] = []
        elif tensors:
            liveness = Liveness({t.grad_fn for t in tensors})
            findings, _ = scan_tensors(tensors, self._ignore, set(), liveness, known, lost)
            with self._lock:
                alive_optimizers = list(self._optimizers)
            params = None if not optimizers else functools.partial(_parameter_ids, optimizers, alive_optimizers)
            own_age = functools.partial(_own_age, ledger, model or set())
            watched = functools.partial(arm, state, boundary=boundary)
            verdicts = judge(findings, born_at, _survived(state, sources), own_age, liveness, params, watched)
            leaks = verdicts.leaks
            self._records.note(verdicts.bounded, BOUNDED, self._boundaries())
            # Followed by name too: one that keeps its graph a boundary more is then judged without a search.
            self._known.remember(verdicts.bounded, bounded=True)
            leaking = {id(leak.finding.tensors[i]) for leak in leaks for i in leak.leaking}
            pending = [
                born_at[id(t)].born for f in findings for t in f.tensors if id(t) in born_at and id(t) not in leaking
            ]
            if pending:  # graphs that may still become leaks: the signal keeps asking about them
                horizon = min(horizon, min(pending) - 1)
            lost_old = [t for t in lost if id(t) in born_at and born_at[id(t)].born <= horizon]
            settled = [leak.finding.tensors[i].grad_fn for leak in leaks for i in leak.leaking]
            named_ids = {id(t) for f in findings for t in f.tensors} | {id(t) for t in lost}
            settled += [t.grad_fn for t in tensors if id(t) not in named_ids]  # ignored: the user's decision
            collected: list[Any] = []
            oldest_below(settled + [t.grad_fn for t in lost_old], ledger, stop=model, collect=collected)
            for node in collected:
                epoch = ledger.epoch(node)
                if epoch is not None and epoch <= horizon:
                    ledger.judged(node)
            del findings, liveness, collected, settled
        else:
            lost_old = []
        if not partial:
            ledger.settle(horizon)
            state.unexplained = len(lost_old) + ledger.alive(through=horizon)
        return leaks

    def act(self, state: ThreadState, leaks: list[Leak], mode: Mode, frame: Any, ended: str = "") -> RetentionReport:
        """Act on ``leaks`` by ``mode``; warnings at ``frame`` (a frame, or a ``(file, line)``)."""
        report = RetentionReport([leak.finding.retention for leak in leaks])
        if not leaks:
            return report
        self._known.remember(leaks)
        boundaries = self._boundaries()
        if mode == RAISE:
            message = raise_message(leaks, ended)
            self._records.note(leaks, "raised", boundaries)
            leaks.clear()  # the traceback keeps this frame: it must not keep the tensors
            error = GraphRetentionError(message)
            error.report = report  # type: ignore[attr-defined]
            raise error
        if mode == WARN:
            self._records.note(leaks, "warned", boundaries)
            for leak in leaks:
                if _stats.claim_warning(STORE, leak.finding.key, "warn"):
                    _warn(warn_message(leak, ended), frame)
        elif mode == DETACH:
            measure_before_repairs(state)
            for leak in leaks:
                self._repair(state, leak, frame, boundaries, ended)
        return report

    def _repair(self, state: ThreadState, leak: Leak, frame: Any, boundaries: int, ended: str = "") -> None:
        finding = leak.finding
        done = repair([finding.paths[i] for i in leak.leaking], [finding.tensors[i] for i in leak.leaking], leak.alive)
        pinned, estimate = finding.retention.pinned_bytes, finding.retention.pinned_bytes + finding.retention.node_bytes
        count_repair(state, finding.key, done, pinned, estimate)
        self._records.note([leak], done.outcome, boundaries, repaired=done.released, why=done.why)
        if done.outcome != REPAIRED and _stats.claim_warning(STORE, finding.key, done.outcome):
            _warn(unrepaired_message(leak, done, ended), frame)

    def mark(self) -> Ledger:
        """Stamp every graph alive now: :meth:`outlived`'s starting point.

        Returns:
            The stamps, which keep nothing alive.
        """
        mark = Ledger()
        with scan_lock:
            for t in live_graph_tensors(set()):
                mark.place(t.grad_fn, 0)
        return mark

    def outlived(
        self, state: ThreadState, mode: Mode | None, mark: Ledger, what: str, where: tuple[str, int] | None = None
    ) -> RetentionReport:
        """:meth:`gradguard.Watcher.outlived` for the thread of ``state``, in ``mode`` (``None``: the mode in
        force)."""
        mode = resolve(mode)
        if mode == OFF:
            return RetentionReport([])
        start = _clock()
        try:
            with scan_lock:
                tensors = live_graph_tensors(set())
                old = set(id(t) for t in tensors if t.grad_fn in oldest_below([t.grad_fn for t in tensors], mark))
                made = [t for t in tensors if id(t) not in old]
                del tensors, old
                if not made:
                    return RetentionReport([])
                liveness = Liveness({t.grad_fn for t in made})
                findings, _ = scan_tensors(made, self._ignore, set(), liveness)
                del made
                leaks = [
                    Leak(f, list(range(len(f.tensors))), 1, [liveness.state(t.grad_fn).alive for t in f.tensors])
                    for f in findings
                ]
                del findings, liveness
            ended = f" after {what} ended"
            return self.act(state, leaks, mode, where if where is not None else user_frame(), ended)
        finally:
            cost = _clock() - start
            self._governor.charge(cost)
            with self._records.lock:
                self._records.spent += cost
                self._records.counts["audits"] += 1


def _survived(state: ThreadState, sources: tuple[Hashable, ...]) -> Callable[[int], int]:
    """Boundaries of any of ``sources`` a graph stamped at an epoch has lived through."""
    clock = state.clock
    if len(sources) == 1:
        return functools.partial(clock.survived, sources[0])
    return lambda epoch: max(clock.survived(s, epoch) for s in sources)


def _own_age(ledger: Ledger, model: set[Any], root: Any, others: set[Any]) -> int | None:
    """The age of ``root``'s graph without ``others``' graphs (as :func:`~gradguard._watch.criterion.ages`
    takes it: a graph built over several steps is as old as its oldest part)."""
    span = epochs_below([root], ledger, stop=others | model).get(root)
    if span is None:
        return None
    born, first, last = span
    return first if last > first else born


def _warn(message: str, at: Any) -> None:
    """A :class:`GraphRetentionWarning` at a frame, or at ``(file, line)``."""
    if isinstance(at, tuple):
        warnings.warn_explicit(message, GraphRetentionWarning, at[0], at[1])
    else:
        warn_at(message, GraphRetentionWarning, at)


def _parameter_ids(optimizers: tuple[Any, ...], alive: list[Any]) -> tuple[frozenset[int], frozenset[int]]:
    """The ids of the parameters ``optimizers`` update, and of those every known live optimizer updates."""
    own = frozenset(id(p) for o in optimizers for group in o.param_groups for p in group["params"])
    known = frozenset(id(p) for o in alive for group in o.param_groups for p in group["params"])
    return own, known
