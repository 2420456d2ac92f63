"""A run folder read back: the reports of one run, each checked field by field before it is used.

A file that cannot be used is never skipped in silence, and never counted as a clean process: it
becomes a problem line naming the file and what is wrong with it (unreadable, not JSON, another
format or version, a field missing or of the wrong type), and the summary says that the processes of
those files are not covered. ``gradguard run`` opens only the files named for its own run id; two runs
given the same folder never read each other's reports.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from ._names import pattern, runs_in
from ._report import FIELDS, FORMAT, HOLDER_FIELDS, STATS_FIELDS, VERSION

__all__ = ["RunFolder", "check", "read_run"]


class RunFolder(NamedTuple):
    """What a run folder held for one run: ``reports`` (each checked), ``problems`` (a line per file
    that could not be used) and ``others`` (how many report files of other runs the folder holds, by
    run id: not read)."""

    reports: list[dict[str, Any]]
    problems: list[str]
    others: dict[str, int]


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _type_ok(kind: str, value: object) -> bool:
    if kind == "text":
        return isinstance(value, str)
    if kind == "texts":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "text or none":
        return value is None or isinstance(value, str)
    if kind == "count":
        return _count(value)
    if kind == "count or none":
        return value is None or _count(value)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    if kind == "flag":
        return isinstance(value, bool)
    if kind == "every":
        return value is None or value == "auto" or (_count(value) and value > 0)  # type: ignore[operator]
    raise AssertionError(kind)


_SAID = {
    "count": "a whole number >= 0",
    "count or none": "a whole number >= 0 or null",
    "integer": "a whole number",
    "number": "a number >= 0",
    "flag": "true or false",
    "text or none": "a string or null",
    "texts": "a list of strings",
    "every": "a positive whole number, 'auto' or null",
    "holders": "a list of holder records",
    "stats": "a list of stats rows",
}


def _fields(where: str, record: Mapping[str, Any], fields: Mapping[str, str]) -> str | None:
    for name, kind in fields.items():
        if name not in record:
            return f"the field {where + name!r} is missing"
        value = record[name]
        if kind in ("holders", "stats"):
            rows = HOLDER_FIELDS if kind == "holders" else STATS_FIELDS
            if not isinstance(value, list) or not all(isinstance(row, dict) for row in value):
                return f"the field {where + name!r} is {_shown(value)}, not {_SAID[kind]}"
            for i, row in enumerate(value):
                wrong = _fields(f"{where}{name}[{i}].", row, rows)
                if wrong:
                    return wrong
        elif not _type_ok(kind, value):
            return f"the field {where + name!r} is {_shown(value)}, not {_SAID.get(kind, 'a string')}"
    return None


def _shown(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else f"{text[:37]}..."


def check(report: object) -> str | None:
    """What is wrong with ``report`` as a report of this gradguard, or ``None`` when every field the
    summary reads is there with its type."""
    if not isinstance(report, dict):
        return f"not a {FORMAT} file (a JSON {type(report).__name__}, not an object)"
    if report.get("format") != FORMAT:
        return f"not a {FORMAT} file (format {_shown(report.get('format'))})"
    if report.get("version") != VERSION:
        return (
            f"a {FORMAT} of version {_shown(report.get('version'))}, not {VERSION}: written by another gradguard; "
            "merge it with that version's `gradguard report`"
        )
    fields = FIELDS.get(report.get("kind"))  # type: ignore[arg-type]
    if fields is None:
        return f"the field 'kind' is {_shown(report.get('kind'))}, not one of {', '.join(map(repr, FIELDS))}"
    return _fields("", report, fields)


def read_run(folder: str, run: str | None) -> RunFolder:
    """The reports of the run ``run`` in ``folder`` (``None``: every report file there, of any run), each
    checked; a line for each file that could not be used."""
    reports: list[dict[str, Any]] = []
    problems: list[str] = []
    counted = runs_in(folder)
    for path in sorted(glob.glob(pattern(folder, run))):
        name = os.path.basename(path)
        try:
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, ValueError) as exc:
            problems.append(f"{name}: unreadable ({exc}): its process is not covered")
            continue
        wrong = check(report)
        if wrong is None and run is not None and report["run"] != run:
            wrong = f"it carries the run id {report['run']!r}, not this run's {run!r}"
        if wrong is not None:
            problems.append(f"{name}: {wrong}: its process is not covered")
            continue
        reports.append(report)
    others = {} if run is None else {r: n for r, n in counted.items() if r != run}
    return RunFolder(reports, problems, others)
