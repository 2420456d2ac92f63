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

from collections.abc import Sequence
from typing import Any

from .._policy.message import display

__all__ = ["combined", "idle_text", "labels", "missing_ranks", "not_reached", "plural", "unreported"]

_LISTED = 3  # processes of one kind named one by one; beyond that they are counted

UNREACHABLE = (
    "a process reports once it imports torch; one started with python -I, -E or -S (which ignore PYTHONPATH "
    "or site), or whose environment drops PYTHONPATH, is out of the bootstrap's reach"
)


def plural(n: int, word: str) -> str:
    """``1 process``, ``2 processes``, ``3 step boundaries``, ``4 multiprocessing children``."""
    if n == 1:
        return f"{n} {word}"
    if word.endswith("y"):
        return f"{n} {word[:-1]}ies"
    if word.endswith("child"):
        return f"{n} {word}ren"
    return f"{n} {word}es" if word.endswith("ss") else f"{n} {word}s"


# --------------------------------------------------------------------------------------------------
# One entry per process
# --------------------------------------------------------------------------------------------------


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    if r.get("started") is None:
        return (id(r),)  # no start time: a pid alone could be a later process's
    return (r["host"], r["pid"], r["started"])


def combined(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``reports`` with those of one process (the programs it ran through ``exec``) merged into one: the
    latest program's identity, the counts added up, every holder, ``top`` if any program was."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in reports:
        groups.setdefault(_key(r), []).append(r)
    result = []
    for group in groups.values():
        if len(group) == 1:
            result.append(group[0])
            continue
        group = sorted(group, key=lambda r: r["written"])
        one = dict(group[-1])
        for name in ("boundaries", "audits", "memory_audits"):
            one[name] = sum(r[name] for r in group)
        for name in ("audit_seconds", "read_seconds"):
            one[name] = sum(r[name] for r in group)
        holders: dict[str, dict[str, Any]] = {}
        for r in group:
            holders.update((h["holder"], h) for h in r["holders"])
        one["holders"] = list(holders.values())
        one["stats"] = [row for r in group for row in r["stats"]]
        one["top"] = any(r["top"] for r in group)
        one["error"] = "; ".join(dict.fromkeys(r["error"] for r in group if r["error"])) or None
        one["every"] = next((r["every"] for r in reversed(group) if r["every"] is not None), None)
        one["memory"] = next((r["memory"] for r in reversed(group) if r["memory"]), "")
        if sum(1 for r in group if r["boundaries"]) > 1:
            one["summary"] = ""  # each program's watch saw a part: the summary of the whole is the merge's
        result.append(one)
    return result


def labels(reports: Sequence[dict[str, Any]]) -> list[str]:
    """One label per report, unique: the rank or actor, and the pid (and host) where they would repeat."""
    hosts = {r["host"] for r in reports}
    base = [str(r.get("label") or f"pid {r['pid']}") for r in reports]
    base = [f"{b} (the command)" if r["top"] and b.startswith("pid ") else b for r, b in zip(reports, base)]
    found = []
    for r, label in zip(reports, base):
        if base.count(label) > 1 and not label.startswith("pid "):
            label = f"{label} (pid {r['pid']})"
        if len(hosts) > 1:
            label = f"{label} on {r['host']}"
        found.append(label)
    return found


# --------------------------------------------------------------------------------------------------
# The processes that ran no optimizer step
# --------------------------------------------------------------------------------------------------


def _kind(r: dict[str, Any]) -> str:
    return r["role"] or "other process"


def _named(r: dict[str, Any]) -> bool:
    return bool(r["top"]) or r.get("rank") is not None or r.get("actor") is not None


def idle_text(idle: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """``pid 100 (the command), rank 3/4, 12 multiprocessing children``: the processes that ran no
    optimizer step, the named ones (the command, a rank, an actor) by name, the rest by kind, one by
    one only while there are few."""
    named = [label for label, r in idle if _named(r)]
    rest = [(label, r) for label, r in idle if not _named(r)]
    if len(rest) <= _LISTED:
        return ", ".join(named + [label for label, _ in rest])
    kinds: dict[str, int] = {}
    for _, r in rest:
        kinds[_kind(r)] = kinds.get(_kind(r), 0) + 1
    counted = [plural(n, kind) for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0]))]
    if len(named) > _LISTED:
        named = [*named[:_LISTED], f"{len(named) - _LISTED} more named"]
    return ", ".join(named + counted)


# --------------------------------------------------------------------------------------------------
# What is known of the processes that did not report
# --------------------------------------------------------------------------------------------------


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {','.join(map(str, ranks))}"


def missing_ranks(processes: Sequence[dict[str, Any]], prog: str) -> list[str]:
    """A line per world some of whose ranks reported and others did not. A rank that is itself the command
    of its run (``torchrun ... -m gradguard run``: one run per rank) has the other ranks in runs of their
    own: nothing is said of them."""
    worlds: dict[int, set[int]] = {}
    for r in processes:
        if r.get("rank") is not None and r.get("world_size") and not r["top"]:
            worlds.setdefault(int(r["world_size"]), set()).add(int(r["rank"]))
    lines = []
    for world, ranks in sorted(worlds.items()):
        missing = [i for i in range(world) if i not in ranks]
        if missing:
            lines.append(
                f"{prog}: no report from {_ranks_text(missing)} of {world}: not checked in this run ({UNREACHABLE}; "
                "on several nodes, each node's reports must reach this folder)"
            )
    return lines


def not_reached(unset: Sequence[dict[str, Any]], nested: Sequence[dict[str, Any]], prog: str) -> list[str]:
    """A line per process the bootstrap could not set gradguard up in, and per nested ``gradguard run``."""
    lines = []
    for r in unset:
        who = f"pid {r['pid']} (the command)" if r["top"] else f"pid {r['pid']}"
        lines.append(
            f"{prog}: {who} imported torch, but gradguard could not be set up in it: "
            f"{display(str(r['error']))} (its Python: {display(r['executable'])}; gradguard must be installed "
            "for every interpreter the command runs): not checked"
        )
    for r in nested:
        who = f"pid {r['pid']} (the command)" if r["top"] else f"pid {r['pid']}"
        outcome = (
            f"{plural(r['reached'], 'process')} reported to it"
            + ("" if r["checked"] else ", nothing was checked")
            + (", a leak was found in raise mode" if r["raised"] else "")
            + f", exit status {r['code']}"
        )
        lines.append(
            f"{prog}: {who} is a gradguard run of its own: it watched its command and printed its own "
            f"summary ({outcome}); its reports are in {display(r['folder'])}"
        )
    return lines


def unreported(folder: str, hint: str | None, prog: str) -> str:
    """The summary of a run no process reported to (and with no line above saying why)."""
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
