"""What the watch says: its warnings and errors, each holder's history, and the end-of-run summary.

One record per holder (:class:`HolderHistory`) and one per watch (:class:`WatchFigures`), and one
renderer of them (:func:`render`), whatever asks: :meth:`gradguard.Watcher.summary`, the summary
``gradguard run`` prints for a whole command, ``gradguard report``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .._policy import table as _table
from .._policy.message import display, human, plural
from .audit import Retention, nodes_text
from .criterion import Leak
from .repair import LIVE, PARTLY, Repair

__all__ = [
    "BOUNDED",
    "HolderHistory",
    "WatchFigures",
    "named",
    "raise_message",
    "render",
    "unrepaired_message",
    "warn_message",
]

BOUNDED = "bounded"
"""A holder's outcome when its graph was replaced at every step: listed, never acted on."""


@dataclasses.dataclass
class HolderHistory:
    """What the watch saw of one holder over the audits that found it.

    Attributes:
        holder: The grouping key (:attr:`Retention.holder`).
        path: The latest spelled path.
        fix: What to do about it.
        outcome: What the watch did the last time: ``"raised"``, ``"warned"``, ``"repaired"`` (its
            graphs were released: read back, the holder no longer reaches them), ``"repaired in
            part"``, ``"not repairable"`` (a dead graph held where gradguard may not write; ``why``
            says where), ``"live"`` (still usable for backward: reported, not repaired) or
            ``"bounded"`` (one step's graph, replaced at every step: listed, not acted on).
        tensors: Graph tensors it held at the latest audit.
        pinned_bytes: Bytes of tensors its graphs pinned then (see :class:`Retention`).
        survived: The most step boundaries one of its graphs had lived through.
        audits: How many audits found it.
        repaired: Tensors released in place, over all audits.
        nodes: Autograd nodes of its graphs at the latest audit.
        node_bytes: Their estimated bytes.
        alive: Whether its graphs could still be backwarded at the latest audit.
        why: Why it could not be repaired.
        found_at: The step boundary (of the watch, all threads) at which it was first found.
        released_bytes: Memory the repairs measurably gave back (the memory figure before and after a
            repair; 0 where nothing was measured: then ``pinned_bytes`` is the estimate).
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
    released_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class WatchFigures:
    """What one watch did, for :func:`render`.

    Attributes:
        boundaries: Step boundaries counted.
        audits: Boundaries audited (a pass over the heap).
        searches: Audits that searched the heap for the holders of old graphs.
        seconds: Wall time the audits and the memory readings took.
        elapsed: Wall time since the first boundary (0: unknown).
        memory_audits: Audits asked for by the memory figure.
        stamped: Graph nodes stamped (at backwards and audits) to be followed in constant time.
        unexplained: Graphs older than two boundaries, alive at the last audit, that no holder was found for.
        memory: One clause on the memory figure (its growth and what explained it), or ``""``.
    """

    boundaries: int
    audits: int
    searches: int = 0
    seconds: float = 0.0
    elapsed: float = 0.0
    memory_audits: int = 0
    stamped: int = 0
    unexplained: int = 0
    memory: str = ""


def named(r: Retention) -> str:
    """The holder as a message names it: the path of its one tensor, or the holder (``[*]``) of several."""
    return r.path if r.tensors == 1 else r.holder


def _state(leak: Leak) -> str:
    if all(leak.alive):
        return "its graph can still be backwarded"
    if any(leak.alive):
        return "some of its graphs can still be backwarded"
    return "its graph is dead: no backward can use it"


def _figures(r: Retention, survived: int, ended: str = "") -> str:
    pinned = (
        f"{plural(r.tensors, 'tensor')}, {human(r.pinned_bytes)} of tensors and {nodes_text(r.nodes, r.node_bytes)} "
        "graph nodes pinned"
    )
    return pinned if ended else f"{pinned}, alive for {plural(survived, 'step boundary')}"


def _across(ended: str) -> str:
    return ended or " across step boundaries"


def warn_message(leak: Leak, ended: str = "") -> str:
    """The warning for one leaking holder (``ended``: what ended, for a leak found at a scope's end)."""
    r = leak.finding.retention
    return (
        f"gradguard: {named(r)} keeps an autograd graph{_across(ended)} ({_figures(r, leak.survived, ended)}; "
        f"{_state(leak)}); fix: {r.fix}"
    )


def unrepaired_message(leak: Leak, done: Repair, ended: str = "") -> str:
    """The warning for a holder ``detach`` mode left alone, in part or whole."""
    r = leak.finding.retention
    if done.outcome == LIVE:
        what = "still usable for backward: not repaired (detaching it could change a gradient)"
    elif done.outcome == PARTLY:
        what = f"repaired in part: {done.released} of {len(leak.leaking)} tensors released; the rest: {done.why}"
    else:
        what = f"cannot be repaired in place: it is held through {done.why}"
    return (
        f"gradguard: {named(r)} keeps an autograd graph{_across(ended)} ({_figures(r, leak.survived, ended)}); "
        f"{what}; fix: {r.fix}"
    )


def raise_message(leaks: Sequence[Leak], ended: str = "") -> str:
    """The :class:`GraphRetentionError` text naming every leaking holder."""
    total = sum(leak.finding.retention.pinned_bytes for leak in leaks)
    nodes = sum(leak.finding.retention.node_bytes for leak in leaks)
    completed = "" if ended else "; the optimizer step itself completed"
    lines = [
        f"gradguard: {plural(len(leaks), 'holder')} {'keeps' if len(leaks) == 1 else 'keep'} autograd graphs"
        f"{_across(ended)} ({human(total)} of tensors and ~{human(nodes)} of graph nodes pinned){completed}:"
    ]
    for leak in leaks:
        r = leak.finding.retention
        lines.append(f"  {named(r)}: {_figures(r, leak.survived, ended)}; {_state(leak)}; fix: {r.fix}")
    return "\n".join(lines)


def render(
    figures: WatchFigures,
    history: Sequence[HolderHistory],
    bounded: Sequence[HolderHistory] = (),
    title: str = "gradguard watch",
) -> str:
    """The summary of a watch: what was checked, what was found, and a table of the leaking holders.

    It says plainly when nothing was checked, how much of the run an all-clear covers, and what is
    not explained (old graphs no holder was found for, memory growth after the last audit); it never
    says all is clear while either remains.
    """
    f = figures
    if not f.boundaries:
        return f"{title}: no optimizer step was seen: nothing was checked"
    share = f" ({100 * f.seconds / f.elapsed:.2f}% of the time since the first)" if f.elapsed > 0 and f.seconds else ""
    asked = f", {f.memory_audits} of them for memory growth" if f.memory_audits else ""
    head = f"{title}: {plural(f.boundaries, 'step boundary')}, {f.audits} audited{asked}{share}"
    if not f.audits:
        return f"{head}: no audit ran, nothing was checked{_clause(f.memory)}"
    leaks = [e for e in history if e.outcome != BOUNDED]
    tail = _unexplained(f) + _bounded(bounded) + _clause(f.memory)
    if not leaks:
        followed = (
            f" (between audits, {plural(f.stamped, 'graph node')} stamped at backwards and audits were followed)"
            if f.stamped
            else ""
        )
        if f.unexplained:
            return f"{head}; no holder was found keeping a graph{followed}{tail}"
        return f"{head}; no autograd graph outlived two step boundaries{followed}{tail}"
    total = sum(e.pinned_bytes for e in leaks)
    nodes = sum(e.node_bytes for e in leaks)
    released = sum(e.released_bytes for e in leaks)
    if released:
        tail = f"; the repairs gave back {human(released)} of memory (measured){tail}"
    rows = [
        (
            display(e.path),
            str(e.tensors),
            human(e.pinned_bytes),
            nodes_text(e.nodes, e.node_bytes),
            str(e.survived),
            f"{e.outcome} ({human(e.released_bytes)} back)" if e.released_bytes else e.outcome,
            display(e.fix),
        )
        for e in leaks
    ]
    header = ("holder", "tensors", "pinned", "nodes", "steps survived", "outcome", "fix")
    return (
        f"{head}; {plural(len(leaks), 'holder')} kept autograd graphs across step boundaries "
        f"({human(total)} of tensors and ~{human(nodes)} of graph nodes pinned at their last audit){tail}:\n"
        f"{_table.text(header, rows)}"
    )


def _clause(text: str) -> str:
    return f"; {text}" if text else ""


def _unexplained(f: WatchFigures) -> str:
    if not f.unexplained:
        return ""
    return (
        f"; NOT EXPLAINED: {plural(f.unexplained, 'graph')} older than two step boundaries "
        f"{'is' if f.unexplained == 1 else 'are'} alive that no holder was found for (garbage not collected "
        "yet, a graph node held directly, or C++ code)"
    )


def _bounded(entries: Sequence[HolderHistory]) -> str:
    if not entries:
        return ""
    shown = ", ".join(f"{display(e.path)} ({human(e.pinned_bytes + e.node_bytes)})" for e in entries[:3])
    more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
    return f"; bounded, not acted on (one step's graph, replaced every step): {shown}{more}"
