"""The names of a run folder's files: ``report-RUN-HOST-PID-RANDOM.json``, one per process.

The run id comes first and has no ``-`` in it, so a file's name says which run it belongs to, and a
run finds its own reports without opening anyone else's.
"""

from __future__ import annotations

import glob
import os
import re

__all__ = ["PREFIX", "file_name", "pattern", "run_of", "runs_in"]

PREFIX = "report-"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def file_name(run: str, host: str, pid: int) -> str:
    """A name no other process takes (pids are reused: a random part too), for the run ``run``."""
    safe = _SAFE.sub("_", host)[:64] or "host"
    return f"{PREFIX}{run}-{safe}-{pid}-{os.urandom(4).hex()}.json"


def run_of(name: str) -> str:
    """The run id a report's file name carries (``""``: none)."""
    return name[len(PREFIX) :].split("-", 1)[0]


def pattern(folder: str, run: str | None) -> str:
    """The glob pattern of the report files of ``run`` in ``folder`` (``None``: of every run)."""
    return os.path.join(glob.escape(folder), f"{PREFIX}*.json" if run is None else f"{PREFIX}{glob.escape(run)}-*.json")


def runs_in(folder: str) -> dict[str, int]:
    """The report files in ``folder``, counted by the run id their names carry."""
    counted: dict[str, int] = {}
    for path in glob.glob(pattern(folder, None)):
        run = run_of(os.path.basename(path))
        counted[run] = counted.get(run, 0) + 1
    return counted
