"""The pytest plugin's watch: ``--gradguard-audit=N`` for the session, ``@pytest.mark.gradguard(audit=N)`` for a test.

The runs that train go through a subprocess: every audit sees the whole process, so an in-process
inner run would also see what the outer session keeps.
"""

from __future__ import annotations

import re

import pytest
from _tables import flat

from gradguard._scope import enforce as _enforce

pytest_plugins = ["pytester"]

INNER = """
import pytest
import torch

KEPT = []


def train(keep):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        keep(loss)
        opt.step()
        opt.zero_grad()


def test_clean():
    train(lambda loss: None)


def test_leaky():
    train(KEPT.append)


@pytest.mark.gradguard(audit=1, engines="none")
def test_marked_leaky():
    train(KEPT.append)


@pytest.mark.gradguard(audit=1, mode="warn", engines="none")
def test_marked_warn():
    with pytest.warns(Warning, match="keeps an autograd graph across step boundaries"):
        train(KEPT.append)


@pytest.mark.gradguard(audit="sometimes")
def test_marked_bad_audit():
    pass


@pytest.mark.gradguard(audit=0)
def test_marked_zero_audit():
    pass


@pytest.mark.gradguard(every=1)
def test_marked_unknown_argument():
    pass
"""


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # the summary lines stay whole
    monkeypatch.delenv("GRADGUARD_AUDIT", raising=False)


def _failed(result: pytest.RunResult) -> dict[str, str]:
    return {line.split(" ")[1]: line.split(" - ", 1)[-1] for line in result.stdout.lines if line.startswith("FAILED ")}


def test_the_marker_watches_one_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "default")
    result.assert_outcomes(passed=3, failed=4)
    failed = _failed(result)
    assert sorted(failed) == [
        "test_inner.py::test_marked_bad_audit",
        "test_inner.py::test_marked_leaky",
        "test_inner.py::test_marked_unknown_argument",
        "test_inner.py::test_marked_zero_audit",
    ]
    assert failed["test_inner.py::test_marked_leaky"].startswith("gradguard.GraphRetentionError: gradguard: 1 holder")
    # the marker's own argument is named, never the watch's `every`
    assert "audit='sometimes' is not accepted; accepted: a positive" in failed["test_inner.py::test_marked_bad_audit"]
    assert (
        "audit=0 is not accepted; accepted: a positive whole number" in failed["test_inner.py::test_marked_zero_audit"]
    )
    assert "every" not in failed["test_inner.py::test_marked_zero_audit"].split("accepted")[0]
    assert (
        "@pytest.mark.gradguard does not take 'every'; it takes mode, engines, stores, audit"
        in (failed["test_inner.py::test_marked_unknown_argument"])
    )


def test_the_option_watches_the_session_in_raise_mode(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gradguard-audit=1", "-k", "clean or leaky")
    result.assert_outcomes(passed=1, failed=2)
    failed = _failed(result)
    assert sorted(failed) == ["test_inner.py::test_leaky", "test_inner.py::test_marked_leaky"]
    assert all(reason.startswith("gradguard.GraphRetentionError: ") for reason in failed.values())
    # test_leaky's second step: last step's loss and this step's, both in the global list
    assert "test_inner:KEPT[*]: 2 tensors, 0 B of tensors and " in result.stdout.str()
    said = r"graph nodes pinned, alive for 1\s+(E\s+)?step boundary\s+(E\s+)?its graph is dead"
    assert re.search(said, result.stdout.str())


def test_a_bad_option_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest("--gradguard-audit=0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gradguard-audit='0' is not accepted; accepted: a positive whole number*"])
    assert "every" not in result.stderr.str().split("accepted")[0]
    assert _enforce.installed() == {}


def test_help_lists_the_option_and_the_marker_argument(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["*--gradguard-audit=N*gradguard.watch(every=N, mode='raise')*"])
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.gradguard(mode=None, engines='auto', stores=None, audit=None)*"])


OUTLIVED = """
import pytest
import torch
from unittest import mock

HISTORY = []


class Model(torch.nn.Module):
    _losses = []  # a class attribute: shared by every test that makes a Model

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def step(self, opt):
        loss = self.layer(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        return loss


@pytest.fixture(scope="module")
def cached():
    return torch.nn.Linear(4, 1)(torch.ones(1, 4))  # a module fixture's graph: the fixture's, not a test's


def test_clean(cached):
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model.step(opt)


def test_class_level_list(cached):
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    Model._losses.append(model.step(opt))


def test_mock_history():
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spy = mock.MagicMock(wraps=lambda loss: None)
    HISTORY.append(spy)
    spy(model.step(opt))


def test_failing_keeps_its_traceback():
    loss = torch.ones(2, requires_grad=True) * 2
    assert loss is None
"""


def test_a_graph_a_test_made_and_left_alive_is_reported_at_its_end(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_outlived=OUTLIVED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gradguard-audit=auto", "--gradguard=warn")
    result.assert_outcomes(passed=3, failed=1)  # the failing test fails on its own: no check at its end
    out = result.stdout.str()
    after = "keeps an autograd graph after test test_outlived.py::test_class_level_list"
    assert f"test_outlived:Model._losses[0] {after}" in flat(out)
    assert "test_outlived:HISTORY[0]._mock_call_args_list" in out
    assert "test_clean" not in out.split("warnings summary")[-1]  # the module fixture's graph is the fixture's
    raised = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--gradguard-audit=auto", "-k", "class_level")
    raised.assert_outcomes(passed=1, errors=1)  # raise: the test errors in its teardown
    assert "gradguard.GraphRetentionError" in raised.stdout.str()
