"""The watch's warnings and errors for one leaking holder, and the error naming every holder of an audit."""

from __future__ import annotations

from collections.abc import Sequence

from .._policy.message import display, fix_lines, human, nodes_text, plural, wrap
from .audit import Retention
from .criterion import Leak
from .repair import LIVE, PARTLY, Repair

__all__ = ["IDLE", "MICRO", "named", "raise_message", "unrepaired_message", "warn_message"]

MICRO = " across the micro-batches of one step"
"""What a leak found at a micro-batch boundary is kept across, for the messages (as ``ended``)."""

IDLE = " that grew while no backward ran and no optimizer stepped (no backward ever used it)"
"""What a leak the idle looks found kept its graphs through, for the messages (as ``ended``)."""


_RAISED = "gradguard.GraphRetentionError: "
"""What a traceback writes before the error's first line."""


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


def _lines(leak: Leak, ended: str, what: str, indent: str) -> list[str]:
    """A holder's figures, ``what`` (its graphs' state, or why it was not repaired) and its fix, each
    starting a line under ``indent``."""
    r = leak.finding.retention
    more = indent + "  "
    return [
        *wrap(_figures(r, leak.survived, ended), indent, more),
        *wrap(what, indent, more),
        *fix_lines(r.fix, indent),
    ]


def _head(r: Retention, ended: str) -> list[str]:
    """``gradguard: <holder>`` alone on the first line (Python writes the warning's file, line and category
    before it), then what it keeps its graphs across."""
    name = display(named(r))
    return [*wrap(f"gradguard: {name}", keep=[name]), *wrap(f"keeps an autograd graph{_across(ended)}", "  ", "    ")]


def warn_message(leak: Leak, ended: str = "") -> str:
    """The warning for one leaking holder.

    Args:
        leak: The holder and its graphs, as the criterion judged them.
        ended: What ended, for a leak found at the end of a scope (`` across the end of test x``); ``""``
            for one found at a step boundary.

    Returns:
        Lines within :data:`~gradguard._policy.message.WIDTH` columns where the holder's path allows: the
        holder, then (indented) what it keeps its graphs across, what they pin, whether they can still be
        backwarded, and the fix.
    """
    r = leak.finding.retention
    return "\n".join([*_head(r, ended), *_lines(leak, ended, _state(leak), "  ")])


def unrepaired_message(leak: Leak, done: Repair, ended: str = "") -> str:
    """The warning for a holder ``detach`` mode left alone, in part or whole.

    Args:
        leak: The holder and its graphs.
        done: What the repair did, and why it did not release everything.
        ended: As for :func:`warn_message`.

    Returns:
        As :func:`warn_message`, saying why it was not (fully) repaired instead of its graphs' state.
    """
    r = leak.finding.retention
    if done.outcome == LIVE:
        what = "still usable for backward: not repaired (detaching it could change a gradient)"
    elif done.outcome == PARTLY:
        what = f"repaired in part: {done.released} of {len(leak.leaking)} tensors released; the rest: {done.why}"
    else:
        what = f"cannot be repaired in place: it is held through {done.why}"
    return "\n".join([*_head(r, ended), *_lines(leak, ended, what, "  ")])


def raise_message(leaks: Sequence[Leak], ended: str = "") -> str:
    """The :class:`GraphRetentionError` text naming every leaking holder.

    Args:
        leaks: The holders one audit found leaking.
        ended: As for :func:`warn_message`.

    Returns:
        A paragraph on all of them, then each holder starting a line with what its graphs pin, followed
        (indented) by their state and its fix.
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
    lines = wrap(
        f"gradguard: {plural(len(leaks), 'holder')} {'keeps' if len(leaks) == 1 else 'keep'} autograd graphs"
        f"{_across(ended)} ({human(total)} of tensors and ~{human(nodes)} of graph nodes pinned){completed}:",
        " " * len(_RAISED),  # the room Python's traceback takes before the first line
        "  ",  # every line after the traceback's own is indented: a log reader takes the block as one message
    )
    lines[0] = lines[0].lstrip()
    for leak in leaks:
        r = leak.finding.retention
        name = display(named(r))
        lines += wrap(f"{name}: {_figures(r, leak.survived, ended)}", "  ", "    ", keep=[name])
        lines += [*wrap(_state(leak), "    ", "      "), *fix_lines(r.fix, "    ")]
    return "\n".join(lines)
