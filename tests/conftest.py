"""What every test shares: a clean gradguard state, checked on the way out, and engine imports.

``_isolated`` (autouse) starts each test with no ``GRADGUARD`` or ``GRADGUARD_AUDIT``, no ``set_mode``,
fresh stats and no enforce scope, and fails the test if it leaves an install, a patch or a mode behind.
Helpers used across files live in ``_helpers.py`` (``require_engine`` among them).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import gradguard
from gradguard._policy import modes as _policy
from gradguard._scope import enforce as _enforce
from gradguard.engines import _patch


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The default mode, nothing installed, fresh stats; and nothing left behind afterwards."""
    monkeypatch.delenv("GRADGUARD", raising=False)
    monkeypatch.delenv("GRADGUARD_AUDIT", raising=False)  # else every enforce() of the suite would start a watch
    _policy._reload_env()
    gradguard.set_mode(None)
    gradguard.reset_stats()
    assert _enforce.installed() == {}, "a previous test left an enforce() install behind"
    patched = _patch.installed()
    assert _policy.mode_source() == ("detach", "default"), "a previous test left a mode behind"
    yield
    leftover_installs = _enforce.installed()
    leftover_patches = _patch.installed() - patched
    gradguard.set_mode(None)
    gradguard.reset_stats()
    monkeypatch.undo()
    _policy._reload_env()
    assert leftover_installs == {}, f"the test left enforce() installs behind: {leftover_installs}"
    assert leftover_patches == set(), f"the test left patches behind: {leftover_patches}"
    assert _scope_left() is None, f"the test left an enforce() scope: {_scope_left()}"


def _scope_left() -> str | None:
    """The mode of an enforce() scope still entered in this context, if any."""
    return _policy._enforced.get()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """What tests/test_docs.py ran and excluded, when it ran."""
    import sys

    docs = sys.modules.get("test_docs")
    lines = docs.summary_lines() if docs is not None else []
    if lines:
        terminalreporter.section("docs examples")
        for line in lines:
            terminalreporter.write_line(line)
