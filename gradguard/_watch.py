"""The step-boundary watch: :func:`watch` and :class:`Watcher`.

At a step boundary (``optimizer.step()`` has just run) the graphs of earlier steps should all be
gone. The watch audits the heap there (:func:`gradguard.audit`'s scan), decides which holders are
leaks, and acts on them by mode: ``warn``, ``raise``, ``detach`` (repair in place) or ``off``.

What is a leak
    A graph is a leak when one of its autograd nodes was already alive at the previous audited
    boundary (of the same optimizer, in the same thread). The current step's ``loss``, still a frame
    local at ``optimizer.step()``, is a graph made since then: it is never a leak. A list that keeps last
    step's loss, a metrics dict, a module attribute set once and kept: the tensor itself was there
    last time. ``loss_sum += loss`` (or ``loss_sum = loss_sum + loss``): the new tensor's graph
    contains the previous sum's node. A holder is a leak when any of its tensors is, and it has
    survived ``b`` step boundaries when the oldest of those nodes was first seen ``b`` boundaries
    ago. So a leak is found at the second audit that sees it, and only a graph that *outlives* a
    boundary can be one: a module attribute overwritten by every forward (it holds the current
    step's graph at each boundary) is listed by :func:`gradguard.audit` but never acted on.

    One exception: a graph held by a frame's variable, directly or in containers (``loss``,
    ``out[0]``, ``outputs['logits']``, but not ``self.metrics['loss_sum']``: an attribute is an
    object's state), is a leak only once it has survived two boundaries. ``loss =
    train_step(batch)``, where ``train_step`` runs backward and ``optimizer.step()``, still holds
    the previous step's loss in the caller while the next step runs: that graph outlives exactly
    one boundary and is then replaced. A frame's ``loss_sum``, or a list that is a frame's
    variable, keeps growing past that: it is found one boundary later than state would be (with
    ``every=1``; with ``every`` ≥ 2 at the second audit as well).

How a node is recognised without keeping it alive
    torch's autograd nodes take no weak reference, and their Python objects come and go while the
    node lives, so neither a weak reference nor ``id()`` can follow one. Each node owns a
    ``metadata`` dict (torch creates it on first read and keeps it exactly as long as the node; it
    stays empty outside anomaly mode). At an audited boundary the watch records, for the
    ``grad_fn`` of every tensor it judged, that dict, keyed by the node's ``(sequence number,
    type)``. Holding the dict keeps nothing but the dict, and, while it is held, no other object can
    take its id. At the next audited boundary each judged graph is walked from its root; a node
    whose ``(sequence number, type)`` was recorded is compared by identity of its ``metadata`` dict,
    which makes the answer exact, across threads too (sequence numbers are per thread). Only the
    recorded roots and nodes with a recorded key ever get a ``metadata`` dict made. A node whose
    dict names a parent node (anomaly mode, double backward) is not recorded: holding that dict
    would keep the parent alive. Every graph made from a tensor the scan could see contains that
    tensor's ``grad_fn``, so recording the roots is enough. Outside ``detach`` mode the watch
    changes nothing else: that empty dict, which torch makes the same way for any reader of
    ``grad_fn.metadata``, is its only trace on a graph.

Threads
    Each thread has its own boundaries: a boundary is the ``optimizer.step()`` of that thread (or a
    :meth:`Watcher.boundary` call from it), and the previous audited boundary is that thread's. At
    a boundary, tensors that only another thread's frames hold are neither judged nor recorded:
    that thread may be mid-forward or mid-backward, and its own boundaries judge them. Everything
    else (module globals, class attributes, objects, suspended generators' frames) is judged at
    every thread's boundary. A forward that runs across two boundaries of this thread and is
    reachable from such a shared root would be judged a leak.

How often: ``every``
    An audit is a search of the whole heap: its cost grows with the number of live objects, not with
    the model, and on a CPU it takes as long as one or several training steps of a small model
    (``benchmarks/results/watch-cpu.md``). So the default is ``every="auto"``: each thread's first
    two boundaries are audited (a leak shows at the second), then a boundary whenever the time its
    audits have taken, plus two more as long as the last one, stays within 1% of the wall time since
    its first boundary (one audit of margin: an audit slower than the last one does not take the
    share past 1%). The watch times its own audits; the share falls to just under 1% as the first
    two are amortised, whatever the step time, and a thread audits about every ``100 × audit /
    step`` boundaries. A positive ``int`` audits every ``every``-th boundary (``every=1`` for tests
    and for hunting a leak).

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
    Each optimizer has its own boundaries, each with its own record: in a GAN's loop (the
    discriminator's loss, backward, its step, then the generator's) the discriminator's loss is
    still a frame local at the generator's step, made before the discriminator's step, but after
    the generator's previous one; it is not a leak. (Direct :meth:`Watcher.boundary` calls are one
    more source.) Several ``optimizer.step()`` calls in one thread with no autograd node made in
    that thread in between (two optimizers over one backward, a callback's boundary next to the
    optimizer hook) are one boundary: the first is counted and audited, the others return
    ``None``. The same optimizer stepping again is always a new boundary. ``every`` and ``"auto"``
    count a thread's boundaries, whatever their optimizer.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Literal

import torch
import wrapt
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from . import _stats, _table
from ._audit import Finding, Retention, RetentionReport, check_ignore, scan
from ._criterion import Leak, Source, judge
from ._enforce import _Install, enforce
from ._errors import GradGuardError, GraphRetentionError, GraphRetentionWarning
from ._message import display, human
from ._paths import Path, read, writable, write
from ._policy import DETACH, OFF, RAISE, WARN, Mode, normalize_mode, resolve
from ._site import warn_at
from ._tree import detach

__all__ = [
    "AUDIT_ENV",
    "AUTO_SHARE",
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
AUTO_SHARE = 0.01
"""``every="auto"``: the most of a thread's wall time since its first boundary its audits may take."""

