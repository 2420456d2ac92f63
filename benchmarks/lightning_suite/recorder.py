"""A pytest plugin the runner loads into the suite it measures (``-p benchmarks.lightning_suite.recorder``).

It changes nothing in the run: it only writes, at the end of the session, one JSON file (the path in
the ``GRADGUARD_LSUITE_RECORD`` environment variable) with

* every test's outcome and the duration of its setup, call and teardown;
* every warning whose class is gradguard's (``GradGuardWarning`` and its subclasses, recognised by
  the class's ``__module__``, so that a plain run never imports gradguard): its message, the file
  and line it was attributed to, the id of the test pytest recorded it in and pytest's ``when``
  (``"runtest"``, the whole of a test from setup to teardown, since pytest 8); ``nodeid`` is ``""``
  for one emitted outside any test, such as while pytest unconfigures (when the gradguard plugin's
  session scopes exit), which this plugin records itself;
* which ``gradguard`` and ``gradguard_pytest`` were imported (their files), and, where the gradguard
  plugin keeps its session watch where this module knows to look, the watch's counts (boundaries,
  audits, the audits' seconds). That last part reads a private detail of ``gradguard_pytest``: it is
  best effort, and absent (``null``) when the plugin keeps its watch otherwise.

With ``GRADGUARD_LSUITE_COUNT_OBJECTS=1`` it also records, after each test's teardown, how many
objects the garbage collector tracks (what an audit searches): a diagnostic, which costs time.

With ``GRADGUARD_LSUITE_KEEP_EVERY=K`` (a whole number > 1) it keeps every K-th collected test, in
collection order, and deselects the others: the runner's fixed sample for a slow configuration.

Lightning's configuration passes ``--disable-pytest-warnings``: that hides pytest's warnings summary
but not the ``pytest_warning_recorded`` hook this plugin records from.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import warnings
from collections.abc import Generator
from typing import Any

import pytest

RECORD_ENV = "GRADGUARD_LSUITE_RECORD"
KEEP_EVERY_ENV = "GRADGUARD_LSUITE_KEEP_EVERY"
COUNT_OBJECTS_ENV = "GRADGUARD_LSUITE_COUNT_OBJECTS"

_state: dict[str, Any] = {
    "tests": {},
    "warnings": [],
    "collected": 0,
    "selected": 0,
    "deselected": [],
    "session_s": None,
    "watch": None,
}
_started: list[float] = []


def _is_gradguard_warning(category: type) -> bool:
    return any(
        getattr(cls, "__module__", "").split(".")[0] == "gradguard" and cls.__name__ == "GradGuardWarning"
        for cls in getattr(category, "__mro__", ())
    )


def _record(message: warnings.WarningMessage, when: str, nodeid: str) -> None:
    if not _is_gradguard_warning(message.category):
        return
    _state["warnings"].append(
        {
            "nodeid": nodeid,
            "when": when,
            "category": message.category.__name__,
            "filename": str(message.filename),
            "lineno": message.lineno,
            "message": str(message.message),
        }
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    _state["collected"] = len(items) + len(_state["deselected"])  # pytest's --deselect runs before this hook
    keep_every = int(os.environ.get(KEEP_EVERY_ENV, "1") or "1")
    if keep_every > 1:
        kept = items[::keep_every]
        dropped = [item for i, item in enumerate(items) if i % keep_every]
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    _state["selected"] = len(items)


def pytest_deselected(items: list[pytest.Item]) -> None:
    _state["deselected"].extend(item.nodeid for item in items)


def pytest_sessionstart(session: pytest.Session) -> None:
    _started.append(time.perf_counter())


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _started:
        _state["session_s"] = time.perf_counter() - _started[0]


def pytest_warning_recorded(warning_message: warnings.WarningMessage, when: str, nodeid: str, location: Any) -> None:
    _record(warning_message, when, nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    test = _state["tests"].setdefault(report.nodeid, {"outcome": "passed", "durations": {}})
    test["durations"][report.when] = round(report.duration, 4)
    xfail = hasattr(report, "wasxfail")
    if report.failed:
        test["outcome"] = "failed" if report.when == "call" else "error"  # error: in setup or teardown
    elif report.skipped and report.when in ("setup", "call"):
        test["outcome"] = "xfailed" if xfail else "skipped"
    elif report.when == "call" and xfail:
        test["outcome"] = "xpassed"
    if report.when == "teardown" and os.environ.get(COUNT_OBJECTS_ENV) == "1":
        test["live_objects"] = len(gc.get_objects())  # what an audit would search, after this test


def _watch_counts(config: pytest.Config) -> dict[str, Any] | None:
    plugin = sys.modules.get("gradguard_pytest")
    key = getattr(plugin, "_WATCH_KEY", None)
    if key is None:
        return None
    try:
        watcher = config.stash[key].watcher
        return {
            "boundaries": int(watcher.boundaries),
            "audits": int(watcher.audits),
            "audit_seconds": round(float(watcher.audit_seconds), 3),
        }
    except Exception:  # a private detail of the plugin: absent or changed means no counts
        return None


@pytest.hookimpl(wrapper=True)
def pytest_unconfigure(config: pytest.Config) -> Generator[None, None, None]:
    _state["watch"] = _watch_counts(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return (yield)
        finally:
            for message in caught:
                _record(message, "unconfigure", "")
            _write()


def _write() -> None:
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    modules = {}
    for name in ("gradguard", "gradguard_pytest"):
        module = sys.modules.get(name)
        modules[name] = getattr(module, "__file__", None) if module is not None else None
    with open(path, "w") as f:
        json.dump({**_state, "modules": modules}, f, indent=1)
