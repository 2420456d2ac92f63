"""A run folder read back: the reports of one run, each checked field by field, then read into its record.

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

from .._policy.stats import SiteStats
from .._watch.summary import HolderHistory, WatchFigures
from ._names import pattern, runs_in
from ._report import FIELDS, FIGURES_FIELDS, FORMAT, HOLDER_FIELDS, KINDS, OPTIONAL, STATS_FIELDS, VERSION, Record

__all__ = ["RunFolder", "check", "read_run", "record"]


class RunFolder(NamedTuple):
    """What a run folder held for one run.

    Attributes:
        reports: The record of each report that could be used.
        problems: A line per file that could not be used, naming it and what is wrong.
        others: How many report files of other runs the folder holds, by run id (not read).
    """

    reports: list[Record]
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
    "figures": "an object of the watch's figures",
}
_ROWS = {"holders": HOLDER_FIELDS, "stats": STATS_FIELDS}
_HEAD = ("format", "version", "kind")  # the file's, not its record's


def _fields(where: str, record: Mapping[str, Any], fields: Mapping[str, str]) -> str | None:
    for name, kind in fields.items():
        if name not in record:
            return f"the field {where + name!r} is missing"
        value = record[name]
        if kind in _ROWS:
            if not isinstance(value, list) or not all(isinstance(row, dict) for row in value):
                return f"the field {where + name!r} is {_shown(value)}, not {_SAID[kind]}"
            for i, row in enumerate(value):
                wrong = _fields(f"{where}{name}[{i}].", row, _ROWS[kind])
                if wrong:
                    return wrong
        elif kind == "figures":
            if not isinstance(value, dict):
                return f"the field {where + name!r} is {_shown(value)}, not {_SAID[kind]}"
            wrong = _fields(f"{where}{name}.", value, FIGURES_FIELDS)
            if wrong:
                return wrong
        elif not _type_ok(kind, value):
            return f"the field {where + name!r} is {_shown(value)}, not {_SAID.get(kind, 'a string')}"
    return None


def _shown(value: object) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else f"{text[:37]}..."


def check(report: object) -> str | None:
    """What is wrong with a report file's JSON object.

    Args:
        report: What the file held.

    Returns:
        One clause naming the first field that is missing or of the wrong kind (or the format or version
        that is not this gradguard's), or ``None`` when every field of its kind is there with its type.
    """
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
    return _fields("", report, fields) or _optional(report, OPTIONAL[report["kind"]])


def _optional(report: Mapping[str, Any], fields: Mapping[str, str]) -> str | None:
    """What is wrong with the optional fields a report has (a report without them is whole)."""
    for name, kind in fields.items():
        value = report.get(name)
        if value is None:
            continue
        if kind == "timeline":
            from .._watch.timeline import Timeline

            try:
                Timeline.from_dict(value)
            except ValueError as exc:
                return f"the field {name!r} is not a timeline: {exc}"
        elif kind == "platform":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                return f"the field {name!r} is {_shown(value)}, not an object of strings"
    return None


_MADE: dict[str, tuple[type, Mapping[str, str]]] = {
    "figures": (WatchFigures, FIGURES_FIELDS),
    "holders": (HolderHistory, HOLDER_FIELDS),
    "stats": (SiteStats, STATS_FIELDS),
}


def _typed(kind: str, value: Any) -> Any:
    """A checked field's value as its record holds it (fields the record does not have are left out)."""
    if kind in _MADE:
        cls, fields = _MADE[kind]
        rows = [value] if kind == "figures" else value
        made = tuple(cls(**{name: _typed(k, row[name]) for name, k in fields.items()}) for row in rows)
        return made[0] if kind == "figures" else made
    if kind == "texts":
        return tuple(value)
    if kind == "number":
        return float(value)
    return value


def record(report: Mapping[str, Any]) -> Record:
    """A report's record.

    Args:
        report: A report file's JSON object that :func:`check` found nothing wrong with.

    Returns:
        Its :class:`~gradguard._launch._report.ProcessReport`, ``NotSetUp`` or ``NestedRun``.
    """
    kind = report["kind"]
    fields = FIELDS[kind]
    given = {name: report[name] for name in OPTIONAL[kind] if report.get(name) is not None}
    return KINDS[kind](**{name: _typed(k, report[name]) for name, k in fields.items() if name not in _HEAD}, **given)


def read_run(folder: str, run: str | None) -> RunFolder:
    """The reports of one run in a folder, each checked and read into its record.

    Args:
        folder: The run folder.
        run: The run id (``None``: every report file there, of any run).

    Returns:
        The records, a line for each file that could not be used, and the other runs' files counted.
    """
    reports: list[Record] = []
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
        reports.append(record(report))
    others = {} if run is None else {r: n for r, n in counted.items() if r != run}
    return RunFolder(reports, problems, others)
