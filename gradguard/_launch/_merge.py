"""The reports of one run merged into one summary: what ``gradguard run`` prints at the end, and
``gradguard report DIR`` for the processes it did not start.

The summary says what was checked, and never more:

* no report at all: no process of the command imported torch, so nothing was checked;
* reports, but no optimizer step in any process: nothing was checked (never "clean");
* steps but no audited boundary: nothing was checked either (``every`` larger than the steps run, or
  ``auto`` whose memory trigger never asked for an audit: what it watched is said);
* otherwise, per holder: the processes that had it (their ranks, actors or pids), the steps it
  survived (the most), the bytes it pinned at the last audit (the most in one process, and the sum
  over processes), what was done and the fix; and per process its boundaries and audits.

A run of one process prints what ``gradguard run`` always printed for one: the stats table, then
``gradguard watch: N step boundaries, M audited...`` and the holder table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .._policy import table as _table
from .._policy.message import display, human
from .._policy.stats import SiteStats, Stats
from .._watch.audit import nodes_text

__all__ = ["Merged", "merge"]


@dataclasses.dataclass(frozen=True)
class Merged:
    """``text``: the summary; ``raised``: a process found a leak in ``raise`` mode; ``reached``: how many
    processes reported; ``checked``: whether any boundary was audited."""

    text: str
    raised: bool
    reached: int
    checked: bool


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    if word.endswith("y"):
        return f"{n} {word[:-1]}ies"
    return f"{n} {word}es" if word.endswith("ss") else f"{n} {word}s"


def _labels(reports: Sequence[dict[str, Any]]) -> list[str]:
    """One label per report, unique: the rank or actor, and the pid (and host) where they would repeat."""
    hosts = {r.get("host") for r in reports}
    base = [str(r.get("label") or f"pid {r.get('pid')}") for r in reports]
    base = [f"{b} (the command)" if r.get("top") and b.startswith("pid ") else b for r, b in zip(reports, base)]
    labels = []
    for r, label in zip(reports, base):
        if base.count(label) > 1 and not label.startswith("pid "):
            label = f"{label} (pid {r.get('pid')})"
        if len(hosts) > 1:
            label = f"{label} on {r.get('host')}"
        labels.append(label)
    return labels


def _who(labels: list[str], reports: list[dict[str, Any]]) -> str:
    """``ranks 0-3 of 4``, ``actor Trainer``, ``pid 11, pid 12``: the processes that had one holder."""
    ranked: dict[int | None, list[int]] = {}
    others = []
    for label, r in zip(labels, reports):
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
        for entry in r.get("stats") or []:
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


def _holder_rows(reports: list[dict[str, Any]], labels: list[str]) -> list[dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for label, r in zip(labels, reports):
        for h in r.get("holders") or []:
            m = merged.setdefault(
                h["holder"],
                {"holder": h["holder"], "path": h["path"], "fix": h["fix"], "reports": [], "labels": [], "pinned": []},
            )
            m["reports"].append(r)
            m["labels"].append(label)
            m["pinned"].append(int(h["pinned_bytes"]))
            m["nodes"] = max(m.get("nodes", 0), int(h.get("nodes", 0)))
            m["node_bytes"] = max(m.get("node_bytes", 0), int(h.get("node_bytes", 0)))
            m["tensors"] = max(m.get("tensors", 0), int(h["tensors"]))
            m["survived"] = max(m.get("survived", 0), int(h["survived"]))
            m.setdefault("outcomes", []).append(h["outcome"])
    rows = list(merged.values())
    rows.sort(key=lambda m: (-sum(m["pinned"]), m["holder"]))
    return rows


def merge(reports: Sequence[dict[str, Any]], problems: Sequence[str] = (), folder: str = "") -> Merged:
    """One summary of ``reports`` (``problems``: a line for each report file that could not be read)."""
    reports = sorted(reports, key=_order)
    lines = [f"gradguard: {display(p)}" for p in problems]
    for r, label in zip(reports, _labels(reports)):
        if r.get("error"):
            lines.append(f"gradguard: {label}: {display(str(r['error']))}")
    raised = any(h.get("outcome") == "raised" for r in reports for h in r.get("holders") or [])
    if not reports:
        where = f" (no report in {folder})" if folder else ""
        lines.append(f"gradguard run: no process of the command imported torch{where}: nothing was checked")
        return Merged("\n".join(lines), raised, 0, False)
    lines.append(_stats(reports))
    watching = [r for r in reports if r.get("every") is not None]
    checked = any(r.get("audits", 0) > 0 for r in watching)
    if watching:
        lines.append(_watch(watching))
    return Merged("\n".join(lines), raised, len(reports), checked)


def _order(r: dict[str, Any]) -> tuple[Any, ...]:
    return (
        not r.get("top"),
        r.get("rank") is None,
        r.get("rank") if r.get("rank") is not None else 0,
        str(r.get("actor") or ""),
        r.get("host") or "",
        r.get("pid") or 0,
    )


def _watch(reports: list[dict[str, Any]]) -> str:
    labels = _labels(reports)
    boundaries = sum(int(r.get("boundaries", 0)) for r in reports)
    audits = sum(int(r.get("audits", 0)) for r in reports)
    memory_audits = sum(int(r.get("memory_audits", 0)) for r in reports)
    seconds = sum(float(r.get("audit_seconds", 0.0)) for r in reports)
    first = reports[0]
    # one process: the command itself reads as gradguard run always printed, unless it has a rank or is an actor
    many = len(reports) > 1 or not first.get("top") or first.get("rank") is not None or first.get("actor") is not None
    asked = f", {memory_audits} of them for memory growth" if memory_audits else ""
    head = f"gradguard watch: {_plural(boundaries, 'step boundary')}, {audits} audited{asked}"
    if many:
        head += f", in {_plural(len(reports), 'process')}"
    head += _audit_time(seconds)
    stepped = [(label, r) for label, r in zip(labels, reports) if r.get("boundaries", 0) > 0]
    idle = [label for label, r in zip(labels, reports) if not r.get("boundaries", 0)]
    parts = []
    if not boundaries:
        if many:
            return f"{head}; nothing was checked: no process ran an optimizer step ({', '.join(idle)} imported torch)"
        return f"{head}; nothing was checked: no optimizer step ran"
    if many:
        table = _table.text(
            ("process", "boundaries", "audited", "leaking holders", "report written"),
            [
                (
                    label,
                    str(r.get("boundaries", 0)),
                    str(r.get("audits", 0)),
                    str(len(r.get("holders") or [])),
                    "at exit" if r.get("at_exit") else "at its last audit (no exit handler ran)",
                )
                for label, r in stepped
            ],
        )
        parts.append(table)
        if idle:
            parts.append(
                f"(and {_plural(len(idle), 'process')} that imported torch but ran no optimizer step: "
                f"{', '.join(idle)})"
            )
    unaudited = [label for label, r in stepped if not r.get("audits", 0)]
    watched = sorted({str(r["memory"]) for _, r in stepped if r.get("memory")})  # what each memory trigger saw
    memory = "".join(watched) if len(watched) == 1 else ""
    if not audits:
        everies = sorted({str(r.get("every")) for _, r in stepped})
        why = "no audit ran" if "auto" in everies else f"every={'/'.join(everies)} is more than the steps run"
        verdict = f"nothing was checked: no step boundary was audited ({why}){memory}"
        return "\n".join([f"{head}; {verdict}", *parts])
    rows = _holder_rows(reports, labels)
    if not rows:
        covered = "the audited boundary" if audits == 1 else f"the {audits} audited boundaries"
        verdict = f"at {covered}, no autograd graph had outlived a step boundary"
        if boundaries > audits:
            verdict += f"; {boundaries - audits} were not audited"
        if unaudited:
            verdict += f"; not audited, so not checked: {', '.join(unaudited)}"
        return "\n".join([f"{head}; {verdict}{memory}", *parts])
    total = sum(sum(m["pinned"]) for m in rows)
    nodes = sum(m["node_bytes"] for m in rows)
    holders_in = {label for m in rows for label in m["labels"]}
    where = f" in {_plural(len(holders_in), 'process')}" if many else ""
    verdict = (
        f"{_plural(len(rows), 'holder')} kept autograd graphs across step boundaries{where} "
        f"({human(total)} of tensors and ~{human(nodes)} of graph nodes pinned at their last audit):"
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
                nodes_text(m["nodes"], m["node_bytes"]),
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
                nodes_text(m["nodes"], m["node_bytes"]),
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
