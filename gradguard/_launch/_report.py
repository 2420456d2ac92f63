"""One process's report: its typed record, the fields its file has, and the file, written atomically.

A report is one JSON object (``format``/``version`` below, ``kind``, then its record's fields),
rewritten whole each time: after each audit of the process's watch, and at its exit. Readers never see
half a file (it is written next to its final name and moved there with ``os.replace``), and a process
that ends without running its exit handlers (``os._exit``, as multiprocessing's fork children do; a
kill) leaves the state of its last audit. Its name (:mod:`gradguard._launch._names`) carries the run id:
a run reads only the files of its own (:mod:`gradguard._launch._read`), so runs may share a folder.

Three kinds, one record type each: :class:`ProcessReport` (a process gradguard was set up in, with its
watch's records), :class:`NotSetUp` (written by the bootstrap itself, where gradguard could not be set
up) and :class:`NestedRun` (a ``gradguard run`` started inside this run). The fields a reader checks
(:data:`FIELDS`) are derived from these types. A forked child inherits its parent's watcher and
counters: :class:`Baseline` is what they held at the fork, and the child's report counts only what
came after it. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._policy.stats import SiteStats
from .._policy.validate import Every
from .._watch.summary import HolderHistory, WatchFigures

if TYPE_CHECKING:
    from .._watch.watcher import Watcher
    from ._identity import Identity

__all__ = [
    "FIELDS",
    "FIGURES_FIELDS",
    "OPTIONAL",
    "FORMAT",
    "HOLDER_FIELDS",
    "STATS_FIELDS",
    "VERSION",
    "Baseline",
    "NestedRun",
    "NotSetUp",
    "ProcessReport",
    "Record",
    "ReportHead",
    "content",
    "nested_record",
    "to_json",
    "write",
]

FORMAT = "gradguard-run-report"
VERSION = 4


@dataclasses.dataclass(frozen=True)
class ReportHead:
    """What every report says of the process that wrote it (or for which it was written).

    Attributes:
        run: The run id (``""``: the variables were set by hand without one).
        pid: Its pid.
        host: Its host name.
        top: Whether it is the command ``gradguard run`` started (not one of its descendants).
        argv: Its ``sys.argv``.
        error: Why it is not (fully) checked, or ``None``.
        written: When the report was written (a Unix time).
    """

    run: str
    pid: int
    host: str
    top: bool
    argv: tuple[str, ...]
    error: str | None
    written: float


@dataclasses.dataclass(frozen=True)
class ProcessReport(ReportHead):
    """A process gradguard was set up in, as its report says (and :class:`ReportHead`'s fields).

    Attributes:
        started: Clock ticks since boot at its start, kept by ``exec``: one process across its programs.
        rank: Its rank, where known.
        world_size: Its world's size, where known.
        local_rank: Its local rank, where known.
        rank_from: What said its rank (``torch.distributed`` or a variable's name).
        actor: The class of the Ray actor it runs.
        label: The rank, the actor, else the pid (:attr:`gradguard._launch._identity.Identity.label`).
        role: ``"multiprocessing child"``, ``"Ray worker"`` or ``""``: how a process that never stepped is counted.
        every: Its watch's ``every`` (``None``: no watch).
        mode: The mode in force when written.
        figures: What its watch did (all zero without a watch).
        holders: Every holder its watch found, the bounded ones too.
        stats: The :class:`SiteStats` of every guarded-store site that saw a record.
        at_exit: Written by its exit handler (``False``: at its last audit).
        timeline: Its watch's timeline (:meth:`gradguard._watch.timeline.Timeline.to_dict`), or ``None``
            (no watch, or a watch that keeps none); optional in a file.
        platform: The versions and the machine it ran on (``python``, ``torch``, ``gradguard``,
            ``machine``, ``cuda``), or ``None``; optional in a file.
    """

    started: int | None
    rank: int | None
    world_size: int | None
    local_rank: int | None
    rank_from: str | None
    actor: str | None
    label: str
    role: str
    every: Every | None
    mode: str
    figures: WatchFigures
    holders: tuple[HolderHistory, ...]
    stats: tuple[SiteStats, ...]
    at_exit: bool
    # optional in a file (reports of this version written before they existed have neither), and not
    # compared: two records of the same moment are equal whatever their curve
    timeline: dict[str, Any] | None = dataclasses.field(
        default=None, compare=False, metadata={"kind": "timeline", "optional": True}
    )
    platform: dict[str, str] | None = dataclasses.field(
        default=None, compare=False, metadata={"kind": "platform", "optional": True}
    )


@dataclasses.dataclass(frozen=True)
class NotSetUp(ReportHead):
    """A process that imported torch where the bootstrap could not set gradguard up (an interpreter without
    gradguard installed), written by the bootstrap itself: ``executable`` is its Python, ``started`` as
    for :class:`ProcessReport`."""

    executable: str
    started: int | None


@dataclasses.dataclass(frozen=True)
class NestedRun(ReportHead):
    """A ``gradguard run`` started inside this run, which watched its own command and printed its own
    summary: ``folder`` and ``nested_run`` say where its reports are, ``code`` is its exit status,
    ``raised``, ``reached`` and ``checked`` its summary's outcome."""

    folder: str
    nested_run: str
    code: int = dataclasses.field(metadata={"kind": "integer"})  # an exit status may be negative
    raised: bool
    reached: int
    checked: bool


Record = ProcessReport | NotSetUp | NestedRun
KINDS: dict[str, type[Record]] = {"process": ProcessReport, "not-set-up": NotSetUp, "nested-run": NestedRun}

# What a reader checks each field's value against, by the field's type.
_KIND_OF = {
    "str": "text",
    "int": "count",
    "float": "number",
    "bool": "flag",
    "str | None": "text or none",
    "int | None": "count or none",
    "tuple[str, ...]": "texts",
    "Every | None": "every",
    "WatchFigures": "figures",
    "tuple[HolderHistory, ...]": "holders",
    "tuple[SiteStats, ...]": "stats",
}


def _schema(cls: type, optional: bool = False) -> dict[str, str]:
    return {
        f.name: f.metadata.get("kind") or _KIND_OF[str(f.type)]
        for f in dataclasses.fields(cls)
        if bool(f.metadata.get("optional")) == optional
    }


_HEAD = {"format": "text", "version": "count", "kind": "text"}
FIELDS: dict[str, dict[str, str]] = {kind: {**_HEAD, **_schema(cls)} for kind, cls in KINDS.items()}
"""The fields each kind of report has, and the kind of value of each: what a reader checks before using one."""
OPTIONAL: dict[str, dict[str, str]] = {kind: _schema(cls, optional=True) for kind, cls in KINDS.items()}
"""The fields a report may have (checked when there), each kind's."""
FIGURES_FIELDS = _schema(WatchFigures)
HOLDER_FIELDS = _schema(HolderHistory)
STATS_FIELDS = _schema(SiteStats)


def to_json(record: Record) -> dict[str, Any]:
    """A report file's JSON object.

    Args:
        record: The report.

    Returns:
        ``format``, ``version`` and ``kind``, then the record's fields (tuples as lists).
    """
    kind = next(name for name, cls in KINDS.items() if isinstance(record, cls))
    fields = {
        name: list(value) if isinstance(value, tuple) else value for name, value in dataclasses.asdict(record).items()
    }
    return {"format": FORMAT, "version": VERSION, "kind": kind, **fields}


@dataclasses.dataclass
class Baseline:
    """What a forked child's inherited watcher and stats held at the fork (all zero in any other process).

    The step boundaries and audits are read from the watcher at the fork (without a lock); the rest is
    that of the parent's last report, passed in: reading it again would take locks that another thread
    of the parent may have held at the fork (and a fork with ``preexec_fn`` runs this before its
    ``exec``). Holders change only at audits, so theirs are exact; a guarded store's records published
    since the parent's last report are counted as the child's.
    """

    figures: WatchFigures = WatchFigures(boundaries=0, audits=0)
    holders: dict[str, HolderHistory] = dataclasses.field(default_factory=dict)
    stats: dict[tuple[str, str], SiteStats] = dataclasses.field(default_factory=dict)
    forked: bool = False

    @classmethod
    def of(
        cls,
        watcher: Watcher | None,
        figures: WatchFigures | None,
        holders: Sequence[HolderHistory],
        stats: Mapping[tuple[str, str], SiteStats],
    ) -> Baseline:
        """The baseline of a child forked now.

        Args:
            watcher: The parent's watcher (``None``: no watch).
            figures: Its figures at the parent's last report.
            holders: Its holders then.
            stats: :func:`gradguard.stats` then.

        Returns:
            What the child counts from.
        """
        if watcher is None or figures is None:
            return cls(stats=dict(stats), forked=True)
        figures = dataclasses.replace(figures, boundaries=watcher.boundaries, audits=watcher.audits)
        return cls(figures, {h.holder: h for h in holders}, dict(stats), forked=True)


_COUNTED = ("boundaries", "audits", "searches", "seconds", "elapsed", "memory_audits", "stamped")


def _since(figures: WatchFigures, base: WatchFigures) -> WatchFigures:
    """``figures`` counted from ``base`` on (the graphs unexplained and the memory clause are as they are now)."""
    return dataclasses.replace(
        figures, **{name: max(0, getattr(figures, name) - getattr(base, name)) for name in _COUNTED}
    )


def _holders(history: Sequence[HolderHistory], base: Baseline) -> tuple[HolderHistory, ...]:
    found = []
    for entry in history:
        before = base.holders.get(entry.holder)
        if before is not None:
            if entry.audits == before.audits:
                continue  # the parent's finding, not this process's
            entry = dataclasses.replace(
                entry, audits=entry.audits - before.audits, repaired=entry.repaired - before.repaired
            )
        found.append(entry)
    return tuple(found)


def _stats(stats: Mapping[tuple[str, str], SiteStats], base: Baseline) -> tuple[SiteStats, ...]:
    rows = []
    for key, row in stats.items():
        before = base.stats.get(key)
        if before is not None:
            row = dataclasses.replace(
                row,
                records=row.records - before.records,
                tensors_detached=row.tensors_detached - before.tensors_detached,
                pinned_bytes_released=row.pinned_bytes_released - before.pinned_bytes_released,
                refused=row.refused - before.refused,
            )
        if row.records > 0:
            rows.append(row)
    return tuple(rows)


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
    figures: WatchFigures | None,
    holders: Sequence[HolderHistory],
    stats: Mapping[tuple[str, str], SiteStats],
    base: Baseline,
    at_exit: bool,
    error: str | None,
    timeline: Any = None,
) -> ProcessReport:
    """The report of this process now.

    Args:
        identity: Who the process is.
        run: The run id.
        started: Its start time (:func:`gradguard._launch._identity.started`).
        top: Whether it is the command ``gradguard run`` started.
        every: Its watch's ``every`` (``None``: no watch).
        mode: The mode in force.
        figures: Its watcher's :meth:`~gradguard.Watcher.figures` (``None``: no watch).
        holders: Its watcher's holders, leaking and bounded.
        stats: :func:`gradguard.stats`.
        base: What a fork child inherited (the child counts from there); ``Baseline()`` otherwise.
        at_exit: Whether its exit handler writes it.
        error: Why it is not (fully) checked, or ``None``.
        timeline: Its watcher's timeline (anything with ``to_dict()``, or that object already made), or ``None``.

    Returns:
        The record, for :func:`to_json`.
    """
    return ProcessReport(
        run=run,
        pid=identity.pid,
        host=identity.host,
        top=top,
        argv=tuple(str(a) for a in sys.argv),
        error=error,
        written=time.time(),
        started=started,
        rank=identity.rank,
        world_size=identity.world_size,
        local_rank=identity.local_rank,
        rank_from=identity.rank_from,
        actor=identity.actor,
        label=identity.label,
        role=_role(),
        every=every,
        mode=mode,
        figures=WatchFigures(0, 0) if figures is None else _since(figures, base.figures),
        holders=_holders(holders, base),
        stats=_stats(stats, base),
        at_exit=at_exit,
        timeline=timeline if timeline is None or isinstance(timeline, dict) else timeline.to_dict(),
        platform=_platform(),
    )


_PLATFORM: dict[str, str] = {}


def _platform() -> dict[str, str]:
    """The versions and the machine, read once per process (torch's and CUDA's once torch has them)."""
    if not _PLATFORM:
        import platform

        try:
            from importlib.metadata import version

            ours = version("gradguard")
        except Exception:  # noqa: BLE001 - a source tree that is not installed
            ours = "unknown"
        _PLATFORM.update(python=platform.python_version(), gradguard=ours,
                         machine=f"{platform.platform()}, {os.cpu_count()} CPUs")  # fmt: skip
    torch = sys.modules.get("torch")
    if torch is not None and "torch" not in _PLATFORM:
        _PLATFORM["torch"] = str(getattr(torch, "__version__", "?"))
    if torch is not None and "cuda" not in _PLATFORM:
        try:
            if torch.cuda.is_initialized():
                _PLATFORM["cuda"] = torch.cuda.get_device_name()
        except Exception:  # noqa: BLE001 - a report never fails on what it only describes
            pass
    return dict(_PLATFORM)


def nested_record(
    *, run: str, pid: int, host: str, top: bool, folder: str, nested_run: str, code: int, raised: bool,
    reached: int, checked: bool,
) -> NestedRun:  # fmt: skip
    """The record a ``gradguard run`` started inside another run leaves in the outer run's folder.

    Args:
        run: The outer run's id.
        pid: This process's pid.
        host: Its host.
        top: Whether it is the command the outer ``gradguard run`` started.
        folder: This run's folder.
        nested_run: This run's id.
        code: This run's exit status.
        raised: Whether a process of this run found a leak in ``raise`` mode.
        reached: How many processes reported to this run.
        checked: Whether any step boundary was audited.

    Returns:
        The record, for :func:`write`.
    """
    return NestedRun(
        run=run, pid=pid, host=host, top=top, argv=tuple(str(a) for a in sys.argv), error=None, written=time.time(),
        folder=folder, nested_run=nested_run, code=code, raised=raised, reached=reached, checked=checked,
    )  # fmt: skip


_dumped: tuple[object, str] | None = None  # the last timeline written, and its text


def write(path: str, report: Record | Mapping[str, Any]) -> None:
    """Write a report file in one step: a reader sees the old file or the new one.

    Args:
        path: The file.
        report: A record, or its JSON object.

    Raises:
        OSError: the file cannot be written (the old one, if any, is left as it was).
    """
    global _dumped
    timeline: object = None
    if isinstance(report, ProcessReport) and report.timeline is not None:
        timeline = report.timeline  # not copied by asdict: written as it is
        report = dataclasses.replace(report, timeline=None)
    document = dict(to_json(report) if dataclasses.is_dataclass(report) else report)
    timeline = document.pop("timeline", None) if timeline is None else timeline
    text = json.dumps(document, indent=1, default=str)
    if timeline is not None:  # thousands of numbers: one line, not one line each; the same object dumped once
        if _dumped is None or _dumped[0] is not timeline:
            _dumped = (timeline, json.dumps(timeline, separators=(",", ":"), default=str))
        text = f'{text[:-2]},\n "timeline": {_dumped[1]}\n}}'
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(text)
        f.write("\n")
    os.replace(temporary, path)
