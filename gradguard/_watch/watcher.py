"""The step-boundary watch: :func:`watch` and :class:`Watcher`.

At a step boundary (``optimizer.step()`` has just run) the graphs of earlier steps should all be
gone. The watch audits the heap there (:func:`gradguard.audit`'s scan), decides which holders are
leaks, and acts on them by mode: ``warn``, ``raise``, ``detach`` (repair what is provably dead) or
``off``. It is built to be left on: it never changes the gradients of a correct program, never
calls or writes the program's objects while it looks, and says only what it checked.

What is a leak (:mod:`gradguard._watch.criterion`)
    A graph is a leak when one of its autograd nodes was already alive at the previous audited
    boundary of the same optimizer in the same thread. The current step's ``loss``, still a frame
    local at ``optimizer.step()``, is a graph made since then: never a leak. A list that keeps last
    step's loss, a metrics dict, a module attribute set once and kept: the tensor itself was there
    last time. ``loss_sum += loss``: the new tensor's graph contains the previous sum's node. A
    holder is a leak when any of its tensors is; it has survived ``b`` boundaries when the oldest
    of those nodes was first seen ``b`` boundaries ago. A module attribute overwritten by every
    forward holds only the current step's graph at each boundary: :func:`gradguard.audit` lists it,
    the watch never acts on it. A graph held only by a variable (a frame's, or a top-level variable
    of the program being run: a script, ``python -c``, ``-m``, a notebook) is a leak once it has
    survived two boundaries (``loss = train_step(batch)`` keeps the previous step's loss while the
    next step runs). A graph is judged only at boundaries of optimizers that update a parameter it
    reaches, so an inner loop's or a critic's steps do not age the outer forward.

What is repaired (:mod:`gradguard._watch.repair`, :mod:`gradguard._graph.liveness`)
    Only a *dead* graph: one that no backward can use any more, because every path from its root to
    a leaf that requires grad goes through a node whose saved tensors a backward freed or an
    in-place update changed (torch itself refuses both). Detaching it changes no gradient. A graph
    that can still be backwarded (a forward not backwarded yet, ``retain_graph=True``, a chain of
    nodes that saved nothing) is reported, never repaired. The repair writes only the program's own
    state, at the place that holds the tensor, and says ``repaired`` only when the value read back
    no longer reaches the graph.

How a node is recognised without keeping it alive
    torch's autograd nodes take no weak reference, and their Python objects come and go while the
    node lives, so neither a weak reference nor ``id()`` can follow one. Each node owns a
    ``metadata`` dict (torch creates it on first read and keeps it exactly as long as the node; it
    stays empty outside anomaly mode). At an audited boundary the watch records, for the
    ``grad_fn`` of every graph tensor alive, that dict, keyed by the node's ``(sequence number,
    type)``. Holding the dict keeps nothing but the dict, and, while it is held, no other object can
    take its id. At the next audited boundary each graph is walked from its root; a node whose
    ``(sequence number, type)`` was recorded is compared by identity of its ``metadata`` dict,
    which makes the answer exact, across threads too (sequence numbers are per thread). A node whose
    dict names a parent node (anomaly mode, double backward) is not recorded: holding that dict
    would keep the parent alive. Outside ``detach`` mode the watch changes nothing else: that empty
    dict, which torch makes the same way for any reader of ``grad_fn.metadata``, is its only trace
    on a graph. When no graph alive at a boundary is older than the previous audit (a clean step),
    the audit ends after that one pass over the heap, without searching for holders.

Threads
    Each thread has its own boundaries: a boundary is the ``optimizer.step()`` of that thread (or a
    :meth:`Watcher.boundary` call from it), and the previous audited boundary is that thread's. At
    a boundary, tensors that only another thread's frames hold are not judged: that thread may be
    mid-forward or mid-backward, and its own boundaries judge them. Everything else (module
    globals, class attributes, objects, suspended generators' frames) is judged at every thread's
    boundary. Audits run one at a time in the process.

How often (:mod:`gradguard._watch.schedule`)
    ``every="auto"`` (the default): at every boundary the memory figure (bytes in use per device)
    is read, and the boundary is audited when it grew past its low-water mark
    (:mod:`gradguard._watch.trigger`), plus a backstop on time for leaks too slow to move it; without a
    memory figure, the first two boundaries and then as often as keeps the audits under 1% of the
    wall time. A positive ``int`` audits every ``every``-th boundary (``every=1`` for tests and for
    hunting a leak).

Turning it on
    ``with gradguard.watch(...)`` or ``@gradguard.watch(...)``; ``gradguard.enforce(audit=N)``;
    ``GRADGUARD_AUDIT=N`` (or ``auto``; ``0``/``off``: none) set when gradguard is imported: one watch
    for the whole process, in the mode in force at each boundary, with no change to the code (a bad
    value is a :class:`GradGuardError` out of the first ``optimizer.step()``, after that step; with
    the variable unset, importing gradguard registers nothing); ``gradguard run`` (a script under
    ``enforce()`` and the watch, no code change; it takes the process watch over);
    pytest's ``--gradguard-audit=N`` and ``@pytest.mark.gradguard(audit=N)``. A bad value is a
    :class:`GradGuardError` there, naming it and what is accepted.

Several optimizers
    Each optimizer has its own boundaries, each with its own record: in a GAN's loop the
    discriminator's loss is still a frame local at the generator's step, made before the
    discriminator's step but after the generator's previous one; it is not a leak. Several
    ``optimizer.step()`` calls in one thread with no autograd node made in that thread in between
    (two optimizers over one backward, a callback's boundary next to the optimizer hook) are one
    boundary: the first is counted and audited, the others return ``None``. The same optimizer
    stepping again is always a new boundary. ``every`` and ``"auto"`` count a thread's boundaries,
    whatever their optimizer.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Literal

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from .._errors import GradGuardError, GraphRetentionError, GraphRetentionWarning
from .._graph.liveness import Liveness
from .._heap.holders import live_graph_tensors
from .._heap.paths import Path
from .._policy import stats as _stats
from .._policy import table as _table
from .._policy.message import display, human
from .._policy.modes import DETACH, OFF, RAISE, WARN, Mode, normalize_mode, resolve
from .._policy.site import user_frame, warn_at
from .._scope.enforce import _Install, enforce, register_audit_installer
from .audit import Retention, RetentionReport, check_ignore, nodes_text, scan_lock, scan_tensors
from .criterion import Leak, Source, judge
from .recipes import Recipe
from .repair import LIVE, PARTLY, REPAIRED, Repair, repair
from .schedule import Schedule
from .trigger import TriggerSettings

__all__ = [
    "AUDIT_ENV",
    "HolderHistory",
    "Watcher",
    "audit_install",
    "parse_audit",
    "start_process_watch",
    "stop_process_watch",
    "watch",
]

Every = int | Literal["auto"]

AUDIT_ENV = "GRADGUARD_AUDIT"
_clock = time.perf_counter

STORE = "audit"
"""The store name of the watch's repairs in :func:`gradguard.stats` (the site is the holder's path)."""

_EVERY_ACCEPTED = (
    "a positive whole number N (audit every N-th step boundary) or 'auto' (audit when memory grows, "
    "and as often as keeps the audits within a small share of the wall time)"
)
_AUDIT_ACCEPTED = f"{_EVERY_ACCEPTED}, or 0/off (no watch)"
_OFF_WORDS = frozenset({"0", "off", "false", "no", "none"})


def _every(value: object, what: str, accepted: str) -> Every:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    number: object = value
    if isinstance(value, str) and value.strip().isdigit():
        number = int(value.strip())
    if isinstance(number, int) and not isinstance(number, bool) and number > 0:
        return number
    raise GradGuardError(f"{what}={value!r} is not accepted; accepted: {accepted}")


def parse_every(value: object, *, what: str = "every") -> Every:
    """``every`` as the watch takes it: a positive ``int`` or ``"auto"``; :class:`GradGuardError` otherwise."""
    return _every(value, what, _EVERY_ACCEPTED)


def parse_memory(value: object, every: Every) -> TriggerSettings | None:
    """``memory`` as the watch takes it: ``True`` (the trigger's default settings), ``False`` or
    ``None`` (no memory trigger), or a :class:`TriggerSettings`; :class:`GradGuardError` otherwise.
    It applies to ``every="auto"`` only."""
    if value is True:
        return TriggerSettings() if every == "auto" else None
    if value is False or value is None:
        return None
    if isinstance(value, TriggerSettings):
        if every != "auto":
            raise GradGuardError(
                f"memory={value!r} is not accepted with every={every!r}: the memory trigger schedules audits for "
                "every='auto' only; pass every='auto', or leave memory out"
            )
        return value
    raise GradGuardError(
        f"memory={value!r} is not accepted; accepted: True (audit when memory grows, the default), False (no "
        "memory trigger) or gradguard.TriggerSettings(floor=..., window=..., ...)"
    )


def parse_audit(value: object, *, what: str = "audit") -> Every | None:
    """An ``audit=`` / ``GRADGUARD_AUDIT`` setting: ``every``, or ``None`` for no watch (0, ``off``, empty)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _OFF_WORDS | {""}):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return None
    return _every(value, what, _AUDIT_ACCEPTED)


