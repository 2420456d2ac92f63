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

import dataclasses
import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch

from .._errors import GraphRetentionError, GraphRetentionWarning
from .._graph.liveness import GraphState, Liveness
from .._graph.memory import graph_memory
from .._graph.nodes import nodes as graph_nodes
from .._graph.stamps import Ledger, epochs_below, micros_below, oldest_below
from .._heap.census import live_graph_tensors
from .._heap.hold import search_lock, work_clock  # spans of work: a wait for another thread's search is its own
from .._heap.holders import other_threads_locals
from .._heap.paths import Path
from .._policy import stats as _stats
from .._policy.modes import DETACH, OFF, RAISE, WARN, Mode, resolve
from .._policy.site import user_frame, warn_at
from .audit import Finding, Retention, RetentionReport, scan_tensors
from .criterion import Leak, ages, judge
from .decision import Collected, Decision, Signals, decide
from .governor import Account, Governor
from .known import Known, repair_dead
from .messages import IDLE, MICRO, raise_message, unrepaired_message, warn_message
from .micro import Searches, count, forget_empty, judged
from .micro import judge as judge_micro
from .recipes import Recipe
from .records import STORE, Records, count_repair, measure_before_repairs
from .repair import REPAIRED, repair
from .summary import BOUNDED
from .threads import ThreadState, arm
from .tuning import IDLE_FREE, MICRO_FREE, OPTIMIZER_RESCAN

__all__ = ["OPTIMIZER_RESCAN", "Auditor", "Judging", "Pile"]


_clock = time.perf_counter