_clock = time.perf_counter

STORE = "audit"
"""The store name of the watch's repairs in :func:`gradguard.stats` (the site is the holder's path)."""

_EVERY_ACCEPTED = (
    "a positive whole number N (audit every N-th step boundary) or 'auto' (audit the first two "
    "boundaries, then as often as keeps the audits under 1% of the wall time)"
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


def parse_audit(value: object, *, what: str = "audit") -> Every | None:
    """An ``audit=`` / ``GRADGUARD_AUDIT`` setting: ``every``, or ``None`` for no watch (0, ``off``, empty)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _OFF_WORDS | {""}):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return None
    return _every(value, what, _AUDIT_ACCEPTED)


# --------------------------------------------------------------------------------------------------
# Repair
# --------------------------------------------------------------------------------------------------


_UNWRITABLE = {
    "local": "a frame local",
    "cell": "a closure cell",
    "key": "a dict key",
    "member": "a set member",
    "ref": "a reference Python cannot assign",
}


def _deepest_writable(path: Path) -> int | None:
    for j in range(len(path) - 1, -1, -1):
        if writable(path[j]):
            return j
    return None


def _live(path: Path, j: int) -> bool:
    """Whether ``path`` still leads, edge by edge, to the owner of edge ``j``: ``False`` only where an
    edge reads back another object (an earlier repair or another thread replaced something on the
    way). An edge that cannot be read back (a reference Python cannot name) cannot tell: the repair
    goes ahead rather than being skipped and reported as done."""
    for i in range(j):
        try:
            now = read(path[i])
        except (LookupError, AttributeError, IndexError, TypeError, ValueError):
            continue
        if now is not path[i + 1].owner:
            return False
    return True


def _why_not(path: Path) -> str:
    kinds = []
    for edge in path:
        what = "a tuple item" if edge.kind == "item" else _UNWRITABLE.get(edge.kind, f"a {edge.kind}")
        if what not in kinds:
            kinds.append(what)
    return " and ".join(kinds)


# --------------------------------------------------------------------------------------------------
# The watcher
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class HolderHistory:
    """What the watch saw of one leaking holder, over the boundaries that found it.

    ``holder`` is the grouping key (:attr:`Retention.holder`), ``path`` the latest spelled path,
    ``tensors`` and ``pinned_bytes`` the latest audit's figures, ``survived`` the most step
    boundaries its graph had survived, ``audits`` how many audits found it, ``outcome`` what the
    watch did the last time: ``warned``, ``raised``, ``repaired``, ``not repairable`` or
    ``repaired in part``. ``repaired`` counts the tensors detached in place over all audits.
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


_MAX_SOURCES = 16  # optimizers remembered per thread; the least recently stepped is forgotten first


class _ThreadState:
    """One thread's boundaries: their count and the schedule, and each source's own record."""

    __slots__ = ("boundaries", "sequence", "stepped", "sources", "started", "spent", "last_cost", "busy")

    def __init__(self) -> None:
        self.boundaries = 0
        self.sequence: int | None = None  # torch's node counter of this thread at the end of the last boundary
        self.stepped: set[Hashable] = set()  # the sources already stepped since that counter last moved
        self.sources: collections.OrderedDict[Hashable, Source] = collections.OrderedDict()
        self.started = 0.0
        self.spent = 0.0  # seconds spent auditing
        self.last_cost = 0.0
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
    """Audit at step boundaries and act on the leaks (see the module documentation for the criterion).

    ``every``: a positive ``int`` (audit the boundaries ``every``, ``2*every``, ... of each thread)
    or ``"auto"``: audit a thread's first two boundaries, then a boundary whenever the time its
    audits have taken, plus two more as long as the last one, stays within 1% of the wall time
    since its first boundary; the watch measures its own audits. ``mode``: ``"warn"``, ``"raise"``, ``"detach"``,
    ``"off"`` (aliases as everywhere in gradguard), or ``None``: the mode in force
    (:func:`gradguard.get_mode`) at each boundary, in the thread of that boundary. ``ignore``:
    path prefixes or a predicate, as for :func:`gradguard.audit`. A bad value raises
    :class:`GradGuardError` here.

    Call :meth:`boundary` at each step boundary (the :func:`watch` scope does it from every
    ``torch.optim.Optimizer.step``; framework callbacks call it from their step-end hooks).
    """

    def __init__(self, every: int | str = "auto", mode: str | None = None, ignore: Any = None) -> None:
        self.every: Every = parse_every(every)
        self.mode: Mode | None = None if mode is None else normalize_mode(mode)
        check_ignore(ignore)  # a bad ignore is refused now, not at the first audit
        self.ignore = ignore
        self._local = threading.local()
        self._lock = threading.Lock()
        self._history: dict[str, HolderHistory] = {}
        self._counts = {"boundaries": 0, "audits": 0}
        self._spent = 0.0
        self._started: float | None = None
        self._listeners: list[Callable[[Watcher, BaseException | None], None]] = []

    def __repr__(self) -> str:
        return f"gradguard.Watcher(every={self.every!r}, mode={self.mode!r})"

    # ---------------------------------------------------------------------------------------------

    def boundary(self) -> RetentionReport | None:
        """One step boundary of the calling thread, after the optimizer stepped.

        Returns ``None`` when this boundary is not audited (not due by ``every``, mode ``off``, the
        same step as this thread's previous boundary, or a boundary reached from inside an audit),
        and otherwise the report of the leaks this audit found (empty when none), after acting on
        them: ``warn`` warns once per holder (:class:`GraphRetentionWarning`, naming path, bytes and
        fix); ``detach`` replaces each leaking value at the deepest assignable place on its path
        with ``detach_tree(value)``, counts it in :func:`gradguard.stats` (store ``"audit"``, site
        the holder) and warns once per holder it cannot repair (a frame local, a tuple item, a
        closure cell); ``raise`` raises :class:`GraphRetentionError` naming every leak (its
        ``report`` attribute is the report). Nothing the audit saw stays referenced afterwards.
        """
        return self._boundary(None)

    def _boundary(self, source: Hashable) -> RetentionReport | None:
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
        if not state.boundaries:
            state.started = now
        with self._lock:
            if self._started is None:
                self._started = now
            self._counts["boundaries"] += 1
        state.boundaries += 1
        mode = resolve(self.mode)
        if mode == OFF or not self._due(state, now):
            state.sequence = sequence
            return None
        state.busy = True
        raised: BaseException | None = None
        try:
            return self._audit(own, mode)
        except BaseException as exc:
            raised = exc
            raise
        finally:
            cost = _clock() - now
            state.busy = False
            state.spent += cost
            state.last_cost = cost
            state.sequence = torch.autograd._get_sequence_nr()
            with self._lock:
                self._spent += cost
                self._counts["audits"] += 1
            for listener in list(self._listeners):  # on_audit (issue 18)
                listener(self, raised)
            raised = None

    def _state(self) -> _ThreadState:
        try:
            state: _ThreadState = self._local.state
        except AttributeError:
            state = self._local.state = _ThreadState()
        return state

    def _due(self, state: _ThreadState, now: float) -> bool:
        if self.every != "auto":
            return state.boundaries % self.every == 0
        if state.boundaries <= 2:
            return True
        return state.spent + 2 * state.last_cost <= AUTO_SHARE * (now - state.started)

    def _audit(self, state: Source, mode: Mode) -> RetentionReport:
        leaks = judge(scan(self.ignore), state)
        report = RetentionReport([finding.retention for finding, _, _ in leaks])
        if not leaks:
            return report
        if mode == RAISE:
            message = _raise_message(leaks)
            self._note(leaks, "raised")
            leaks.clear()  # the traceback keeps this frame: it must not keep the tensors
            error = GraphRetentionError(message)
            error.report = report  # type: ignore[attr-defined]
            raise error
        if mode == WARN:
            self._note(leaks, "warned")
            frame = _user_frame()
            for finding, _, survived in leaks:
                if _stats.claim_warning(STORE, finding.key, "warn"):
                    warn_at(_warn_message(finding, survived), GraphRetentionWarning, frame)
        elif mode == DETACH:
            self._repair(leaks)
        return report

    def _repair(self, leaks: list[Leak]) -> None:
        frame = _user_frame()
        for finding, leaking, survived in leaks:
            writes = tensors = 0
            stuck: list[Path] = []
            for i in leaking:
                path = finding.paths[i]
                j = _deepest_writable(path)
                if j is None:
                    stuck.append(path)
                    continue
                if not _live(path, j):
                    continue  # replaced already, through another of this holder's paths
                old = read(path[j])
                new, n = detach(old)
                if n:
                    write(path[j], new)
                    writes += 1
                    tensors += n
                del old, new
            if writes:
                _stats.count_at(STORE, finding.key, writes, tensors, finding.retention.pinned_bytes)
            outcome = "repaired" if not stuck else "repaired in part" if writes else "not repairable"
            self._note([(finding, leaking, survived)], outcome, repaired=tensors)
            if stuck and _stats.claim_warning(STORE, finding.key, "not repairable"):
                warn_at(_stuck_message(finding, survived, stuck[0]), GraphRetentionWarning, frame)

    def _note(self, leaks: Iterable[Leak], outcome: str, repaired: int = 0) -> None:
        with self._lock:
            for finding, _, survived in leaks:
                r = finding.retention
                entry = self._history.get(finding.key)
                if entry is None:
                    entry = self._history[finding.key] = HolderHistory(finding.key, _named(r), r.fix)
                entry.path, entry.fix, entry.tensors, entry.pinned_bytes = _named(r), r.fix, r.tensors, r.pinned_bytes
                entry.survived = max(entry.survived, survived)
                entry.audits += 1
                entry.repaired += repaired
                entry.outcome = outcome

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

    def history(self) -> list[HolderHistory]:
        """Every holder an audit found leaking, most pinned bytes first."""
        with self._lock:
            entries = [dataclasses.replace(e) for e in self._history.values()]
        return sorted(entries, key=lambda e: (-e.pinned_bytes, e.holder))

    def summary(self) -> str:
        """A few lines: boundaries, audits and their share of the time, and a table of the leaking holders."""
        elapsed = 0.0 if self._started is None else _clock() - self._started
        share = ""
        if elapsed > 0 and self.audits:
            share = f" ({100 * self._spent / elapsed:.2f}% of the time since the first)"
        head = f"gradguard watch: {_plural(self.boundaries, 'step boundary')}, {self.audits} audited{share}"
        entries = self.history()
        if not entries:
            return f"{head}; no autograd graph outlived a step boundary"
        total = sum(e.pinned_bytes for e in entries)
        rows = [
            (display(e.path), str(e.tensors), human(e.pinned_bytes), str(e.survived), e.outcome, display(e.fix))
            for e in entries
        ]
        header = ("holder", "tensors", "pinned", "steps survived", "outcome", "fix")
        return (
            f"{head}; {_plural(len(entries), 'holder')} kept autograd graphs across step boundaries "
            f"({human(total)} pinned at their last audit):\n{_table.text(header, rows)}"
        )


_SKIPPED_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in (sys.modules[__package__], wrapt, torch)
)


