"""The watch's warnings and errors for one leaking holder, and the error naming every holder of an audit."""

from __future__ import annotations

from collections.abc import Sequence

from .._policy.message import human, nodes_text, plural
from .audit import Retention
from .criterion import Leak
from .repair import LIVE, PARTLY, Repair

__all__ = ["MICRO", "named", "raise_message", "unrepaired_message", "warn_message"]

MICRO = " across the micro-batches of one step"
"""What a leak found at a micro-batch boundary is kept across, for the messages (as ``ended``)."""


def named(r: Retention) -> str:
    """The holder as a message names it.

    Args:
        r: What the audit found of one holder.

    Returns:
        The path of its one tensor, or the holder (``[*]`` for the indices) of several.
    """
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
    if ended == MICRO:
        each = (r.pinned_bytes + r.node_bytes) // max(1, r.tensors)
        return f"{pinned}, one more at each micro-batch (~{human(each)} each)"
    return pinned if ended else f"{pinned}, alive for {plural(survived, 'step boundary')}"


def _across(ended: str) -> str:
    return ended or " across step boundaries"


def warn_message(leak: Leak, ended: str = "") -> str:
    """The warning for one leaking holder.

    Args:
        leak: The holder and its graphs, as the criterion judged them.
        ended: What ended, for a leak found at the end of a scope (`` across the end of test x``); ``""``
            for one found at a step boundary.

    Returns:
        One line: the holder, what its graphs pin, whether they can still be backwarded, and the fix.
    """
    r = leak.finding.retention
    return (
        f"gradguard: {named(r)} keeps an autograd graph{_across(ended)} ({_figures(r, leak.survived, ended)}; "
        f"{_state(leak)}); fix: {r.fix}"
    )


def unrepaired_message(leak: Leak, done: Repair, ended: str = "") -> str:
    """The warning for a holder ``detach`` mode left alone, in part or whole.

    Args:
        leak: The holder and its graphs.
        done: What the repair did, and why it did not release everything.
        ended: As for :func:`warn_message`.

    Returns:
        One line: the holder, what its graphs pin, why it was not (fully) repaired, and the fix.
    """
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
    """The :class:`GraphRetentionError` text naming every leaking holder.

    Args:
        leaks: The holders one audit found leaking.
        ended: As for :func:`warn_message`.

    Returns:
        A line on all of them, then one line per holder with its fix.
    """
    total = sum(leak.finding.retention.pinned_bytes for leak in leaks)
    nodes = sum(leak.finding.retention.node_bytes for leak in leaks)
    completed = (
        "; the backward itself completed"
        if ended == MICRO
        else ""
        if ended
        else "; the optimizer step itself completed"
    )
    lines = [
        f"gradguard: {plural(len(leaks), 'holder')} {'keeps' if len(leaks) == 1 else 'keep'} autograd graphs"
        f"{_across(ended)} ({human(total)} of tensors and ~{human(nodes)} of graph nodes pinned){completed}:"
    ]
    for leak in leaks:
        r = leak.finding.retention
        lines.append(f"  {named(r)}: {_figures(r, leak.survived, ended)}; {_state(leak)}; fix: {r.fix}")
    return "\n".join(lines)
