"""What every test shares: a clean gradguard state, checked on the way out, and engine imports.

``_isolated`` (autouse) starts each test with no ``GRADGUARD`` or ``GRADGUARD_AUDIT``, no ``set_mode``,
fresh stats, no enforce scope and torch's generator seeded, and fails the test if it leaves an install,
a patch, a mode, a global optimizer hook (a watch not closed) or a named root behind.
Helpers used across files live in ``_helpers.py`` (``require_engine`` among them).

The integration tests run last. Under pytest-xdist (``-n auto``; ``--dist worksteal`` is in the pytest
settings) a module's tests may run in several workers: a module-scoped fixture whose result is data
(a subprocess's, a spawned world's) computes it once per run through ``_helpers.once_per_run``.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from pathlib import Path

import _helpers
import pytest
import torch

import gradguard
from gradguard import _compat
from gradguard._guards import patch as _patch
from gradguard._heap import roots as _roots
from gradguard._policy import modes as _policy
from gradguard._scope import enforce as _enforce
from gradguard._watch import backwards as _backwards


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The default mode, nothing installed, fresh stats; and nothing left behind afterwards."""
    monkeypatch.delenv("GRADGUARD", raising=False)
    monkeypatch.delenv("GRADGUARD_AUDIT", raising=False)  # else every enforce() of the suite would start a watch
    _policy.reload_env()
    gradguard.set_mode(None)
    gradguard.reset_stats()
    assert _enforce.installed() == {}, "a previous test left an enforce() install behind"
    patched = _patch.installed()
    assert _policy.mode_source() == ("detach", "default"), "a previous test left a mode behind"
    hooks, providers, named = _optimizer_hooks(), list(_roots._providers), set(_roots._named)
    torch.manual_seed(0)  # the same draws whatever ran before in this process (xdist shares tests out)
    # Before torch 2.13 a saved-tensor hook set by an earlier test would put every later one in the
    # degraded mode (gradguard._compat): each test starts as a program that has set none.
    monkeypatch.setattr(_compat, "_hooks_seen", False)
    listening = _backwards.listening()
    yield
    if _backwards.listening() > listening:
        # A watcher the test drove by hand and dropped, kept alive only by a cycle (an exception's traceback
        # holds its frames): collected now, it stops listening to the next tests' backwards.
        gc.collect()
    leftover_installs = _enforce.installed()
    leftover_patches = _patch.installed() - patched
    leftover_hooks = {kind: n - hooks[kind] for kind, n in _optimizer_hooks().items() if n != hooks[kind]}
    leftover_providers = [p for p in _roots._providers if p not in providers]
    leftover_named = [
        root for key, root in list(_roots._named.items()) if key not in named and (root._ref is None or root._ref())
    ]
    gradguard.set_mode(None)
    gradguard.reset_stats()
    monkeypatch.undo()
    _policy.reload_env()
    assert leftover_installs == {}, f"the test left enforce() installs behind: {leftover_installs}"
    assert leftover_patches == set(), f"the test left patches behind: {leftover_patches}"
    assert _scope_left() is None, f"the test left an enforce() scope: {_scope_left()}"
    assert leftover_hooks == {}, f"the test left torch's global optimizer hooks behind: {leftover_hooks}"
    assert leftover_providers == [], f"the test left root providers behind: {leftover_providers}"
    assert leftover_named == [], f"the test left named roots behind: {leftover_named}"


def _optimizer_hooks() -> dict[str, int]:
    """How many global optimizer step hooks torch holds (the watch registers a post hook)."""
    from torch.optim import optimizer

    return {
        "pre": len(optimizer._global_optimizer_pre_hooks),
        "post": len(optimizer._global_optimizer_post_hooks),
    }


def _scope_left() -> str | None:
    """The mode of an enforce() scope still entered in this context, if any."""
    return _policy._enforced.get()


TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The integration tests last, each part in the order collected (the same in every xdist worker).

    Engines imported in-process grow the heap fourfold (megatron-core alone adds some 250k objects), and
    every ``gc.collect()`` and heap audit of a later test in that process walks all of it: run first,
    the tests of the watch audit a small heap.
    """
    items.sort(key=_is_integration)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _helpers._started.append(item.nodeid)  # for _helpers.previous_test()


def _is_integration(item: pytest.Item) -> bool:
    return item.get_closest_marker("integration") is not None or TESTS / "integration" in item.path.parents


# What tests/test_docs.py ran, from this process or, under xdist, from every worker.
_DOCS_SUMMARY: dict[str, list[str]] = {}


def _add_docs_summary(summary: dict[str, list[str]]) -> None:
    for key, entries in summary.items():
        _DOCS_SUMMARY.setdefault(key, []).extend(entries)


def pytest_sessionfinish(session: pytest.Session) -> None:
    import sys

    docs = sys.modules.get("test_docs")
    if docs is None:
        return
    workeroutput = getattr(session.config, "workeroutput", None)  # set in an xdist worker
    if workeroutput is not None:
        workeroutput["docs_summary"] = json.dumps(docs.SUMMARY)
    else:
        _add_docs_summary(docs.SUMMARY)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """An xdist worker finished: keep what its docs tests ran, for the summary."""
    summary = getattr(node, "workeroutput", {}).get("docs_summary")
    if summary is not None:
        _add_docs_summary(json.loads(summary))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """What tests/test_docs.py ran and excluded, when it ran."""
    summary = _DOCS_SUMMARY
    if not any(summary.values()):
        return
    terminalreporter.section("docs examples")
    terminalreporter.write_line(
        f"docs examples: {len(summary.get('python', []))} python blocks run, "
        f"{len(summary.get('commands', []))} shell commands run, "
        f"{len(summary.get('files', []))} blocks written as files for them, "
        f"{len(summary.get('excluded', []))} blocks excluded:"
    )
    for entry in summary.get("excluded", []):
        terminalreporter.write_line(f"  excluded {entry}")