# --------------------------------------------------------------------------------------------------
# The watcher
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class HolderHistory:
    """What the watch saw of one leaking holder, over the boundaries that found it.

    ``holder`` is the grouping key (:attr:`Retention.holder`), ``path`` the latest spelled path,
    ``tensors``, ``pinned_bytes``, ``nodes`` and ``node_bytes`` the latest audit's figures (see
    :class:`Retention`), ``survived`` the most step boundaries its graph had survived, ``audits``
    how many audits found it, ``alive`` whether its graphs could still be backwarded at the last
    one, ``outcome`` what the watch did the last time: ``"raised"``, ``"warned"``, ``"repaired"``
    (its graphs were released: read back, the holder no longer reaches them), ``"repaired in
    part"``, ``"not repairable"`` (a dead graph held where gradguard may not write; ``why`` says
    where) or ``"live"`` (still usable for backward: reported, not repaired). ``repaired`` counts
    the tensors released in place over all audits.
    """

    holder: str
    path: str
    fix: str
    outcome: str = ""
    tensors: int = 0
    pinned_bytes: int = 0
    survived: int = 0
    audits: int = 0
    repaired: int = 0
    nodes: int = 0
    node_bytes: int = 0
    alive: bool = False
    why: str = ""
    found_at: int = 0


