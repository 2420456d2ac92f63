"""One process's report: its content, the file it is written to (atomically), and the fields it has.

A report is one JSON object (``format``/``version`` below), rewritten whole each time: after each
audit of the process's watch, and at its exit. Readers never see half a file (it is written next to
its final name and moved there with ``os.replace``), and a process that ends without running its
exit handlers (``os._exit``, as multiprocessing's fork children do; a kill) leaves the state of its
last audit. Its name (:mod:`gradguard._launch._names`) carries the run id: a run reads only the files
of its own (:mod:`gradguard._launch._read`), so runs may share a folder.

Three kinds (``kind``), each with every field :data:`FIELDS` lists for it (the comments there say
what each holds):

* ``process``: a process gradguard was set up in: who it is, what its watch did (its counts, its own
  summary, its holders), the stats of its guarded stores, and whether its exit handler wrote it;
* ``not-set-up``: a process that imported torch where the bootstrap could not set gradguard up (an
  interpreter without gradguard installed), written by the bootstrap itself;
* ``nested-run``: a ``gradguard run`` started inside this run, which watched its own command and
  printed its own summary: where its reports are, and its outcome.

A forked child inherits its parent's watcher and counters: :class:`Baseline` is what they held at
the fork, and the child's report counts only what came after it. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._policy.stats import SiteStats
    from .._watch.watcher import HolderHistory, Watcher
    from ._identity import Identity
    from ._settings import Every

__all__ = [
    "FIELDS",
    "FORMAT",
    "HOLDER_FIELDS",
    "STATS_FIELDS",
    "VERSION",
    "Baseline",
    "content",
    "nested_record",
    "write",
]

FORMAT = "gradguard-run-report"
VERSION = 2

# The fields each kind of report has, and the type of each: what a reader checks before using one.
_COMMON = {
    "format": "text",
    "version": "count",
    "run": "text",  # the run id ("": the variables were set by hand without one)
    "kind": "text",
    "pid": "count",
    "host": "text",
    "top": "flag",  # the command gradguard run started, not one of its descendants
    "argv": "texts",
    "error": "text or none",  # why this process is not (fully) checked
    "written": "number",  # a Unix time
}
FIELDS: dict[str, dict[str, str]] = {
    "process": {
        **_COMMON,
        "started": "count or none",  # clock ticks since boot, kept by exec: one process across its programs
        "rank": "count or none",
        "world_size": "count or none",
        "local_rank": "count or none",
        "rank_from": "text or none",
        "actor": "text or none",
        "label": "text",  # the rank, the actor, else the pid (gradguard._launch._identity.Identity)
        "role": "text",  # "multiprocessing child", "Ray worker" or "": how a process that never stepped is counted
        "every": "every",  # the watch's (null: no watch)
        "mode": "text",  # the mode in force when written
        "boundaries": "count",
        "audits": "count",
        "audit_seconds": "number",
        "memory_audits": "count",
        "read_seconds": "number",
        "memory": "text",  # what the memory figure did, as the watch says it
        "summary": "text",  # the watch's own summary (Watcher.summary); "" in a fork child (its parent's watcher)
        "unexplained": "count",  # graphs old at the last audit that no holder was found for
        "holders": "holders",  # the watch's HolderHistory records, as dicts
        "stats": "stats",  # the SiteStats of every guarded-store site, as dicts
        "at_exit": "flag",  # written by the exit handler (false: at its last audit)
    },
    "not-set-up": {**_COMMON, "executable": "text", "started": "count or none"},  # written by the bootstrap
    "nested-run": {
        **_COMMON,
        "folder": "text",  # where the nested run's reports are
        "nested_run": "text",  # its run id
        "code": "integer",
        "raised": "flag",
        "reached": "count",
        "checked": "flag",
    },
}
HOLDER_FIELDS = {
    "holder": "text",
    "path": "text",
    "fix": "text",
    "outcome": "text",
    "tensors": "count",
    "pinned_bytes": "count",
    "survived": "count",
    "nodes": "count",
    "node_bytes": "count",
}
STATS_FIELDS = {
    "store": "text",
    "site": "text",
    "records": "count",
    "tensors_detached": "count",
    "pinned_bytes_per_record": "count",
    "pinned_bytes_released": "count",
}


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
    forked: bool = False

    @classmethod
    def of(
        cls, watcher: Watcher | None, history: Sequence[HolderHistory], stats: dict[tuple[str, str], SiteStats]
    ) -> Baseline:
        if watcher is None:
            return cls(stats=dict(stats), forked=True)
        holders = {h.holder: h for h in history}
        return cls(watcher.boundaries, watcher.audits, watcher.audit_seconds, holders, dict(stats), forked=True)


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


def _head(kind: str, run: str, pid: int, host: str, top: bool, error: str | None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "run": run,
        "kind": kind,
        "pid": pid,
        "host": host,
        "top": top,
        "argv": [str(a) for a in sys.argv],
        "error": error,
    }


def _role() -> str:
    """``multiprocessing child`` (a DataLoader or pool worker, spawned or forked), ``Ray worker``, else ``""``."""
    # a spawn child imports torch while it prepares, before multiprocessing knows its parent: its command
    # line (``sys.orig_argv``, which the preparation does not replace) says what it is
    started_as = getattr(sys, "orig_argv", [])
    if "--multiprocessing-fork" in started_as or any("multiprocessing.forkserver" in a for a in started_as):
        return "multiprocessing child"
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is not None and multiprocessing.parent_process() is not None:
        return "multiprocessing child"
    if sys.argv and os.path.basename(sys.argv[0]) == "default_worker.py":
        return "Ray worker"
    return ""


def content(
    identity: Identity,
    *,
    run: str,
    started: int | None,
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
    """The report of this process now (the module documentation says what each field is); ``history``
    is ``watcher.history()`` and ``stats`` is :func:`gradguard.stats`, read by the caller."""
    report = _head("process", run, identity.pid, identity.host, top, error)
    report.update(identity.to_dict(), started=started, role=_role(), every=every, mode=mode)
    if watcher is None:
        report.update(boundaries=0, audits=0, audit_seconds=0.0, memory_audits=0, read_seconds=0.0, memory="")
        report.update(holders=[], summary="", unexplained=0)
    else:
        # the watch's own summary of this process, as its Watcher says it (a fork child's watcher is its
        # parent's too: its summary would not be the child's own)
        report.update(summary="" if base.forked else watcher.summary(), unexplained=watcher.figures().unexplained)
        report.update(
            boundaries=watcher.boundaries - base.boundaries,
            audits=watcher.audits - base.audits,
            audit_seconds=round(max(0.0, watcher.audit_seconds - base.audit_seconds), 6),
            memory_audits=watcher.memory_audits,
            read_seconds=round(watcher.read_seconds, 6),
            memory=watcher.memory_line(),
            holders=_holders(history, base),
        )
    report.update(stats=_stats(stats, base), at_exit=at_exit, written=time.time())
    return report


def nested_record(
    *, run: str, pid: int, host: str, top: bool, folder: str, nested_run: str, code: int, raised: bool,
    reached: int, checked: bool,
) -> dict[str, Any]:  # fmt: skip
    """The record a ``gradguard run`` started inside another run leaves in the outer run's folder."""
    record = _head("nested-run", run, pid, host, top, None)
    record.update(
        folder=folder, nested_run=nested_run, code=code, raised=raised, reached=reached, checked=checked,
        written=time.time(),
    )  # fmt: skip
    return record


def write(path: str, report: dict[str, Any]) -> None:
    """Replace ``path`` with ``report`` in one step (a reader sees the old file or the new one)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    os.replace(temporary, path)
