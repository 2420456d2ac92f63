"""The reports of one run merged into one summary: what ``gradguard run`` prints at the end, and
``gradguard report DIR`` for the processes it did not start.

The summary says what was checked, and never more:

* a report file that could not be used is named, with what is wrong, and its process is not covered;
* a process that imported torch but could not be set up (an interpreter without gradguard), or a
  nested ``gradguard run`` that watched its own command, is said as such (:mod:`._processes`);
* no report at all: nothing was checked, and why that can be (no process imported torch, or the ones
  that did were out of the bootstrap's reach), never that no process imported torch;
* reports, but no optimizer step in any process: nothing was checked (never "clean"); the watch off
  in every process (``--audit-every 0``) is said as such;
* steps but no audited boundary: nothing was checked either (``every`` larger than the steps run, or
  ``auto`` whose memory trigger never asked for an audit: what it watched is said);
* otherwise, per holder: the processes that had it (their ranks, actors or pids), the steps it
  survived (the most), the bytes it pinned at the last audit (the most in one process, and the sum
  over processes), what was done and the fix; and per process its boundaries and audits, and whether
  its report is from its exit or from its last audit (a process killed, or ended by ``os._exit``).
  A holder the watch judged bounded (one step's graph, replaced at every step) is listed, never
  counted as a leak; a process whose watch saw old graphs it found no holder for is named, and the
  summary is then no all-clear.

A run of one process prints what its watch says (:meth:`gradguard.Watcher.summary`, written into its
report by the process itself), after the stats table. Every report reaching here was checked field by
field (:mod:`._read`). Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .._policy import table as _table
from .._policy.message import display, human
from .._policy.stats import SiteStats, Stats
from ._processes import combined, idle_text, labels, missing_ranks, not_reached, plural, unreported

__all__ = ["Merged", "merge"]


class Merged(NamedTuple):
    """``text``: the summary; ``raised``: a process (or a nested run) found a leak in ``raise`` mode;
    ``reached``: how many processes reported; ``checked``: whether any boundary was audited."""

    text: str
    raised: bool
    reached: int
    checked: bool


def _nodes(nodes: int, node_bytes: int) -> str:
    """``7 (~4.8 KiB)``: a holder's graph nodes, as the watch's own tables show them."""
    if not nodes:
        return "0"
    return f"{nodes} (~{human(node_bytes)})" if node_bytes else f"{nodes} (shared)"


def _who(names: list[str], reports: list[dict[str, Any]]) -> str:
    """``ranks 0-3 of 4``, ``actor Trainer``, ``pid 11, pid 12``: the processes that had one holder."""
    ranked: dict[int | None, list[int]] = {}
    others = []
    for label, r in zip(names, reports):
        if r.get("rank") is not None and r.get("actor") is None:  # the table below says which pid and host
            ranked.setdefault(r.get("world_size"), []).append(int(r["rank"]))
        else:
            others.append(label)
    parts = []
    for world, ranks in ranked.items():
        ranks = sorted(set(ranks))
        of = "" if world is None else f" of {world}"
        if len(ranks) == 1:
            parts.append(f"rank {ranks[0]}{of}")
        elif ranks == list(range(ranks[0], ranks[-1] + 1)):
            parts.append(f"ranks {ranks[0]}-{ranks[-1]}{of}")
        else:
            parts.append(f"ranks {','.join(map(str, ranks))}{of}")
    return ", ".join(parts + others)


def _stats(reports: Sequence[dict[str, Any]]) -> str:
    rows: dict[tuple[str, str], SiteStats] = {}
    for r in reports:
        for entry in r["stats"]:
            key = (entry["store"], entry["site"])
            row = rows.setdefault(key, SiteStats(entry["store"], entry["site"]))
            row.records += entry["records"]
            row.tensors_detached += entry["tensors_detached"]
            row.pinned_bytes_per_record = max(row.pinned_bytes_per_record, entry["pinned_bytes_per_record"])
            row.pinned_bytes_released += entry["pinned_bytes_released"]
    if not rows:
        return "gradguard stats: no guarded store saw a record"
    return f"gradguard stats:\n{Stats(rows)}"


def _audit_time(seconds: float) -> str:
    return f" (the audits took {seconds:.2f} s)" if seconds >= 0.005 else ""


def _holder_rows(reports: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for label, r in zip(names, reports):
        for h in r["holders"]:
            m = merged.setdefault(
                h["holder"],
                {"holder": h["holder"], "path": h["path"], "fix": h["fix"], "reports": [], "labels": [], "pinned": []},
            )
            m["reports"].append(r)
            m["labels"].append(label)
            m["pinned"].append(h["pinned_bytes"])
            m["nodes"] = max(m.get("nodes", 0), h["nodes"])
            m["node_bytes"] = max(m.get("node_bytes", 0), h["node_bytes"])
            m["tensors"] = max(m.get("tensors", 0), h["tensors"])
            m["survived"] = max(m.get("survived", 0), h["survived"])
            m.setdefault("outcomes", []).append(h["outcome"])
    rows = list(merged.values())
    rows.sort(key=lambda m: (-sum(m["pinned"]), m["holder"]))
    return rows


def merge(
    reports: Sequence[dict[str, Any]],
    problems: Sequence[str] = (),
    folder: str = "",
    *,
    hint: str | None = None,
    prog: str = "gradguard run",
) -> Merged:
    """One summary of ``reports`` (each checked by :func:`gradguard._launch._read.check`).

    Args:
        reports: the run's reports, of every kind.
        problems: a line for each report file that could not be used.
        folder: the run folder, named when nothing reported.
        hint: what the launcher knows of a process it cannot reach (the command's own Python started
            with ``-I``), said when nothing reported.
        prog: the command whose lines these are (``gradguard run``, ``gradguard report``).

    Returns:
        The summary and its outcome.
    """
    processes = sorted(combined([r for r in reports if r["kind"] == "process"]), key=_order)
    unset = [r for r in reports if r["kind"] == "not-set-up"]
    nested = [r for r in reports if r["kind"] == "nested-run"]
    lines = [f"gradguard: {display(p)}" for p in problems]
    for r, label in zip(processes, labels(processes)):
        if r["error"]:
            lines.append(f"gradguard: {label}: {display(str(r['error']))}")
    lines += not_reached(unset, nested, prog)
    raised = any(h["outcome"] == "raised" for r in processes for h in r["holders"]) or any(r["raised"] for r in nested)
    if not processes:
        if not (unset or nested or problems):
            lines.append(unreported(folder, hint, prog))
        elif unset or problems:
            lines.append(f"{prog}: nothing was checked: no report of a process gradguard was set up in could be used")
        return Merged("\n".join(lines), raised, 0, any(r["checked"] for r in nested))
    lines.append(_stats(processes))
    watching = [r for r in processes if r["every"] is not None]
    checked = any(r["audits"] > 0 for r in watching) or any(r["checked"] for r in nested)
    if watching:
        lines.append(_watch(watching, uncovered=len(problems) + len(unset)))
    else:  # said, so that a run with the watch off never reads as one the watch found clean
        lines.append("gradguard watch: off (audit 0) in every process: no step boundary was checked")
    lines += missing_ranks(processes, prog)
    return Merged("\n".join(lines), raised, len(processes), checked)


def _order(r: dict[str, Any]) -> tuple[Any, ...]:
    return (
        not r["top"],
        r.get("rank") is None,
        r.get("rank") if r.get("rank") is not None else 0,
        str(r.get("actor") or ""),
        r["host"],
        r["pid"],
    )


_BOUNDED = "bounded"  # the watch's outcome for a holder whose graph is replaced at every step: never a leak


def _clause(text: str) -> str:
    return f"; {text.lstrip('; ')}" if text else ""


def _written(r: dict[str, Any]) -> str:
    return "at exit" if r["at_exit"] else "at its last audit (no exit handler ran)"


_KILLED = (
    "(the command's report is from its last audit: it ended without running its exit handlers (killed by a "
    "signal, os._exit, or a crash), so what it did after that audit was not checked)"
)


def _watch(reports: list[dict[str, Any]], uncovered: int) -> str:
    names = labels(reports)
    boundaries = sum(r["boundaries"] for r in reports)
    audits = sum(r["audits"] for r in reports)
    memory_audits = sum(r["memory_audits"] for r in reports)
    seconds = sum(r["audit_seconds"] for r in reports)
    first = reports[0]
    # one process: the command itself reads as gradguard run always printed, unless it has a rank or is an actor
    many = len(reports) > 1 or not first["top"] or first.get("rank") is not None or first.get("actor") is not None
    asked = f", {memory_audits} of them for memory growth" if memory_audits else ""
    head = f"gradguard watch: {plural(boundaries, 'step boundary')}, {audits} audited{asked}"
    if many:
        head += f", in {plural(len(reports), 'process')}"
    head += _audit_time(seconds)
    stepped = [(label, r) for label, r in zip(names, reports) if r["boundaries"] > 0]
    idle = [(label, r) for label, r in zip(names, reports) if not r["boundaries"]]
    not_covered = f"; {plural(uncovered, 'process')} not covered (above)" if uncovered else ""
    parts = []
    if not many and first["summary"]:  # one process: its watch's own words
        killed = [] if first["at_exit"] else [_KILLED]
        uncounted = [f"({plural(uncovered, 'other process')} not covered: above)"] if uncovered else []
        return "\n".join([first["summary"], *killed, *uncounted])
    if not boundaries:
        if many:
            return (
                f"{head}; nothing was checked: no process ran an optimizer step ({idle_text(idle)} imported "
                f"torch){not_covered}"
            )
        return f"{head}; nothing was checked: no optimizer step ran{not_covered}"
    if many:
        table = _table.text(
            ("process", "boundaries", "audited", "leaking holders", "report written"),
            [
                (label, str(r["boundaries"]), str(r["audits"]), str(len(r["holders"])), _written(r))
                for label, r in stepped
            ],
        )
        parts.append(table)
        if idle:
            parts.append(f"(and {plural(len(idle), 'process')} that imported torch but ran no optimizer step: "
                         f"{idle_text(idle)})")  # fmt: skip
    elif not first["at_exit"]:
        parts.append(_KILLED)
    unaudited = [label for label, r in stepped if not r["audits"]]
    watched = sorted({str(r["memory"]) for _, r in stepped if r["memory"]})  # what each memory trigger saw
    memory = _clause(watched[0]) if len(watched) == 1 else ""
    unexplained = [label for label, r in stepped if r["unexplained"]]
    if unexplained:
        memory += (
            f"; NOT EXPLAINED in {', '.join(unexplained)}: graphs older than two step boundaries were alive that no "
            "holder was found for (each process's own summary: its report's 'summary')"
        )
    if not audits:
        everies = sorted({str(r["every"]) for _, r in stepped})
        why = "no audit ran" if "auto" in everies else f"every={'/'.join(everies)} is more than the steps run"
        verdict = f"nothing was checked: no step boundary was audited ({why}){memory}{not_covered}"
        return "\n".join([f"{head}; {verdict}", *parts])
    rows = _holder_rows(reports, names)
    bounded = [m for m in rows if set(m["outcomes"]) == {_BOUNDED}]
    rows = [m for m in rows if m not in bounded]
    if bounded:
        shown = ", ".join(f"{display(m['holder'])} ({human(max(m['pinned']) + m['node_bytes'])})" for m in bounded[:3])
        more = f" and {len(bounded) - 3} more" if len(bounded) > 3 else ""
        memory = f"; bounded, not acted on (one step's graph, replaced every step): {shown}{more}" + memory
    if not rows:
        covered = "the audited boundary" if audits == 1 else f"the {audits} audited boundaries"
        verdict = f"at {covered}, no process found a holder keeping an autograd graph across step boundaries"
        if unaudited:
            verdict += f"; not audited, so not checked: {', '.join(unaudited)}"
        return "\n".join([f"{head}; {verdict}{memory}{not_covered}", *parts])
    total = sum(sum(m["pinned"]) for m in rows)
    nodes = sum(m["node_bytes"] for m in rows)
    holders_in = {label for m in rows for label in m["labels"]}
    where = f" in {plural(len(holders_in), 'process')}" if many else ""
    verdict = (
        f"{plural(len(rows), 'holder')} kept autograd graphs across step boundaries{where} "
        f"({human(total)} of tensors and ~{human(nodes)} of graph nodes pinned at their last audit){not_covered}:"
    )
    if many:
        header: tuple[str, ...] = (
            "holder",
            "processes",
            "tensors",
            "pinned (max)",
            "pinned (sum)",
            "nodes",
            "steps survived",
            "outcome",
            "fix",
        )
        body: list[tuple[str, ...]] = [
            (
                display(m["path"] if len(m["labels"]) == 1 else m["holder"]),
                _who(m["labels"], m["reports"]),
                str(m["tensors"]),
                human(max(m["pinned"])),
                human(sum(m["pinned"])),
                _nodes(m["nodes"], m["node_bytes"]),
                str(m["survived"]),
                ", ".join(sorted(set(m["outcomes"]))),
                display(m["fix"]),
            )
            for m in rows
        ]
    else:
        header = ("holder", "tensors", "pinned", "nodes", "steps survived", "outcome", "fix")
        body = [
            (
                display(m["path"]),
                str(m["tensors"]),
                human(m["pinned"][0]),
                _nodes(m["nodes"], m["node_bytes"]),
                str(m["survived"]),
                m["outcomes"][0],
                display(m["fix"]),
            )
            for m in rows
        ]
    text = f"{head}; {verdict}\n{_table.text(header, body)}"
    if unaudited:
        text += f"\n(not audited, so not checked: {', '.join(unaudited)})"
    return "\n".join([text, *parts])