OPTIMIZER_RESCAN = 30.0
"""Seconds between two looks for live optimizers in the heap (at an audit): a graph that reaches no
known optimizer's parameters is judged at every boundary. Every optimizer that steps is known at once."""

_MAX_RECIPES = 16  # repaired holders remembered by name; the least recently repaired is forgotten first
_MAX_SOURCES = 16  # optimizers remembered per thread; the least recently stepped is forgotten first


class _ThreadState:
    """One thread's boundaries: the schedule, and each source's own record."""

    __slots__ = ("schedule", "sequence", "stepped", "sources", "busy")

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.sequence: int | None = None  # torch's node counter of this thread at the end of the last boundary
        self.stepped: set[Hashable] = set()  # the sources already stepped since that counter last moved
        self.sources: collections.OrderedDict[Hashable, Source] = collections.OrderedDict()
        self.busy = False

    def source(self, key: Hashable) -> Source:
        source = self.sources.get(key)
        if source is None:
            source = self.sources[key] = Source()
            while len(self.sources) > _MAX_SOURCES:
                self.sources.popitem(last=False)
        else:
            self.sources.move_to_end(key)
        return source


class Watcher:
    """Audit at step boundaries and act on the leaks (what is a leak: the guide's *Finding a leak*).

    ``every``: a positive ``int`` (audit the boundaries ``every``, ``2*every``, ... of each thread)
    or ``"auto"`` (audit when the memory figure grows, with a backstop on time: see :func:`watch`).
    ``mode``: ``"warn"``, ``"raise"``, ``"detach"``, ``"off"`` (aliases as everywhere in gradguard),
    or ``None``: the mode in force (:func:`gradguard.get_mode`) at each boundary, in the thread of
    that boundary. ``ignore``: path prefixes or a predicate, as for :func:`gradguard.audit` (an
    iterable is read once, here).
    ``memory`` (``every="auto"`` only): ``True`` audits when the memory figure grows, with the
    default :class:`TriggerSettings`; a :class:`TriggerSettings` sets the rule; ``False`` schedules
    on time alone. A bad value raises :class:`GradGuardError` here.

    Call :meth:`boundary` at each step boundary (the :func:`watch` scope does it from every
    ``torch.optim.Optimizer.step``; framework callbacks call it from their step-end hooks).
    """

    def __init__(
        self, every: int | str = "auto", mode: str | None = None, ignore: Any = None, memory: Any = True
    ) -> None:
        self.every: Every = parse_every(every)
        self.mode: Mode | None = None if mode is None else normalize_mode(mode)
        self._ignore = check_ignore(ignore)  # a bad ignore is refused now; an iterable is read once
        self.ignore = ignore
        self.memory: TriggerSettings | None = parse_memory(memory, self.every)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._history: dict[str, HolderHistory] = {}
        self._counts = {"boundaries": 0, "audits": 0, "memory": 0}
        self._released = 0  # tensors the repair released, all holders
        self._recipes: collections.OrderedDict[str, Recipe] = collections.OrderedDict()  # repaired holders, by name
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()  # the live optimizers known
        self._rescan_at = 0.0  # when to look for optimizers in the heap again
        self._spent = 0.0
        self._read = 0.0
        self._started: float | None = None
        self._schedules: list[Schedule] = []
        self._listeners: list[Callable[[Watcher, BaseException | None], None]] = []

    def __repr__(self) -> str:
        return f"gradguard.Watcher(every={self.every!r}, mode={self.mode!r})"

    # ---------------------------------------------------------------------------------------------

    def boundary(self, optimizer: Any = None) -> RetentionReport | None:
        """One step boundary of the calling thread, after the optimizer stepped.

        ``optimizer``: the ``torch.optim.Optimizer`` that stepped (or several, in an iterable), or
        ``None``. A graph that can still be backwarded is judged only at boundaries of optimizers
        that update a parameter it reaches; ``None`` judges every graph.

        Returns ``None`` when this boundary is not audited (not due by ``every``, mode ``off``, the
        same step as this thread's previous boundary, or a boundary reached from inside an audit),
        and otherwise the report of the leaks this audit found (empty when none), after acting on
        them: ``warn`` warns once per holder (:class:`GraphRetentionWarning`, naming path, bytes and
        fix); ``detach`` repairs what is dead (no backward can use it any more: the value replaced,
        in the program's own state, by its detached self), counts it in :func:`gradguard.stats`
        (store ``"audit"``, site the holder) and warns once per holder it leaves alone (still usable
        for backward, or held where gradguard may not write); ``raise`` raises
        :class:`GraphRetentionError` naming every leak (its ``report`` attribute is the report).
        Nothing the audit saw stays referenced afterwards.
        """
        optimizers = _optimizers(optimizer)
        key = None if not optimizers else tuple(id(o) for o in optimizers)
        return self._boundary(key, optimizers)

    def _boundary(self, source: Hashable, optimizers: tuple[Any, ...] = ()) -> RetentionReport | None:
        state = self._state()
        if state.busy:
            return None
        sequence = torch.autograd._get_sequence_nr()
        if sequence == state.sequence and source not in state.stepped:
            state.stepped.add(source)  # another optimizer (or a callback) at the same step
            return None
        state.stepped = {source}
        own = state.source(source)
        own.boundaries += 1
        now = _clock()
        with self._lock:
            if self._started is None:
                self._started = now
            self._counts["boundaries"] += 1
        schedule = state.schedule
        mode = resolve(self.mode)
        if mode == OFF:
            schedule.boundaries += 1
            state.sequence = sequence
            return None
        read_before = schedule.read_seconds
        reason = schedule.boundary(now)
        with self._lock:
            self._read += schedule.read_seconds - read_before
        if reason is None:
            state.sequence = sequence
            return None
        state.busy = True
        with self._lock:
            known, released = len(self._history), self._released
        start = _clock()
        report: RetentionReport | None = None
        raised: BaseException | None = None
        try:
            report = self._audit(own, mode, optimizers)
            return report
        except BaseException as error:
            raised = error
            report = getattr(error, "report", None)
            raise
        finally:
            cost = _clock() - start
            state.busy = False
            with self._lock:
                new = len(self._history) > known or self._released > released
            schedule.audited(cost, new, found=bool(report), reason=reason)
            state.sequence = torch.autograd._get_sequence_nr()
            with self._lock:
                self._spent += cost
                self._counts["audits"] += 1
                self._counts["memory"] += reason == "memory"
            for listener in list(self._listeners):  # on_audit (issue 18)
                listener(self, raised)
            raised = None

    def _state(self) -> _ThreadState:
        try:
            state: _ThreadState = self._local.state
        except AttributeError:
            schedule = Schedule(self.every, self.memory, clock=_clock)
            state = self._local.state = _ThreadState(schedule)
            with self._lock:
                self._schedules.append(schedule)
        return state

    def _audit(self, source: Source, mode: Mode, optimizers: tuple[Any, ...]) -> RetentionReport:
        with scan_lock:
            found: list[Any] | None = None
            now = _clock()
            with self._lock:
                if now >= self._rescan_at:  # the optimizers made before the watch, or since the last look
                    found, self._rescan_at = [], now + OPTIMIZER_RESCAN
            tensors = live_graph_tensors(set(), found)
            with self._lock:
                self._optimizers.update(found or ())
                self._optimizers.update(optimizers)
                alive_optimizers = list(self._optimizers)
            born_at = source.age(tensors)
            if not born_at:  # every graph alive now was made since the last audit: nothing to judge
                return RetentionReport([])
            liveness = Liveness({t.grad_fn for t in tensors})
            known = self._known(tensors)
            if all(key in known for key in born_at):  # every old graph is in a holder repaired before
                tensors = [t for t in tensors if id(t) in known]
            findings, _ = scan_tensors(tensors, self._ignore, set(), liveness, known)
            del tensors, known
            params = None if not optimizers else functools.partial(_parameter_ids, optimizers, alive_optimizers)
            leaks = judge(findings, born_at, source, liveness, params)
            del findings, liveness
        return self._act(leaks, mode, user_frame())

    def _act(self, leaks: list[Leak], mode: Mode, frame: Any, ended: str = "") -> RetentionReport:
        """Act on ``leaks`` by ``mode``; warnings at ``frame`` (a frame, or a ``(file, line)``)."""
        report = RetentionReport([leak.finding.retention for leak in leaks])
        if not leaks:
            return report
        if mode == RAISE:
            message = _raise_message(leaks, ended)
            self._note(leaks, "raised")
            leaks.clear()  # the traceback keeps this frame: it must not keep the tensors
            error = GraphRetentionError(message)
            error.report = report  # type: ignore[attr-defined]
            raise error
        if mode == WARN:
            self._note(leaks, "warned")
            for leak in leaks:
                if _stats.claim_warning(STORE, leak.finding.key, "warn"):
                    _warn(_warn_message(leak, ended), frame)
        elif mode == DETACH:
            for leak in leaks:
                self._repair(leak, frame, ended)
        return report

    def mark(self) -> Source:
        """Every graph alive now, recorded (nothing is kept alive): :meth:`outlived`'s starting point."""
        with scan_lock:
            mark = Source()
            mark.age(live_graph_tensors(set()))
        return mark

    def outlived(self, mark: Source, what: str, where: tuple[str, int] | None = None) -> RetentionReport:
        """The graphs made since ``mark`` that are still alive, now that ``what`` (a test, a scope) has
        ended: nothing it made should still hold a graph. Each holder is acted on as at a boundary,
        by the watch's mode (the mode in force when it has none): ``raise`` raises
        :class:`GraphRetentionError`, ``warn`` warns at ``where`` (file, line), ``detach`` repairs
        what is dead. Costs one pass over the heap when nothing outlived it; the holders are
        searched for only when something did."""
        mode = resolve(self.mode)
        if mode == OFF:
            return RetentionReport([])
        start = _clock()
        try:
            with scan_lock:
                tensors = live_graph_tensors(set())
                old = mark.age(tensors)
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
            return self._act(leaks, mode, _ended_at(where), f" after {what} ended")
        finally:
            with self._lock:
                self._spent += _clock() - start
                self._counts["audits"] += 1

    def _known(self, tensors: list[torch.Tensor]) -> dict[int, Path]:
        """The live paths of the tensors (by id) in holders repaired before, read by their recipes."""
        with self._lock:
            recipes = list(self._recipes.values())
        ids = {id(t) for t in tensors}
        return {id(t): path for recipe in recipes for t, path in recipe.resolve() if id(t) in ids}

    def _repair(self, leak: Leak, frame: Any, ended: str = "") -> None:
        finding = leak.finding
        done = repair([finding.paths[i] for i in leak.leaking], [finding.tensors[i] for i in leak.leaking], leak.alive)
        if done.released:  # the program may fill it again: find it by name next time
            recipe = Recipe.of(finding.paths[leak.leaking[0]])
            if recipe is not None:
                with self._lock:
                    self._recipes[recipe.key] = recipe
                    self._recipes.move_to_end(recipe.key)
                    while len(self._recipes) > _MAX_RECIPES:
                        self._recipes.popitem(last=False)
        if done.detached:
            retention = finding.retention
            _stats.count_at(STORE, finding.key, done.detached, done.released, retention.pinned_bytes)
        self._note([leak], done.outcome, repaired=done.released, why=done.why)
        if done.outcome != REPAIRED and _stats.claim_warning(STORE, finding.key, done.outcome):
            _warn(_unrepaired_message(leak, done, ended), frame)

    def _note(self, leaks: Iterable[Leak], outcome: str, repaired: int = 0, why: str = "") -> None:
        with self._lock:
            for leak in leaks:
                r = leak.finding.retention
                entry = self._history.get(leak.finding.key)
                if entry is None:
                    entry = self._history[leak.finding.key] = HolderHistory(leak.finding.key, _named(r), r.fix)
                    entry.found_at = self._counts["boundaries"]
                entry.path, entry.fix, entry.tensors, entry.pinned_bytes = _named(r), r.fix, r.tensors, r.pinned_bytes
                entry.nodes, entry.node_bytes, entry.alive = r.nodes, r.node_bytes, any(leak.alive)
                entry.survived = max(entry.survived, leak.survived)
                entry.audits += 1
                entry.repaired += repaired
                self._released += repaired
                entry.outcome, entry.why = outcome, why

    def on_audit(self, listener: Callable[[Watcher, BaseException | None], None]) -> None:
        """Call ``listener(watcher, error)`` after each audit, in the auditing thread, with the counts
        and :meth:`history` already updated; ``error`` is the exception the audit is about to raise
        (a :class:`GraphRetentionError` in ``raise`` mode) or ``None``. An exception from the listener
        propagates out of ``optimizer.step()``: a listener handles its own. ``gradguard run`` writes
        each process's report from here, before a ``raise`` can end the process."""
        self._listeners.append(listener)

    # ---------------------------------------------------------------------------------------------

    @property
    def boundaries(self) -> int:
        """Step boundaries counted so far, all threads."""
        return self._counts["boundaries"]

    @property
    def audits(self) -> int:
        """Audits run so far, all threads."""
        return self._counts["audits"]

    @property
    def audit_seconds(self) -> float:
        """Wall time the audits took, all threads."""
        return self._spent

    @property
    def read_seconds(self) -> float:
        """Wall time the memory readings took, all threads."""
        return self._read

    @property
    def memory_audits(self) -> int:
        """Audits the memory trigger asked for (growth, and the confirmations after it), all threads."""
        return self._counts["memory"]

    def history(self) -> list[HolderHistory]:
        """Every holder an audit found leaking, most pinned bytes first."""
        with self._lock:
            entries = [dataclasses.replace(e) for e in self._history.values()]
        return sorted(entries, key=lambda e: (-e.pinned_bytes, e.holder))

    def summary(self) -> str:
        """A few lines: boundaries, audits and the watch's share of the time, what the memory trigger
        saw, and a table of the leaking holders. Says plainly when nothing was checked (no optimizer
        step, or no audit), and how many boundaries an all-clear covers."""
        elapsed = 0.0 if self._started is None else _clock() - self._started
        boundaries, audits = self.boundaries, self.audits
        if not boundaries:
            return "gradguard watch: no optimizer step was seen: nothing was checked"
        share = ""
        if elapsed > 0 and (audits or self._read):
            share = f" ({100 * (self._spent + self._read) / elapsed:.2f}% of the time since the first)"
        asked = f", {self.memory_audits} of them for memory growth" if self.memory_audits else ""
        head = f"gradguard watch: {_plural(boundaries, 'step boundary')}, {audits} audited{asked}{share}"
        memory = self.memory_line()
        entries = self.history()
        if not audits:
            return f"{head}: no audit ran, nothing was checked{memory}"
        if not entries:
            covered = "the audited boundary" if audits == 1 else f"the {audits} audited boundaries"
            unaudited = f"; {boundaries - audits} were not audited" if audits < boundaries else ""
            return f"{head}; at {covered}, no autograd graph had outlived a step boundary{unaudited}{memory}"
        total = sum(e.pinned_bytes for e in entries)
        nodes = sum(e.node_bytes for e in entries)
        rows = [
            (
                display(e.path),
                str(e.tensors),
                human(e.pinned_bytes),
                nodes_text(e.nodes, e.node_bytes),
                str(e.survived),
                e.outcome,
                display(e.fix),
            )
            for e in entries
        ]
        header = ("holder", "tensors", "pinned", "nodes", "steps survived", "outcome", "fix")
        return (
            f"{head}; {_plural(len(entries), 'holder')} kept autograd graphs across step boundaries "
            f"({human(total)} of tensors and ~{human(nodes)} of graph nodes pinned at their last audit):\n"
            f"{_table.text(header, rows)}"
        )

    def memory_line(self) -> str:
        """What the memory trigger did (empty without one), for a summary whose audits found nothing:
        a run it watched without asking for an audit was not checked by one, and the reader should know
        how small a leak could have stayed under it."""
        with self._lock:
            schedules = list(self._schedules)
        triggers = [s.trigger for s in schedules if s.trigger is not None]
        if not triggers:
            return ""
        reader = next(s.reader for s in schedules if s.trigger is not None and s.reader is not None)
        floor = max(t.settings.floor for t in triggers)
        window = min(t.settings.window for t in triggers)
        return f"; memory ({reader.describe()}) was read at each boundary and " + (
            "asked for an audit"
            if self.memory_audits
            else f"never rose {human(floor)} over its low-water mark of the last {window} boundaries (a leak "
            f"of {human(floor // window)} per step or more would have)"
        )


