"""Report records as processes write them, for the tests of the merged summary and of reading a run
folder back (``tests/test_launch.py``, ``tests/test_launch_reports.py``)."""

from __future__ import annotations

from typing import Any

from gradguard._launch import _report

__all__ = ["holder", "process", "rank"]


def process(**fields: Any) -> dict[str, Any]:
    """A ``process`` report of run ``r1`` (pid 100 on node-1, no rank, no step), ``fields`` changed."""
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
        "boundaries": 0,
        "audits": 0,
        "audit_seconds": 0.0,
        "memory_audits": 0,
        "read_seconds": 0.0,
        "memory": "",
        "summary": "",
        "unexplained": 0,
        "holders": [],
        "stats": [],
        "at_exit": True,
    }
    if "pid" in fields and "label" not in fields:
        report["label"] = f"pid {fields['pid']}"
    if "pid" in fields and "started" not in fields:
        report["started"] = 5000 + int(fields["pid"])
    report.update(fields)
    assert set(report) >= set(_report.FIELDS["process"]), "the helper lags behind the report's fields"
    return report


def holder(pinned: int, outcome: str = "raised", path: str = "__main__:KEPT[0]") -> dict[str, Any]:
    """One holder record, as the watch's ``HolderHistory`` gives it."""
    return {
        "holder": "__main__:KEPT[*]",
        "path": path,
        "fix": "KEPT = gradguard.guard([]) (in __main__)",
        "outcome": outcome,
        "tensors": 3,
        "pinned_bytes": pinned,
        "survived": 2,
        "audits": 2,
        "repaired": 0,
        "nodes": 0,
        "node_bytes": 0,
        "alive": False,
        "why": "",
        "found_at": 3,
    }


def rank(r: int, **fields: Any) -> dict[str, Any]:
    """Rank ``r`` of 2, as torchrun starts it."""
    return process(pid=200 + r, rank=r, world_size=2, rank_from="RANK", label=f"rank {r}/2", **fields)