def _user_frame() -> types.FrameType | None:
    """The innermost frame outside gradguard, wrapt and torch: the line that called ``optimizer.step()``."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_DIRS):
        frame = frame.f_back
    return frame


def _named(r: Retention) -> str:
    """The holder as a message names it: the path of its one tensor, or the holder (``[*]``) of several."""
    return r.path if r.tensors == 1 else r.holder


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word[:-1]}ies" if word.endswith("y") else f"{n} {word}s"


def _warn_message(finding: Finding, survived: int) -> str:
    r = finding.retention
    return (
        f"gradguard: {_named(r)} keeps an autograd graph across step boundaries ({_plural(r.tensors, 'tensor')}, "
        f"{human(r.pinned_bytes)} pinned, alive for {_plural(survived, 'step boundary')}); fix: {r.fix}"
    )


def _stuck_message(finding: Finding, survived: int, path: Path) -> str:
    r = finding.retention
    return (
        f"gradguard: {_named(r)} keeps an autograd graph across step boundaries ({human(r.pinned_bytes)} pinned, "
        f"alive for {_plural(survived, 'step boundary')}) and cannot be repaired in place: it is held through "
        f"{_why_not(path)}; fix: {r.fix}"
    )


def _raise_message(leaks: list[Leak]) -> str:
    total = sum(f.retention.pinned_bytes for f, _, _ in leaks)
    lines = [
        f"gradguard: {_plural(len(leaks), 'holder')} {'keeps' if len(leaks) == 1 else 'keep'} autograd graphs "
        "across step boundaries "
        f"({human(total)} pinned); the optimizer step itself completed:"
    ]
    for finding, _, survived in leaks:
        r = finding.retention
        lines.append(
            f"  {_named(r)}: {_plural(r.tensors, 'tensor')}, {human(r.pinned_bytes)} pinned, alive for "
            f"{_plural(survived, 'step boundary')}; fix: {r.fix}"
        )
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
        self.watcher._boundary(id(optimizer))


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
            self.watcher._boundary(id(optimizer))

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
    """Audit after every ``every``-th optimizer step of any ``torch.optim.Optimizer``, and act on leaks.

    A :class:`Watcher` (``every``, ``mode``, ``ignore`` as there) whose :meth:`Watcher.boundary`
    runs from torch's global optimizer step post hook, registered while the scope is entered: in a
    ``with`` block, or around a decorated function (for a coroutine function while it runs, for a
    generator or async generator function from its first resumption to its end). Nestable and
    re-entrant: each scope's hook is removed exactly when it leaves, the enclosing ones stay. In
    ``raise`` mode the :class:`GraphRetentionError` comes out of the ``optimizer.step()`` call, after
    the step completed. ``watcher`` is the :class:`Watcher` (its :meth:`~Watcher.summary`, its
    :meth:`~Watcher.history`).
    """

    def __init__(self, every: int | str = "auto", mode: str | None = None, ignore: Any = None) -> None:
        super().__init__(mode=None, engines="none", audit=0)
        self.watcher = Watcher(every=every, mode=mode, ignore=ignore)
        self._installs = [_WatchInstall(self.watcher, ("watch", f"#{next(_serial)}"))]

    def __enter__(self) -> watch:
        super().__enter__()
        return self

    def __repr__(self) -> str:
        w = self.watcher
        return f"gradguard.watch(every={w.every!r}, mode={w.mode!r})"