def _ended_at(where: tuple[str, int] | None) -> Any:
    return where if where is not None else user_frame()


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


def _optimizers(optimizer: Any) -> tuple[Any, ...]:
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    try:
        found = tuple(optimizer)
    except TypeError:
        found = ()
    if not found or not all(isinstance(o, torch.optim.Optimizer) for o in found):
        raise GradGuardError(
            f"Watcher.boundary(optimizer={optimizer!r}) is not accepted; pass the torch.optim.Optimizer that "
            "stepped, an iterable of them, or None (judge every graph)"
        )
    return found


def _named(r: Retention) -> str:
    """The holder as a message names it: the path of its one tensor, or the holder (``[*]``) of several."""
    return r.path if r.tensors == 1 else r.holder


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word[:-1]}ies" if word.endswith("y") else f"{n} {word}s"


def _state(leak: Leak) -> str:
    if all(leak.alive):
        return "its graph can still be backwarded"
    if any(leak.alive):
        return "some of its graphs can still be backwarded"
    return "its graph is dead: no backward can use it"


def _figures(r: Retention, survived: int, ended: str = "") -> str:
    pinned = (
        f"{_plural(r.tensors, 'tensor')}, {human(r.pinned_bytes)} of tensors and {nodes_text(r.nodes, r.node_bytes)} "
        "graph nodes pinned"
    )
    return pinned if ended else f"{pinned}, alive for {_plural(survived, 'step boundary')}"


