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
    """A report file's name.

    Args:
        run: The run id.
        host: The process's host (characters a file name cannot carry become ``_``).
        pid: The process's pid.

    Returns:
        ``report-RUN-HOST-PID-RANDOM.json``: no other process takes it (pids are reused: a random part too).
    """
    safe = _SAFE.sub("_", host)[:64] or "host"
    return f"{PREFIX}{run}-{safe}-{pid}-{os.urandom(4).hex()}.json"


def run_of(name: str) -> str:
    """The run a report file belongs to.

    Args:
        name: The file's name.

    Returns:
        The run id its name carries (``""``: none).
    """
    return name[len(PREFIX) :].split("-", 1)[0]


def pattern(folder: str, run: str | None) -> str:
    """The glob pattern of a run's report files.

    Args:
        folder: The run folder.
        run: The run id (``None``: every run's).

    Returns:
        The pattern, ``folder`` and ``run`` escaped.
    """
    return os.path.join(glob.escape(folder), f"{PREFIX}*.json" if run is None else f"{PREFIX}{glob.escape(run)}-*.json")


def runs_in(folder: str) -> dict[str, int]:
    """The report files in a folder, by run.

    Args:
        folder: The folder.

    Returns:
        How many files each run id has there.
    """
    counted: dict[str, int] = {}
    for path in glob.glob(pattern(folder, None)):
        run = run_of(os.path.basename(path))
        counted[run] = counted.get(run, 0) + 1
    return counted
