"""The gradguard pytest plugin, driven through ``pytester``.

The plugin is active through its ``pytest11`` entry point (gradguard is installed in the venv), so
the inner runs pick it up like any user's suite would. Most runs are in-process (fast, torch is
already imported); each one is checked to leave no enforce scope or installed patch behind. The
import check runs in a subprocess, where the outer process's imports cannot hide anything.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections.abc import Iterator

import pytest
import torch

import gradguard
from gradguard._policy import modes as _policy
from gradguard._scope import enforce as _enforce
from gradguard.testing import MemoryProbe

pytest_plugins = ["pytester"]

USERLIB = '''
import torch


def record():
    x = torch.ones(3, requires_grad=True)
    return {"model_output": {"log_probs": (x * 2).log_softmax(-1)}, "loss": 1.0}


def train(store):
    """Plain user code: the user's own loop keeps one record per micro-batch in ``store``."""
    for _ in range(2):
        store.append(record())
    return store
'''

INNER = """
import pytest
import torch

import gradguard
import userlib
from gradguard._policy import modes as _policy


def test_report_mode():
    mode, source = _policy.mode_source()
    print(f"SESSION-MODE={mode}/{source}")


def test_guarded_store():
    store = gradguard.guard([])
    store.append(userlib.record())
    assert store[0]["model_output"]["log_probs"].grad_fn is None


def test_unmarked_user_code():
    store = userlib.train([])
    assert store[0]["model_output"]["log_probs"].grad_fn is not None  # nothing guards a plain list


@pytest.mark.gradguard(mode="raise", engines="none", stores={"userlib:train": "store"})
def test_marked_user_code():
    userlib.train([])


@pytest.mark.gradguard(mode="raise")
def test_marked_guarded_store():
    store = gradguard.guard([])
    store.append(userlib.record())


@pytest.mark.gradguard(mode="off")
def test_marked_off():
    store = gradguard.guard([])
    store.append(userlib.record())
    assert store[0]["model_output"]["log_probs"].grad_fn is not None


def test_probe(gradguard_probe):
    kept = []
    for _ in range(4):
        kept.append(torch.zeros(1024))  # 4096 bytes kept per iteration
        gradguard_probe.step()
    assert gradguard_probe.growth_per_step == 4096
    gradguard_probe.assert_growth_below(4096)
    with pytest.raises(AssertionError, match="memory grew 4,096 bytes per iteration"):
        gradguard_probe.assert_growth_below(100)


def test_probe_flat(gradguard_probe):
    for _ in range(4):
        scratch = torch.zeros(1024) + 1
        gradguard_probe.step()
    gradguard_probe.assert_growth_below(0)
"""


@pytest.fixture(scope="module", autouse=True)
def _preimport_lazy_modules() -> None:
    """Import here, once, what the inner runs would import lazily.

    Entering a ``TorchDispatchMode`` (the probe) makes torch import some 900 modules, triton's native
    extension among them; hypothesis's pytest plugin imports hypothesis (seconds) at the end of a run.
    An in-process ``pytester`` run drops the modules it imported when it ends, and importing a native
    extension a second time aborts the interpreter; imported beforehand, they are kept.
    """
    with MemoryProbe() as probe:
        torch.zeros(1).add_(1)
        probe.step()
    if importlib.util.find_spec("hypothesis") is not None:
        importlib.import_module("hypothesis")


@pytest.fixture(autouse=True)
def _inner_run_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide terminal keeps the inner runs' summary lines whole. The repo's ini turns
    GraphRetentionWarning into an error here, and an in-process inner run starts from the outer
    filters: give it a fresh user's default (pytest restores the filters after the test)."""
    monkeypatch.setenv("COLUMNS", "400")
    warnings.filterwarnings("default", category=gradguard.GraphRetentionWarning)


@pytest.fixture
def suite(pytester: pytest.Pytester) -> Iterator[pytest.Pytester]:
    pytester.makepyfile(userlib=USERLIB, test_inner=INNER)
    pytester.syspathinsert()
    yield pytester
    # An in-process run must leave nothing behind: no enforce scope, no installed patch.
    assert _policy.mode_source() == ("detach", "default")
    assert _enforce.installed() == {}


def test_no_option_changes_nothing_and_marker_enforces_one_test(suite: pytest.Pytester) -> None:
    result = suite.runpytest("-s", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*SESSION-MODE=detach/default*"])
    # the default mode detaches guarded stores; the marked tests fail, and only they do
    result.assert_outcomes(passed=6, failed=2)
    result.stdout.fnmatch_lines(
        [
            "FAILED test_inner.py::test_marked_user_code - gradguard.GraphRetentionError: *",
            "FAILED test_inner.py::test_marked_guarded_store - gradguard.GraphRetentionError: *",
        ],
    )
    assert "userlib:train:store" in result.stdout.str()  # the error names the guarded store


def test_gradguard_raise_makes_every_guarded_store_a_failure_point(suite: pytest.Pytester) -> None:
    result = suite.runpytest("-s", "-p", "no:cacheprovider", "--gradguard=raise")
    result.stdout.fnmatch_lines(["*SESSION-MODE=raise/enforce*"])
    result.assert_outcomes(passed=5, failed=3)  # the marker's mode="off" wins over the session's raise
    failed = sorted(line.split(" ")[1] for line in result.stdout.lines if line.startswith("FAILED "))
    assert failed == [
        "test_inner.py::test_guarded_store",
        "test_inner.py::test_marked_guarded_store",
        "test_inner.py::test_marked_user_code",
    ]
    for line in result.stdout.lines:
        if line.startswith("FAILED "):
            assert " - gradguard.GraphRetentionError: " in line


def test_gradguard_strict_alias_and_warn_mode(suite: pytest.Pytester) -> None:
    result = suite.runpytest("-s", "-p", "no:cacheprovider", "--gradguard=strict", "-k", "report_mode")
    result.stdout.fnmatch_lines(["*SESSION-MODE=raise/enforce*"])
    result.assert_outcomes(passed=1)

    result = suite.runpytest("-p", "no:cacheprovider", "--gradguard=warn", "-k", "guarded_store and not marked")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*GraphRetentionWarning*"])


def test_marker_arguments_are_validated(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gradguard("raise")
        def test_positional():
            pass

        @pytest.mark.gradguard(mode="bogus")
        def test_bad_mode():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*use @pytest.mark.gradguard(mode=...), with keywords only*",
            "*mode='bogus' is not a gradguard mode*",
        ]
    )
    assert _enforce.installed() == {}


def test_bogus_mode_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest("--gradguard=bogus")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--gradguard='bogus' is not a gradguard mode; accepted: off/0/false, detach/on/1/true, warn, raise/strict*"]
    )
    assert "Traceback" not in result.stderr.str()
    assert _policy.mode_source() == ("detach", "default")


def test_help_lists_the_option(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        ["gradguard:", "*--gradguard=MODE*run the session inside gradguard.enforce(mode=MODE)*"]
    )
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.gradguard(mode=None, engines='auto', stores=None, audit=None)*"])


def test_plugin_does_not_import_gradguard_without_option_or_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import sys

        def test_nothing_imported(request):
            assert request.config.getoption("gradguard") is None  # the plugin is active, the option unset
            assert "gradguard" not in sys.modules
            assert "torch" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
