"""The reports of one run merged into one summary: what ``gradguard run`` prints at the end, and
``gradguard report DIR`` for the processes it did not start.

The watch's part is the watch's own renderer (:func:`gradguard._watch.summary.summarize`) over the
records each process wrote, so one process reads as its :meth:`gradguard.Watcher.summary`; around it
come the lines only the run knows: report files that could not be used, processes not reached or not set
up, nested runs, the stats added up, per process its boundaries and audits and whether its report is from
its exit or its last audit, the processes that never stepped, and the ranks of a world that did not
report. Nothing is ever said to be clean that was not checked. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from .._policy import table as _table
from .._policy.message import display, plural, wrap
from .._policy.stats import SiteStats, Stats
from .._watch.summary import BOUNDED, NOTHING, WatchRecord, summarize
from ._processes import combined, idle_text, labels, missing_ranks, not_reached, ranks_text, unreported
from ._report import NestedRun, NotSetUp, ProcessReport, Record

__all__ = ["Merged", "merge"]

_KILLED = (
    "(the command's report is from its last audit: it ended without running its exit handlers (killed by a "
    "signal, os._exit, or a crash), so what it did after that audit was not checked)"
)


class Merged(NamedTuple):
    """A run's summary and its outcome.

    Attributes:
        text: The summary.
        raised: A process (or a nested run) found a leak in ``raise`` mode.
        reached: How many processes reported.
        checked: Whether any step boundary was audited.
    """

    text: str
    raised: bool
    reached: int
    checked: bool


def merge(
    reports: Sequence[Record],
    problems: Sequence[str] = (),
    folder: str = "",
    *,
    hint: str | None = None,
    prog: str = "gradguard run",
) -> Merged:
    """One summary of a run's reports.

    Args:
        reports: The run's records, of every kind (:func:`gradguard._launch._read.read_run`).
        problems: A line for each report file that could not be used.
        folder: The run folder, named when nothing reported.
        hint: What the launcher knows of a process it cannot reach (the command's own Python started
            with ``-I``), said when nothing reported.
        prog: The command whose lines these are (``gradguard run``, ``gradguard report``).

    Returns:
        The summary and its outcome.
    """
    processes = sorted(combined([r for r in reports if isinstance(r, ProcessReport)]), key=_order)
    unset = [r for r in reports if isinstance(r, NotSetUp)]
    nested = [r for r in reports if isinstance(r, NestedRun)]
    lines = [f"gradguard: {display(p)}" for p in problems]
    for r, label in zip(processes, labels(processes)):
        if r.error:
            lines.append(f"gradguard: {label}: {display(r.error)}")
    lines += not_reached(unset, nested, prog)
    raised = any(h.outcome == "raised" for r in processes for h in r.holders) or any(n.raised for n in nested)
    if not processes:
        if not (unset or nested or problems):
            lines.append(unreported(folder, hint, prog))
        elif unset or problems:
            lines.append(f"{prog}: nothing was checked: no report of a process gradguard was set up in could be used")
        return Merged("\n".join(lines), raised, 0, any(n.checked for n in nested))
    lines.append(_stats(processes))
    stored = any(r.stats for r in processes)  # a guarded store checked each record it was given
    watching = [r for r in processes if r.every is not None]
    checked = stored or any(r.figures.audits > 0 for r in watching) or any(n.checked for n in nested)
    if watching:
        lines += _watch(watching, uncovered=len(problems) + len(unset), stored=stored)
    else:  # said, so that a run with the watch off never reads as one the watch found clean
        lines.append("gradguard watch: off (audit 0) in every process: no step boundary was checked")
    lines += missing_ranks(processes, prog)
    return Merged("\n".join(lines), raised, len(processes), checked)


def _order(r: ProcessReport) -> tuple[bool, bool, int, str, str, int]:
    return (not r.top, r.rank is None, r.rank or 0, r.actor or "", r.host, r.pid)


def _stats(reports: Sequence[ProcessReport]) -> str:
    rows: dict[tuple[str, str], SiteStats] = {}
    for r in reports:
        for entry in r.stats:
            row = rows.setdefault((entry.store, entry.site), SiteStats(entry.store, entry.site))
            row.records += entry.records
            row.tensors_detached += entry.tensors_detached
            row.pinned_bytes_per_record = max(row.pinned_bytes_per_record, entry.pinned_bytes_per_record)
            row.pinned_bytes_released += entry.pinned_bytes_released
            row.refused += entry.refused
    if not rows:
        return "gradguard stats: no guarded store saw a record"
    return f"gradguard stats:\n{Stats(rows)}"


def _who(reports: Sequence[ProcessReport], names: Sequence[str]) -> Callable[[Sequence[int]], str]:
    """``ranks 0-3 of 4``, ``actor Trainer``, ``pid 11, pid 12``: the processes of the given indices."""

    def who(indices: Sequence[int]) -> str:
        ranked: dict[int | None, list[int]] = {}
        others = []
        for i in indices:
            r = reports[i]
            if r.rank is not None and r.actor is None:  # the table below says which pid and host
                ranked.setdefault(r.world_size, []).append(r.rank)
            else:
                others.append(names[i])
        parts = [ranks_text(ranks) + ("" if world is None else f" of {world}") for world, ranks in ranked.items()]
        return ", ".join(parts + others)

    return who


def _watch(reports: list[ProcessReport], uncovered: int, stored: bool) -> list[str]:
    names = labels(reports)
    first = reports[0]
    # one process: the command itself reads as its watch's own summary, unless it has a rank or is an actor
    many = len(reports) > 1 or not first.top or first.rank is not None or first.actor is not None
    records = [WatchRecord(r.figures, r.holders, name if many else "") for r, name in zip(reports, names)]
    nothing = "no step boundary was checked (the guarded stores' records were: above)" if stored else NOTHING
    lines = [summarize(records, who=_who(reports, names), nothing=nothing)]
    stepped = [(name, r) for name, r in zip(names, reports) if r.figures.boundaries]
    idle = [(name, r) for name, r in zip(names, reports) if not r.figures.boundaries]
    if many and stepped:
        lines.append(
            _table.text(
                ("process", "boundaries", "audited", "leaking holders", "report written"),
                [
                    (
                        name,
                        str(r.figures.boundaries),
                        str(r.figures.audits),
                        str(sum(h.outcome != BOUNDED for h in r.holders)),
                        _written(r),
                    )
                    for name, r in stepped
                ],
            )  # fmt: skip
        )
    if many and idle:
        if stepped:
            idled = f"(and {plural(len(idle), 'process')} that imported torch but ran no optimizer step"
            lines += wrap(f"{idled}: {idle_text(idle)})", "", " ")
        else:
            lines += wrap(f"({idle_text(idle)} imported torch but ran no optimizer step)", "", " ")
    if not many and not first.at_exit:
        lines += wrap(_KILLED, "", " ")
    if uncovered:
        other = "other process" if not many else "process"
        lines.append(f"({plural(uncovered, other)} not covered: above)")
    return lines


def _written(r: ProcessReport) -> str:
    return "at exit" if r.at_exit else "at its last audit (no exit handler ran)"
