"""The gradguard pytest plugin (registered through the ``pytest11`` entry point).

It lives outside the ``gradguard`` package so that loading it imports neither gradguard nor torch.

* ``--gradguard=MODE`` runs the whole session inside ``gradguard.enforce(mode=MODE)``: with
  ``--gradguard=raise`` every guarded store and engine adapter becomes a failure point.
* ``@pytest.mark.gradguard(mode="raise", engines="auto", stores=None)`` does the same for one test.
* ``--gradguard-audit=N`` (``N``: a positive whole number, or ``auto``) watches the whole session in
  ``raise`` mode (``--gradguard``'s mode when given): inside each test, ``gradguard.watch(every=N)``
  at its optimizer steps (``auto``: as ``gradguard.watch`` schedules it); and at each
  test's end, after its teardown, one look at the heap for graphs the test made that are still
  alive: nothing a test made should outlive it. A graph that does fails that test (``raise``: an
  error in its teardown), or warns at the test's line (``warn``).
* ``@pytest.mark.gradguard(audit=N)`` does the same for one test (inside the marker's
  ``enforce(...)``; the mode is the marker's ``mode`` when given, else ``raise``). A test's marker
  wins over the session's option: the session's watch steps aside while that test runs.
* The ``gradguard_probe`` fixture is a :class:`gradguard.testing.MemoryProbe` (CPU) around the test.

A test whose call failed is not checked at its end: its traceback keeps its locals.

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
_TEST_KEY = pytest.StashKey[Any]()  # this test's watch (the marker's, or the session's) and its mark
_FAILED_KEY = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--gradguard=MODE`` and ``--gradguard-audit=N``."""
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
        "optimizer step, or the test that made it, fails the test (N: a positive whole number, or auto)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """The marker; with an option, the session's scopes, each option checked first (a bad one is a usage error)."""
    config.addinivalue_line(
        "markers",
        "gradguard(mode=None, engines='auto', stores=None, audit=None): run this test inside "
        "gradguard.enforce(...); audit=N: and inside gradguard.watch(every=N, mode=mode or 'raise'), "
        "and fail it when a graph it made outlives it",
    )
    mode = config.getoption("--gradguard")
    every = config.getoption("--gradguard-audit")
    if mode is None and every is None:
        return
    from gradguard import GradGuardError
    from gradguard._policy import validate
    from gradguard._policy.modes import normalize_mode

    try:  # both checked (without torch) before either is entered, each named as the user spelled it
        mode = None if mode is None else normalize_mode(mode, what="--gradguard")
        every = None if every is None else validate.every(every, what="--gradguard-audit")
    except GradGuardError as exc:
        raise pytest.UsageError(str(exc)) from None
    import gradguard

    if mode is not None:
        scope = gradguard.enforce(mode=mode)
        scope.__enter__()
        config.stash[_SESSION_KEY] = scope
    if every is not None:
        watching = gradguard.watch(every=every, mode=mode or "raise")
        watching.__enter__()
        config.stash[_WATCH_KEY] = watching


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's scopes, left."""
    _unconfigure(config)


def _unconfigure(config: pytest.Config) -> None:
    for key in (_WATCH_KEY, _SESSION_KEY):
        scope = config.stash.get(key, None)
        if scope is not None:
            scope.__exit__(None, None, None)
            del config.stash[key]


_MARKER_ARGUMENTS = ("mode", "engines", "stores", "audit")


def _marker(item: pytest.Item) -> tuple[dict[str, Any], Any] | None:
    """The test's gradguard marker: ``(enforce's keywords, audit)``, or ``None`` without one."""
    marker = item.get_closest_marker("gradguard")
    if marker is None:
        return None
    if marker.args:
        raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.gradguard(mode=...), with keywords only")
    unknown = sorted(set(marker.kwargs) - set(_MARKER_ARGUMENTS))
    if unknown:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.gradguard does not take {', '.join(map(repr, unknown))}; it takes "
            f"{', '.join(_MARKER_ARGUMENTS)}"
        )
    kwargs = dict(marker.kwargs)
    return kwargs, kwargs.pop("audit", None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """After the test's fixtures: its watch (the marker's, else the session's) and the mark it is judged from."""
    result = yield
    marker = item.get_closest_marker("gradguard")
    audit = None if marker is None or marker.args else marker.kwargs.get("audit")
    watching: Any = item.config.stash.get(_WATCH_KEY, None)
    if audit is not None:
        import gradguard
        from gradguard._policy import validate

        try:  # the marker's own argument is named: audit=0, not the watch's every=0
            every = validate.every(audit, what="audit")
            watching = gradguard.watch(every=every, mode=marker.kwargs.get("mode") or "raise")  # type: ignore[union-attr]
        except gradguard.GradGuardError as exc:
            item.stash[_TEST_KEY] = (exc, None)  # the test's call fails with it, as any bad marker argument
            return result
    if watching is not None:  # after the fixtures: what they made belongs to them, not to the test
        item.stash[_TEST_KEY] = (watching, watching.watcher.mark())
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """The test's call inside the marker's scopes; the session's watch steps aside for a marker's own."""
    marked = _marker(item)
    if marked is None:
        return (yield)
    import gradguard

    kwargs, audit = marked
    if audit is None:
        with gradguard.enforce(**kwargs):
            return (yield)
    watching, mark = item.stash[_TEST_KEY]
    if mark is None:
        raise watching
    with contextlib.ExitStack() as scopes:
        session = item.config.stash.get(_WATCH_KEY, None)
        if session is not None:  # the test's own watch replaces the session's for its duration
            session.__exit__(None, None, None)
            scopes.callback(session.__enter__)
        scopes.enter_context(gradguard.enforce(audit=0, **kwargs))  # this watch, not GRADGUARD_AUDIT's
        scopes.enter_context(watching)
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    """Remembers a failed call: such a test is not checked at its end (its traceback keeps its locals)."""
    report: Any = yield
    if call.when == "call" and report.failed:
        item.stash[_FAILED_KEY] = True
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the teardown: the graphs the test made that are still alive fail it (or warn)."""
    result = yield
    watching: Any
    watching, mark = item.stash.get(_TEST_KEY, (None, None))
    if mark is not None and not item.stash.get(_FAILED_KEY, False):
        del item.stash[_TEST_KEY]
        path, line, _ = item.location
        where = (str(item.config.rootpath / path), (line or 0) + 1)
        watching.watcher.outlived(mark, f"test {item.nodeid}", where)
    return result


@pytest.fixture
def gradguard_probe() -> Iterator[Any]:
    """A CPU :class:`gradguard.testing.MemoryProbe`, entered for the test: call ``.step()`` per iteration.

    Yields:
        The probe.
    """
    from gradguard.testing import MemoryProbe

    with MemoryProbe() as probe:
        yield probe
