"""Report records as processes write them, for the tests of the merged summary and of reading a run
folder back (``tests/launch/test_launch.py``, ``tests/launch/test_launch_reports.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gradguard._launch import _read, _report
from gradguard._watch.summary import HolderHistory, WatchFigures

__all__ = ["holder", "process", "process_record", "rank", "records"]

_FIGURES = {f.name for f in dataclasses.fields(WatchFigures)}


def process(**fields: Any) -> dict[str, Any]:
    """A ``process`` report's JSON object, of run ``r1`` (pid 100 on node-1, no rank, no step), ``fields``
    changed; the watch's figures (``boundaries=``, ``audits=``, ``unexplained=``, ...) may be given as fields
    of their own."""
    figures = dataclasses.asdict(WatchFigures(boundaries=0, audits=0))
    figures.update({name: fields.pop(name) for name in list(fields) if name in _FIGURES})
    report: dict[str, Any] = {
        "format": _report.FORMAT,
        "version": _report.VERSION,
        "run": "r1",
        "kind": "process",
        "pid": 100,
        "host": "node-1",
        "top": False,
        "argv": ["train.py"],
        "error": None,
        "written": 1000.0,
        "started": 5000,
        "rank": None,
        "world_size": None,
        "local_rank": None,
        "rank_from": None,
        "actor": None,
        "label": "pid 100",
        "role": "",
        "every": "auto",
        "mode": "raise",
        "figures": figures,
        "holders": [],
        "stats": [],
        "at_exit": True,
    }
    if "pid" in fields and "label" not in fields:
        report["label"] = f"pid {fields['pid']}"
    if "pid" in fields and "started" not in fields:
        report["started"] = 5000 + int(fields["pid"])
    report.update(fields)
    assert set(report) == set(_report.FIELDS["process"]), "the helper lags behind the report's fields"
    return report


def holder(pinned: int, outcome: str = "raised", path: str = "__main__:KEPT[0]", **fields: Any) -> dict[str, Any]:
    """One holder record, as the watch's ``HolderHistory`` gives it."""
    entry = HolderHistory(
        holder="__main__:KEPT[*]",
        path=path,
        fix="KEPT = gradguard.guard([]) (in __main__)",
        outcome=outcome,
        tensors=3,
        pinned_bytes=pinned,
        survived=2,
        audits=2,
        found_at=3,
    )
    return dataclasses.asdict(dataclasses.replace(entry, **fields))


def rank(r: int, **fields: Any) -> dict[str, Any]:
    """Rank ``r`` of 2, as torchrun starts it."""
    return process(pid=200 + r, rank=r, world_size=2, rank_from="RANK", label=f"rank {r}/2", **fields)


def records(*reports: dict[str, Any]) -> list[_report.Record]:
    """The records of reports' JSON objects, each checked first, as a run folder is read."""
    for report in reports:
        assert _read.check(report) is None, _read.check(report)
    return [_read.record(report) for report in reports]


def process_record(report: dict[str, Any]) -> _report.ProcessReport:
    """The record of one ``process`` report's JSON object."""
    (one,) = records(report)
    assert isinstance(one, _report.ProcessReport)
    return one