class Judging(NamedTuple):
    """A step boundary, as its audit or its read of the holders found before judges the graphs alive."""

    state: ThreadState
    """The thread's state."""
    boundary: int
    """The boundary's number."""
    sources: tuple[Hashable, ...]
    """The sources (an optimizer, or direct :meth:`Watcher.boundary` calls) whose boundaries a graph's
    survival is counted by."""
    optimizers: tuple[Any, ...]
    """Their optimizers: a graph on none of their parameters but on another optimizer's is judged by that
    optimizer's boundaries (none: every graph is judged here)."""
    mode: Mode
    """What is done with a leak."""


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
        self._idle_looks = 0  # idle looks that saw graph tensors
        self._idle_ledger = Ledger()  # the graphs each idle look saw, stamped with its number
        self._idle_cost = 0.0  # the last one's

    def met(self, optimizers: tuple[Any, ...]) -> None:
        """These optimizers stepped: they are known from now on."""
        with self._lock:
            self._optimizers.update(optimizers)

    def audit(self, at: Judging, young: bool, searched: list[bool]) -> RetentionReport:
        """Every graph alive at the boundary ``at``, aged by its stamps; when one is old, the holders of the
        stamped ones are searched for, judged and acted on. ``young``: only what the collector's young
        generations hold (the start-up check, when nothing made since the watcher started can be older).
        ``searched`` receives whether the heap was searched for holders."""
        state, boundary = at.state, at.boundary
        with search_lock:
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
            # What another thread's step holds for now is that thread's to age (a stamp here would make it
            # old on this thread's boundaries while that thread waits for the interpreter).
            theirs = other_threads_locals() if threading.active_count() > 1 else ()
            for t in tensors:  # what is alive now is followed from here on, and for a backward using it
                if id(t) not in theirs:
                    state.ledger.place(t.grad_fn, boundary - 1)
                    arm(state, t.grad_fn, boundary)
            del theirs
            survived = _survived(state, at.sources)
            stamped = [t for t in tensors if id(t) in born_at]
            search = any(survived(born_at[id(t)].born) >= 1 for t in stamped)
            searched.append(search)
            # When a graph is old, every graph alive is searched for (in one pass): a holder is named by its
            # container and counted in full, its newest records (not stamped yet) included.
            judged = tensors if search else stamped
            del tensors, stamped
            leaks = self.judge(at, judged, born_at, {}, model, search=search)
            del judged, model
        return self.act(state, leaks, at.mode, user_frame())

    def revisit(self, at: Judging, only_refill: bool = False) -> bool:
        """Read the holders found before by name (no heap pass), stamp what they took since, and act on
        their old graphs; whether that accounted for every old graph the signal saw at the boundary ``at``.
        In ``detach`` mode, while the holders repaired before keep filling, this runs at every boundary
        (``only_refill``: those alone), so they stay bounded."""
        state, boundary, mode = at.state, at.boundary, at.mode
        recipes = self._known.recipes()
        if not recipes:
            return False
        start = work_clock()
        with search_lock:
            if mode == DETACH:
                recipes = self._known.refill(state, recipes, boundary, at.sources[0], self._records)
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
            survived = _survived(state, at.sources)
            leaks: list[Leak] = []
            if any(survived(age.born) >= 1 for age in born_at.values()):
                leaks = self.judge(at, tensors, born_at, known, partial=True)
            del tensors, known
        cost = work_clock() - start
        self._governor.charge(cost)
        if leaks:
            self.act(state, leaks, mode, user_frame())
        accounted = state.ledger.oldest_alive(boundary - state.schedule.old) is None
        if not only_refill:
            state.schedule.handled("old", boundary, cost, new=False)
        return accounted

    def judge(
        self,
        at: Judging,
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
        :data:`~gradguard._heap.hold.search_lock`."""
        state, boundary, optimizers = at.state, at.boundary, at.optimizers
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
            verdicts = judge(findings, born_at, _survived(state, at.sources), own_age, liveness, params, watched)
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
        clock = "micro" if ended == MICRO else "step"
        if mode == RAISE:
            message = raise_message(leaks, ended)
            self._records.note(leaks, "raised", boundaries, clock=clock)
            leaks.clear()  # the traceback keeps this frame: it must not keep the tensors
            error = GraphRetentionError(message)
            error.report = report  # type: ignore[attr-defined]
            raise error
        if mode == WARN:
            self._records.note(leaks, "warned", boundaries, clock=clock)
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
        clock = "micro" if ended == MICRO else "step"
        self._records.note([leak], done.outcome, boundaries, repaired=done.released, why=done.why, clock=clock)
        if done.outcome != REPAIRED and _stats.claim_warning(STORE, finding.key, done.outcome):
            _warn(unrepaired_message(leak, done, ended), frame)

    def micro(self, state: ThreadState, mode: Mode, hunting: bool) -> tuple[Decision, bool]:
        """A micro-batch boundary of ``state``'s thread: its last backward returned (see
        :mod:`gradguard._watch.micro`). The holders followed by name are read; when a graph of an earlier
        backward is alive that they do not keep, :func:`~gradguard._watch.decision.decide` says whether to
        search the heap for its holder. A holder that grew within the step is acted on by ``mode`` (a
        ``raise`` comes out of the backward, its gradients computed). Returns the decision, and whether a
        holder was acted on."""
        n = state.micro
        ledger = state.ledger
        old = ledger.micro_old(n)
        if old is None and not state.following:
            return Decision("nothing", None, "no graph of an earlier backward is alive"), False
        start = work_clock()
        backoff = state.micro_backoff
        if backoff is None:
            backoff = state.micro_backoff = Searches()
        step = state.clock.boundaries
        leaks: list[Leak] = []
        seen: set[int] = set()
        state.busy = True
        try:
            with search_lock:
                budget = Account(self._governor, start)
                signals = Signals("micro", n, old=old is not None, known=bool(state.following), hunting=hunting)
                decision = decide(signals, backoff, budget)
                if decision.action == "read":
                    self._read_followed(state, n, step, mode, leaks, seen)
                    decision = decide(signals := signals._replace(read=old in seen), backoff, budget)
                free = backoff.misses < MICRO_FREE  # the clock's start-up: served whatever it costs
                if decision.action == "collect":
                    # As the step clock does: a graph only cyclic garbage keeps (a kept exception, a record
                    # that refers to itself) costs a collection of the young generations, not a search.
                    garbage = state.micro_collector.garbage(lambda: ledger.micro_old(n), step)
                    collected: Collected = "refused" if garbage is None else "garbage" if garbage else "survived"
                    decision = decide(signals._replace(collected=collected), backoff, budget)
                    if decision.action == "nothing":
                        # counted as a request that found nothing: the next ones wait for the back-off's gap,
                        # and the collector's ration (shared with the step clock) is not spent at every backward
                        backoff.handled(n, 0.0, False, MICRO_FREE)
                backoff.declined += bool(decision.declined)
                if decision.action == "search":
                    searched = work_clock()
                    found = self._search_micro(state, n, step, leaks)
                    backoff.searched(n, work_clock() - searched, found)
                    with self._records.lock:
                        self._records.counts["audits"] += 1
                        self._records.counts["searches"] += 1
                        self._records.counts["micro"] += 1
                if decision.declined != "signal":
                    ledger.micro_horizon = n - 1
            cost = work_clock() - start
            # The start-up searches are not the share's: one on a large heap would leave it spent for as long
            # as the program ran until then, and decline every later request of either clock.
            self._governor.charge(cost, startup=free and decision.action == "search")
            if decision.action == "search":
                with self._records.lock:
                    self._records.spent += cost
            if leaks:
                self.act(state, leaks, mode, user_frame(), MICRO)
        finally:
            state.busy = False
            self._records.measure_repairs(state)
        return decision, bool(leaks)

    def _read_followed(
        self, state: ThreadState, n: int, step: int, mode: Mode, leaks: list[Leak], seen: set[int]
    ) -> None:
        """Read the holders the micro-batch clock follows by name (no heap pass): judge the undecided ones,
        and in ``detach`` mode repair what the leaking ones took since. ``seen`` receives the backwards
        whose graphs they keep."""
        following = state.following
        for key, follow in list(following.items()):
            if follow.recipe is None:
                continue
            pairs = follow.recipe.resolve(newer=follow.leaking)
            tensors = [t for t, _ in pairs]
            micros = micros_below([t.grad_fn for t in tensors], state.ledger)
            seen.update(micros.values())
            if follow.leaking:
                if mode == DETACH and tensors:
                    self._refill_micro(state, key, pairs, micros, n)
                elif not tensors and follow.step != step:
                    del following[key]  # emptied and a step went by: no longer kept
                del pairs, tensors
                continue
            known = {id(t): path for t, path in pairs}
            del pairs
            if not tensors:
                forget_empty(key, following, step)
                continue
            liveness = Liveness({t.grad_fn for t in tensors})
            findings, _ = scan_tensors(tensors, self._ignore, set(), liveness, known)
            del tensors, known
            for finding in findings:
                if finding.key != key:
                    continue
                counted = count(finding, micros, n, liveness, state.ledger)
                if judge_micro(finding, counted, following, step, by_name=True):
                    leaks.append(_micro_leak(finding, counted.dead, micros, n))
            del findings, liveness

    def _refill_micro(
        self, state: ThreadState, key: str, pairs: list[tuple[torch.Tensor, Path]], micros: dict[Any, int], n: int
    ) -> None:
        """``detach``: the dead graphs a leaking holder took since, which an earlier backward ran through,
        repaired (the holder was judged a leak; detaching a dead graph cannot change a gradient)."""
        kept = [(t, path) for t, path in pairs if 0 < micros.get(t.grad_fn, 0) < n]
        repair_dead(state, key, kept, self._records)
        del kept

    def _search_micro(self, state: ThreadState, n: int, step: int, leaks: list[Leak]) -> bool:
        """Search the heap for the holders of the graphs earlier backwards ran through; judge each store
        not followed yet. Returns whether one is followed now."""
        views: list[Any] = []
        tensors = live_graph_tensors(set(), None, False, views)
        model = set(views)
        del views
        micros = micros_below([t.grad_fn for t in tensors], state.ledger, stop=model)
        if not any(0 < micros.get(t.grad_fn, 0) < n for t in tensors):
            return False
        liveness = Liveness({t.grad_fn for t in tensors})
        findings, _ = scan_tensors(tensors, self._ignore, set(), liveness)
        del tensors, model
        following = state.following
        new = False
        for finding in findings:
            if not judged(finding):
                continue
            follow = following.get(finding.key)
            if follow is not None and follow.recipe is not None:
                continue  # read by name at this boundary already
            counted = count(finding, micros, n, liveness, state.ledger)
            if judge_micro(finding, counted, following, step, by_name=False):
                leaks.append(_micro_leak(finding, counted.dead, micros, n))
            if finding.key in following and finding.key not in state.followed:
                state.followed.add(finding.key)
                new = True
        del findings, liveness
        # Found something only when a holder is followed for the first time (or leaks): one followed before
        # and dropped since (it stopped growing) does not make the next searches free again.
        return new or bool(leaks)

    def look_idle(self, piles: dict[str, Pile]) -> bool:
        """An idle look: every graph tensor alive and its holder, noted in ``piles`` by holder (what the look
        saw, and how many looks found it grown since the one before). The first looks that see graphs run at
        once, the others within the watch's share of the time. Returns whether a holder was new or grew (else
        the memory figure's rule backs off)."""
        start = work_clock()
        self._governor.start(start)
        if self._idle_looks >= IDLE_FREE and not self._governor.affords(self._idle_cost, start):
            return False
        grew = False
        with search_lock:
            tensors = live_graph_tensors(set())
        if not tensors:  # the rise was something else's (imports, data): a census, not an audit
            self._governor.charge(work_clock() - start)
            return False
        try:
            with search_lock:
                self._idle_looks += 1
                # In a forward kept whole, most graph tensors alive are its saved activations: held by the graph
                # of another, named through it; the heap is searched for the others only.
                inside: set[int] = set()
                graph_memory([t.grad_fn for t in tensors], set(), inside)
                tensors = [t for t in tensors if id(t) not in inside]
                findings, _ = scan_tensors(tensors, self._ignore, set(), _Unused())  # type: ignore[arg-type]
                del tensors
                # A graph that holds one an earlier look saw grew from it (a chain each step extends), whatever
                # holds it now (the loop's variable, or the same tensor as a function's argument).
                roots = [t.grad_fn for finding in findings for t in finding.tensors]
                older = oldest_below(roots, self._idle_ledger)
                for root in roots:
                    self._idle_ledger.place(root, self._idle_looks)
                del roots
                # A holder grew when it keeps what an earlier look saw and more besides; one whose graph was
                # replaced (a function's local, made anew at each call) did not, whatever its size now. Only
                # the holders this look saw are kept: one that let go of its graphs pins nothing now.
                seen_now: dict[str, Pile] = {}
                for finding in findings:
                    seen = finding.retention
                    last = piles.get(finding.key)
                    nodes = _node_count(finding.tensors)
                    extends = any(t.grad_fn in older for t in finding.tensors)
                    more = extends and (last is None or seen.tensors > last.tensors or nodes > last.nodes)
                    grew = grew or more or last is None
                    recipe = last.recipe if last is not None else Recipe.of(finding.paths[0])
                    count = (last.grew if last is not None else 0) + 1 if more else 0
                    seen_now[finding.key] = Pile(seen, count, recipe, seen.tensors, nodes)
                piles.clear()
                piles.update(seen_now)
                del findings, older, seen_now
        finally:
            cost = self._idle_cost = work_clock() - start
            self._governor.charge(cost)
            with self._records.lock:
                self._records.spent += cost
                self._records.counts["audits"] += 1
                self._records.counts["searches"] += 1
        return grew

    def read_idle(self, piles: dict[str, Pile]) -> bool:
        """Between idle looks: the holders they found, read by name (no heap pass): how many graph tensors
        and graph nodes each keeps now, and whether that grew since the last look or read (returned). One
        seen growing once is not read again: the verdict needs no more."""
        start = work_clock()
        grew = False
        with search_lock:
            for key, pile in list(piles.items()):
                if pile.recipe is None or pile.grew:
                    continue
                tensors = [t for t, _ in pile.recipe.resolve()]
                if not tensors:
                    continue
                nodes = _node_count(tensors)
                older = oldest_below([t.grad_fn for t in tensors], self._idle_ledger)
                extends = any(t.grad_fn in older for t in tensors)  # not a graph made anew since the look
                more = extends and (len(tensors) > pile.tensors or nodes > pile.nodes)
                del older
                seen = dataclasses.replace(pile.seen, tensors=len(tensors)) if more else pile.seen
                piles[key] = pile._replace(seen=seen, grew=pile.grew + more, tensors=len(tensors), nodes=nodes)
                grew = grew or more
                del tensors
        self._governor.charge(work_clock() - start)
        return grew

    def conclude_idle(self, piles: dict[str, Pile], mode: Mode) -> GraphRetentionError | None:
        """The idle looks' verdict (see :meth:`gradguard._watch.watcher.Watcher.conclude`)."""
        leaks = [
            Leak(
                Finding(pile.seen, key, (), ()),
                list(range(pile.seen.tensors)),
                0,
                [pile.seen.alive] * pile.seen.tensors,
            )
            for key, pile in piles.items()
            if pile.grew
        ]
        if not leaks:
            return None
        boundaries = self._boundaries()
        if mode == RAISE:
            self._records.note(leaks, "raised", boundaries, clock="idle")
            error = GraphRetentionError(raise_message(leaks, IDLE))
            error.report = RetentionReport([leak.finding.retention for leak in leaks])  # type: ignore[attr-defined]
            return error
        self._records.note(leaks, "warned", boundaries, clock="idle")
        for leak in leaks:
            if _stats.claim_warning(STORE, leak.finding.key, "warn"):
                warnings.warn(warn_message(leak, IDLE), GraphRetentionWarning, stacklevel=2)
        return None

    def mark(self) -> Ledger:
        """Stamp every graph alive now: :meth:`outlived`'s starting point.

        Returns:
            The stamps, which keep nothing alive.
        """
        mark = Ledger()
        with search_lock:
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
        start = work_clock()
        try:
            with search_lock:
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
            cost = work_clock() - start
            self._governor.charge(cost)
            with self._records.lock:
                self._records.spent += cost
                self._records.counts["audits"] += 1


class Pile(NamedTuple):
    """What the last idle look saw of one holder (strings and numbers only), how many looks or reads found it
    grown since the one before, its recipe (read by name between looks) and its figures at the last read."""

    seen: Retention
    grew: int
    recipe: Recipe | None = None
    tensors: int = 0
    nodes: int = 0


class _Unused:
    """The liveness of graphs no backward ran through yet (an idle look's): usable whole, so not walked (the
    walk of a chain that holds its own earlier links is quadratic)."""

    def state(self, node: Any) -> GraphState:
        return GraphState(True, frozenset(), 0)


def _node_count(tensors: Sequence[torch.Tensor]) -> int:
    """The autograd nodes of ``tensors``' graphs, each once."""
    return sum(1 for _ in graph_nodes(t.grad_fn for t in tensors))


def _micro_leak(finding: Any, dead: list[int], micros: dict[Any, int], n: int) -> Leak:
    """A holder that grew within a step, as the actions take it: its dead backwarded graphs, and how many
    micro-batch boundaries the oldest has lived through."""
    oldest = min(micros[finding.tensors[i].grad_fn] for i in dead)
    return Leak(finding, dead, n - oldest, [False] * len(dead))


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
