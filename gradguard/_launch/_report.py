"""One process's report: its content, the file it is written to (atomically), and reading a run's back.

A report is one JSON object (``format``/``version`` below), rewritten whole each time: after each
audit of the process's watch, and at its exit. Readers never see half a file (it is written next to
its final name and moved there with ``os.replace``), and a process that ends without running its
exit handlers (``os._exit``, as multiprocessing's fork children do; a kill) leaves the state of its
last audit.

Fields: ``pid``, ``host``, ``rank``, ``world_size``, ``local_rank``, ``rank_from``, ``actor``,
``label`` (:class:`~gradguard._launch._identity.Identity`); ``top`` (the command ``gradguard run``
started, not one of its descendants); ``argv``; ``every`` (the watch's, ``None``: no watch);
``mode`` (the mode in force when written); ``boundaries``, ``audits``, ``audit_seconds``,
``memory_audits`` and ``read_seconds`` (the memory trigger's audits and readings), ``memory`` (what the
trigger watched, as the watch's summary says it);
``holders`` (the watch's :class:`~gradguard.HolderHistory` records as dicts); ``stats`` (the
:class:`~gradguard.SiteStats` of every guarded-store site, as dicts); ``at_exit`` (written by the
exit handler); ``error`` (why this process is not fully checked, or ``None``); ``written`` (a Unix
time).

A forked child inherits its parent's watcher and counters: :class:`Baseline` is what they held at
the fork, and the child's report counts only what came after it.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from .._policy.stats import SiteStats
from .._watch.watcher import Every, HolderHistory, Watcher
from ._identity import Identity

__all__ = ["FORMAT", "VERSION", "Baseline", "content", "file_name", "read_run", "reports_in", "write"]

FORMAT = "gradguard-run-report"
VERSION = 1
_PREFIX = "report-"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclasses.dataclass
class Baseline:
    """What a forked child's inherited watcher and stats held at the fork (all zero in any other process).

    The counts are read from the watcher at the fork (without a lock); the holders and the stats are
    those of the parent's last report, passed in: reading them again would take locks that another
    thread of the parent may have held at the fork (and a fork with ``preexec_fn`` runs this before
    its ``exec``). Holders change only at audits, so theirs are exact; a guarded store's records
    published since the parent's last report are counted as the child's.
    """

    boundaries: int = 0
    audits: int = 0
    audit_seconds: float = 0.0
    holders: dict[str, HolderHistory] = dataclasses.field(default_factory=dict)
    stats: dict[tuple[str, str], SiteStats] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(
        cls, watcher: Watcher | None, history: Sequence[HolderHistory], stats: dict[tuple[str, str], SiteStats]
    ) -> Baseline:
        if watcher is None:
            return cls(stats=dict(stats))
        holders = {h.holder: h for h in history}
        return cls(watcher.boundaries, watcher.audits, watcher.audit_seconds, holders, dict(stats))


def _holders(history: Sequence[HolderHistory], base: Baseline) -> list[dict[str, Any]]:
    found = []
    for entry in history:
        before = base.holders.get(entry.holder)
        if before is not None:
            if entry.audits == before.audits:
                continue  # the parent's finding, not this process's
            entry = dataclasses.replace(
                entry, audits=entry.audits - before.audits, repaired=entry.repaired - before.repaired
            )
        found.append(dataclasses.asdict(entry))
    return found


def _stats(stats: dict[tuple[str, str], SiteStats], base: Baseline) -> list[dict[str, Any]]:
    rows = []
    for key, row in stats.items():
        before = base.stats.get(key)
        if before is not None:
            row = dataclasses.replace(
                row,
                records=row.records - before.records,
                tensors_detached=row.tensors_detached - before.tensors_detached,
                pinned_bytes_released=row.pinned_bytes_released - before.pinned_bytes_released,
            )
        if row.records > 0:
            rows.append(dataclasses.asdict(row))
    return rows


def content(
    identity: Identity,
    *,
    top: bool,
    every: Every | None,
    mode: str,
    watcher: Watcher | None,
    history: Sequence[HolderHistory],
    stats: dict[tuple[str, str], SiteStats],
    base: Baseline,
    at_exit: bool,
    error: str | None,
) -> dict[str, Any]:
    """The report of this process now (see the module documentation for the fields); ``history`` is
    ``watcher.history()`` and ``stats`` is :func:`gradguard.stats`, read by the caller."""
    report: dict[str, Any] = {"format": FORMAT, "version": VERSION, **identity.to_dict()}
    report.update(top=top, argv=list(sys.argv), every=every, mode=mode)
    if watcher is None:
        report.update(boundaries=0, audits=0, audit_seconds=0.0, holders=[])
    else:
        report.update(
            boundaries=watcher.boundaries - base.boundaries,
            audits=watcher.audits - base.audits,
            audit_seconds=round(max(0.0, watcher.audit_seconds - base.audit_seconds), 6),
            memory_audits=watcher.memory_audits,
            read_seconds=round(watcher.read_seconds, 6),
            memory=watcher.memory_line(),
            holders=_holders(history, base),
        )
    report.update(stats=_stats(stats, base), at_exit=at_exit, error=error, written=time.time())
    return report


def file_name(identity: Identity) -> str:
    """A name no other process of the run takes: host, pid and a random part (pids are reused)."""
    host = _SAFE.sub("_", identity.host)[:64] or "host"
    return f"{_PREFIX}{host}-{identity.pid}-{os.urandom(4).hex()}.json"


def write(path: str, report: dict[str, Any]) -> None:
    """Replace ``path`` with ``report`` in one step (a reader sees the old file or the new one)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    os.replace(temporary, path)


def reports_in(folder: str) -> list[str]:
    """The report files in ``folder``, sorted."""
    return sorted(glob.glob(os.path.join(glob.escape(folder), f"{_PREFIX}*.json")))


def read_run(folder: str) -> tuple[list[dict[str, Any]], list[str]]:
    """``(reports, problems)``: every report in ``folder`` that reads as one, and a line for each that
    does not (unreadable, not JSON, another format or version)."""
    reports: list[dict[str, Any]] = []
    problems: list[str] = []
    for path in reports_in(folder):
        name = os.path.basename(path)
        try:
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, ValueError) as exc:
            problems.append(f"{name}: unreadable ({exc})")
            continue
        if not isinstance(report, dict) or report.get("format") != FORMAT or report.get("version") != VERSION:
            problems.append(f"{name}: not a {FORMAT} version {VERSION} file")
            continue
        reports.append(report)
    return reports, problems
