"""The gradguard pytest plugin (registered through the ``pytest11`` entry point).

It lives outside the ``gradguard`` package so that loading it imports neither gradguard nor torch.

* ``--gradguard=MODE`` runs the whole session inside ``gradguard.enforce(mode=MODE)``: with
  ``--gradguard=raise`` every guarded store and engine adapter becomes a failure point.
* ``@pytest.mark.gradguard(mode="raise", engines="auto", stores=None)`` does the same for one test.
* The ``gradguard_probe`` fixture is a :class:`gradguard.testing.MemoryProbe` (CPU) around the test.

Without the option, the marker or the fixture nothing changes, and gradguard (and torch) is not
even imported.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

_SESSION_KEY = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("gradguard").addoption(
        "--gradguard",
        metavar="MODE",
        default=None,
        help="run the session inside gradguard.enforce(mode=MODE): off, detach, warn, raise",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gradguard(mode=None, engines='auto', stores=None): run this test inside gradguard.enforce(...)"
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


def pytest_unconfigure(config: pytest.Config) -> None:
    scope = config.stash.get(_SESSION_KEY, None)
    if scope is not None:
        scope.__exit__(None, None, None)
        del config.stash[_SESSION_KEY]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    marker = item.get_closest_marker("gradguard")
    if marker is None:
        return (yield)
    import gradguard

    if marker.args:
        raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.gradguard(mode=...), with keywords only")
    with gradguard.enforce(**marker.kwargs):
        return (yield)


@pytest.fixture
def gradguard_probe() -> Iterator[Any]:
    """A CPU :class:`gradguard.testing.MemoryProbe`, entered for the test: call ``.step()`` per iteration."""
    from gradguard.testing import MemoryProbe

    with MemoryProbe() as probe:
        yield probe
