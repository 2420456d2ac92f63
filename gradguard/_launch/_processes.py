"""The processes of a run as its summary names them: one entry per process, a label each, the ones that
trained apart from the ones that only imported torch, and what is known of the ones that did not report.

* The programs one process ran (``os.execv``: the same pid and start time) are one process.
* A process is named by its rank, its Ray actor, else its pid; the command ``gradguard run`` started is
  ``(the command)``.
* Processes that imported torch but never stepped an optimizer (DataLoader workers, pool helpers, Ray's
  idle workers) are one short line: named where they have a rank or are the command, counted by kind
  otherwise, however many there are.
* What is known of a process that did not report is said, never more: a rank missing from its world,
  a process the bootstrap reached but could not set gradguard up in, a nested ``gradguard run``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Hashable, Sequence

from .._policy.message import display, plural
from ._report import NestedRun, NotSetUp, ProcessReport

__all__ = ["combined", "idle_text", "labels", "missing_ranks", "named", "not_reached", "ranks_text", "unreported"]

_LISTED = 3  # processes of one kind named one by one; beyond that they are counted

UNREACHABLE = (
    "a process reports once it imports torch; one started with python -I, -E or -S (which ignore PYTHONPATH "
    "or site), or whose environment drops PYTHONPATH, is out of the bootstrap's reach"
)


# --------------------------------------------------------------------------------------------------
# One entry per process
# --------------------------------------------------------------------------------------------------


def _key(r: ProcessReport) -> Hashable:
    if r.started is None:
        return id(r)  # no start time: a pid alone could be a later process's
    return (r.host, r.pid, r.started)


def combined(reports: Sequence[ProcessReport]) -> list[ProcessReport]:
    """The reports with those of one process (the programs it ran through ``exec``: the same pid and start
    time) merged into one.

    Args:
        reports: The run's process reports.

    Returns:
        One record per process: the latest program's identity, the figures added up, every holder (the
        latest program's record of each), ``top`` if any program was.
    """
    groups: dict[Hashable, list[ProcessReport]] = {}
    for r in reports:
        groups.setdefault(_key(r), []).append(r)
    result = []
    for group in groups.values():
        group = sorted(group, key=lambda r: r.written)
        last = group[-1]
        if len(group) > 1:
            holders = {h.holder: h for r in group for h in r.holders}
            last = dataclasses.replace(
                last,
                figures=functools.reduce(operator.add, [r.figures for r in group]),
                holders=tuple(holders.values()),
                stats=tuple(row for r in group for row in r.stats),
                top=any(r.top for r in group),
                error="; ".join(dict.fromkeys(r.error for r in group if r.error)) or None,
                every=next((r.every for r in reversed(group) if r.every is not None), None),
            )
        result.append(last)
    return result


def labels(reports: Sequence[ProcessReport]) -> list[str]:
    """How the summary names each process.

    Args:
        reports: The processes.

    Returns:
        One label per report, unique: the rank or actor, and the pid (and host) where they would repeat.
    """
    hosts = {r.host for r in reports}
    base = [r.label or f"pid {r.pid}" for r in reports]
    base = [f"{b} (the command)" if r.top and b.startswith("pid ") else b for r, b in zip(reports, base)]
    found = []
    for r, label in zip(reports, base):
        if base.count(label) > 1 and not label.startswith("pid "):
            label = f"{label} (pid {r.pid})"
        if len(hosts) > 1:
            label = f"{label} on {r.host}"
        found.append(label)
    return found


# --------------------------------------------------------------------------------------------------
# The processes that ran no optimizer step
# --------------------------------------------------------------------------------------------------


def _kind(r: ProcessReport) -> str:
    return r.role or "other process"


def named(r: ProcessReport) -> bool:
    """Whether a process is named, never counted by kind.

    Args:
        r: The process.

    Returns:
        ``True`` for the command, a rank, an actor.
    """
    return r.top or r.rank is not None or r.actor is not None


def idle_text(idle: Sequence[tuple[str, ProcessReport]]) -> str:
    """The processes that ran no optimizer step, in a few words.

    Args:
        idle: Each one's label and report.

    Returns:
        ``pid 100 (the command), rank 3/4, 12 multiprocessing children``: the named ones (the command, a
        rank, an actor) by name, the rest by kind, one by one only while there are few.
    """
    names = [label for label, r in idle if named(r)]
    rest = [(label, r) for label, r in idle if not named(r)]
    if len(rest) <= _LISTED:
        return ", ".join(names + [label for label, _ in rest])
    kinds: dict[str, int] = {}
    for _, r in rest:
        kinds[_kind(r)] = kinds.get(_kind(r), 0) + 1
    counted = [plural(n, kind) for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))]
    if len(names) > _LISTED:
        names = [*names[:_LISTED], f"{len(names) - _LISTED} more named"]
    return ", ".join(names + counted)


# --------------------------------------------------------------------------------------------------
# What is known of the processes that did not report
# --------------------------------------------------------------------------------------------------


def ranks_text(ranks: Sequence[int]) -> str:
    """Ranks, as a summary says them.

    Args:
        ranks: The ranks (in any order, repeats allowed).

    Returns:
        ``rank 3``, ``ranks 0-3``, ``ranks 0,2``.
    """
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {','.join(map(str, ranks))}"


def missing_ranks(processes: Sequence[ProcessReport], prog: str) -> list[str]:
    """What is known of the ranks that did not report.

    A rank that is itself the command of its run (``torchrun ... -m gradguard run``: one run per rank)
    has the other ranks in runs of their own: nothing is said of them.

    Args:
        processes: The processes that reported.
        prog: The command whose lines these are.

    Returns:
        A line per world some of whose ranks reported and others did not.
    """
    worlds: dict[int, set[int]] = {}
    for r in processes:
        if r.rank is not None and r.world_size and not r.top:
            worlds.setdefault(r.world_size, set()).add(r.rank)
    lines = []
    for world, ranks in sorted(worlds.items()):
        missing = [i for i in range(world) if i not in ranks]
        if missing:
            lines.append(
                f"{prog}: no report from {ranks_text(missing)} of {world}: not checked in this run ({UNREACHABLE}; "
                "on several nodes, each node's reports must reach this folder)"
            )
    return lines


def not_reached(unset: Sequence[NotSetUp], nested: Sequence[NestedRun], prog: str) -> list[str]:
    """What is known of the processes gradguard was not set up in.

    Args:
        unset: The processes the bootstrap reached but could not set gradguard up in.
        nested: The ``gradguard run`` commands started inside this run.
        prog: The command whose lines these are.

    Returns:
        A line per process not set up, and per nested run with its outcome.
    """
    lines = []
    for u in unset:
        who = f"pid {u.pid} (the command)" if u.top else f"pid {u.pid}"
        lines.append(
            f"{prog}: {who} imported torch, but gradguard could not be set up in it: "
            f"{display(str(u.error))} (its Python: {display(u.executable)}; gradguard must be installed "
            "for every interpreter the command runs): not checked"
        )
    for n in nested:
        who = f"pid {n.pid} (the command)" if n.top else f"pid {n.pid}"
        outcome = (
            f"{plural(n.reached, 'process')} reported to it"
            + ("" if n.checked else ", nothing was checked")
            + (", a leak was found in raise mode" if n.raised else "")
            + f", exit status {n.code}"
        )
        lines.append(
            f"{prog}: {who} is a gradguard run of its own: it watched its command and printed its own "
            f"summary ({outcome}); its reports are in {display(n.folder)}"
        )
    return lines


def unreported(folder: str, hint: str | None, prog: str) -> str:
    """The summary of a run no process reported to (and with no line above saying why).

    Args:
        folder: The run folder.
        hint: What the launcher knows of a process it cannot reach, or ``None``.
        prog: The command whose lines these are.

    Returns:
        One line: nothing was checked, and why that can be.
    """
    where = f" to {folder}" if folder else ""
    if hint:  # what the launcher knows: the command's own Python is out of reach
        return (
            f"{prog}: no process reported{where}: nothing was checked: {hint}; its child processes are checked "
            "only if they import torch and run without those flags"
        )
    return (
        f"{prog}: no process reported{where}: nothing was checked. Either none of the command's processes "
        f"imported torch, or the ones that did were not reached ({UNREACHABLE})"
    )