def _across(ended: str) -> str:
    return ended or " across step boundaries"


def _warn_message(leak: Leak, ended: str = "") -> str:
    r = leak.finding.retention
    return (
        f"gradguard: {_named(r)} keeps an autograd graph{_across(ended)} ({_figures(r, leak.survived, ended)}; "
        f"{_state(leak)}); fix: {r.fix}"
    )


def _unrepaired_message(leak: Leak, done: Repair, ended: str = "") -> str:
    r = leak.finding.retention
    if done.outcome == LIVE:
        what = "still usable for backward: not repaired (detaching it could change a gradient)"
    elif done.outcome == PARTLY:
        what = f"repaired in part: {done.released} of {len(leak.leaking)} tensors released; the rest: {done.why}"
    else:
        what = f"cannot be repaired in place: it is held through {done.why}"
    return (
        f"gradguard: {_named(r)} keeps an autograd graph{_across(ended)} ({_figures(r, leak.survived, ended)}); "
        f"{what}; fix: {r.fix}"
    )


def _raise_message(leaks: list[Leak], ended: str = "") -> str:
    total = sum(leak.finding.retention.pinned_bytes for leak in leaks)
    nodes = sum(leak.finding.retention.node_bytes for leak in leaks)
    completed = "" if ended else "; the optimizer step itself completed"
    lines = [
        f"gradguard: {_plural(len(leaks), 'holder')} {'keeps' if len(leaks) == 1 else 'keep'} autograd graphs"
        f"{_across(ended)} ({human(total)} of tensors and ~{human(nodes)} of graph nodes pinned){completed}:"
    ]
    for leak in leaks:
        r = leak.finding.retention
        lines.append(f"  {_named(r)}: {_figures(r, leak.survived, ended)}; {_state(leak)}; fix: {r.fix}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The scope
# --------------------------------------------------------------------------------------------------


class _WatchInstall(_Install):
    """torch's global optimizer step post hook, calling one watcher's boundary after every step."""

    def __init__(self, watcher: Watcher, key: Hashable) -> None:
        self.watcher = watcher
        self.key = key
        self.handle: RemovableHandle | None = None

    def install(self) -> None:
        self.handle = register_optimizer_step_post_hook(self._hook)

    def uninstall(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.watcher._boundary(id(optimizer), (optimizer,))


_serial = itertools.count(1)


def audit_install(audit: object) -> _Install | None:
    """``enforce(audit=...)``'s install: ``audit`` when given, else ``GRADGUARD_AUDIT`` unless the
    process watch already runs it; ``None`` for no watch.

    Scopes asking for the same ``every`` share one watcher (its mode is the scope's: ``None``).
    """
    if audit is None:
        if _process_watch is not None:
            return None
        every = parse_audit(os.environ.get(AUDIT_ENV), what=AUDIT_ENV)
    else:
        every = parse_audit(audit)
    if every is None:
        return None
    return _WatchInstall(Watcher(every=every), ("watch", f"audit={every}"))


register_audit_installer(audit_install)


class _ProcessWatch:
    """``GRADGUARD_AUDIT`` set when gradguard was imported: the process's watch. Its value is read at
    the first ``optimizer.step()`` (a bad one is refused there, after the step), then every step is
    that watcher's boundary."""

    def __init__(self) -> None:
        self.watcher: Watcher | None = None
        self.off = False
        self.handle = register_optimizer_step_post_hook(self._hook)

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.watcher is None and not self.off:
            every = parse_audit(os.environ.get(AUDIT_ENV), what=AUDIT_ENV)
            if every is None:
                self.off = True
            else:
                self.watcher = Watcher(every=every)
        if self.watcher is not None:
            self.watcher._boundary(id(optimizer), (optimizer,))

    def stop(self) -> None:
        self.handle.remove()


_process_watch: _ProcessWatch | None = None


def start_process_watch() -> None:
    """At import: the process watch, when ``GRADGUARD_AUDIT`` is set (to anything: it is parsed at the
    first step)."""
    global _process_watch
    if _process_watch is None and os.environ.get(AUDIT_ENV, "").strip():
        _process_watch = _ProcessWatch()


def stop_process_watch() -> None:
    """``gradguard run`` runs its own watch from the same setting: the process watch stops."""
    global _process_watch
    if _process_watch is not None:
        _process_watch.stop()
        _process_watch = None


class watch(enforce):
    """Audit at the optimizer steps of any ``torch.optim.Optimizer``, and act on leaks.

    A :class:`Watcher` (``every``, ``mode``, ``ignore``, ``memory`` as there) whose :meth:`Watcher.boundary`
    runs from torch's global optimizer step post hook, registered while the scope is entered: in a
    ``with`` block, or around a decorated function (for a coroutine function while it runs, for a
    generator or async generator function from its first resumption to its end). Nestable and
    re-entrant: each scope's hook is removed exactly when it leaves, the enclosing ones stay. In
    ``raise`` mode the :class:`GraphRetentionError` comes out of the ``optimizer.step()`` call, after
    the step completed. ``watcher`` is the :class:`Watcher` (its :meth:`~Watcher.summary`, its
    :meth:`~Watcher.history`).
    """

    def __init__(
        self, every: int | str = "auto", mode: str | None = None, ignore: Any = None, memory: Any = True
    ) -> None:
        super().__init__(mode=None, engines="none", audit=0)
        self.watcher = Watcher(every=every, mode=mode, ignore=ignore, memory=memory)
        self._installs = [_WatchInstall(self.watcher, ("watch", f"#{next(_serial)}"))]

    def __enter__(self) -> watch:
        super().__enter__()
        return self

    def __repr__(self) -> str:
        w = self.watcher
        return f"gradguard.watch(every={w.every!r}, mode={w.mode!r})"
