"""The gradguard pytest plugin (registered through the ``pytest11`` entry point).

It lives outside the ``gradguard`` package so that loading it imports neither gradguard nor torch.

* ``--gradguard=MODE`` runs the whole session inside ``gradguard.enforce(mode=MODE)``: with
  ``--gradguard=raise`` every guarded store and engine adapter becomes a failure point.
* ``@pytest.mark.gradguard(mode="raise", engines="auto", stores=None)`` does the same for one test.
* ``--gradguard-audit=N`` runs the whole session inside ``gradguard.watch(every=N, mode="raise")``:
  a graph that outlives an optimizer step fails the test whose ``optimizer.step()`` found it.
  ``N`` is a positive whole number or ``auto``. The watch's mode is ``--gradguard``'s when given.
* ``@pytest.mark.gradguard(audit=N)`` does the same for one test (inside the marker's
  ``enforce(...)``; the watch's mode is the marker's ``mode`` when given, else ``raise``). A test's
  marker wins over the session's option: the session's watch steps aside while that test runs.
* The ``gradguard_probe`` fixture is a :class:`gradguard.testing.MemoryProbe` (CPU) around the test.

Without an option, the marker or the fixture nothing changes, and gradguard (and torch) is not
even imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

_SESSION_KEY = pytest.StashKey[Any]()
_WATCH_KEY = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("gradguard").addoption(
        "--gradguard",
        metavar="MODE",
        default=None,
        help="run the session inside gradguard.enforce(mode=MODE): off, detach, warn, raise",
    )
    parser.getgroup("gradguard").addoption(
        "--gradguard-audit",
        metavar="N",
        default=None,
        help="run the session inside gradguard.watch(every=N, mode='raise'): a graph that outlives an "
        "optimizer step fails the test (N: a positive whole number, or auto)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "gradguard(mode=None, engines='auto', stores=None, audit=None): run this test inside "
        "gradguard.enforce(...); audit=N: and inside gradguard.watch(every=N, mode=mode or 'raise')",
    )
    mode = config.getoption("--gradguard")
    if mode is not None:
        import gradguard

        try:
            scope = gradguard.enforce(mode=mode)
        except gradguard.GradGuardError as exc:
            raise pytest.UsageError(f"--gradguard: {exc}") from None
        scope.__enter__()
        config.stash[_SESSION_KEY] = scope
    every = config.getoption("--gradguard-audit")
    if every is not None:
        import gradguard

        try:
            watching = gradguard.watch(every=every, mode=mode or "raise")
        except gradguard.GradGuardError as exc:
            _unconfigure(config)
            raise pytest.UsageError(f"--gradguard-audit: {exc}") from None
        watching.__enter__()
        config.stash[_WATCH_KEY] = watching


def pytest_unconfigure(config: pytest.Config) -> None:
    _unconfigure(config)


def _unconfigure(config: pytest.Config) -> None:
    for key in (_WATCH_KEY, _SESSION_KEY):
        scope = config.stash.get(key, None)
        if scope is not None:
            scope.__exit__(None, None, None)
            del config.stash[key]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    marker = item.get_closest_marker("gradguard")
    if marker is None:
        return (yield)
    import gradguard

    if marker.args:
        raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.gradguard(mode=...), with keywords only")
    kwargs = dict(marker.kwargs)
    audit = kwargs.pop("audit", None)
    if audit is None:
        with gradguard.enforce(**kwargs):
            return (yield)
    # The watch is made first: a bad audit fails the test before anything is entered.
    watching = gradguard.watch(every=audit, mode=kwargs.get("mode") or "raise")
    with contextlib.ExitStack() as scopes:
        session = item.config.stash.get(_WATCH_KEY, None)
        if session is not None:  # the test's own watch replaces the session's for its duration
            session.__exit__(None, None, None)
            scopes.callback(session.__enter__)
        scopes.enter_context(gradguard.enforce(audit=0, **kwargs))  # this watch, not GRADGUARD_AUDIT's
        scopes.enter_context(watching)
        return (yield)


@pytest.fixture
def gradguard_probe() -> Iterator[Any]:
    """A CPU :class:`gradguard.testing.MemoryProbe`, entered for the test: call ``.step()`` per iteration."""
    from gradguard.testing import MemoryProbe

    with MemoryProbe() as probe:
        yield probe
