"""The fix an audit offers, per kind of holder, in the user's terms: the program's state (detach first,
a guard named as the net), a frame local, a library's state reached from the user's object or from a
method the user overrides (the user's line and the change there), a library's state no change of the
user's can release (upgrade), a known leak (the release that fixed it); and following the first fix
makes a ``raise``-mode watch pass where following the guard does not."""

from __future__ import annotations

import importlib
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from _tables import last_fix
from torch import nn

import gradguard
from gradguard._heap import installed
from gradguard._heap.known_leaks import KnownLeak

NET = ", which detaches what is stored, or refuses it in raise mode"

LIBRARY = textwrap.dedent(
    '''
    """A stand-in for an installed package: a metric and a loop that keep what they get with its graph."""
    import torch
    from torch import nn

    __version__ = "1.2.3"


    class SumOfSquares(nn.Module):
        def __init__(self):
            super().__init__()
            self.total = torch.tensor(0.0)

        def update(self, preds):
            self.total = self.total + preds.pow(2).sum()


    class Module:
        def training_step(self, x):
            raise NotImplementedError


    class Loop:
        def __init__(self):
            self.outputs = []

        def run(self, module, batches):
            for x in batches:
                self.outputs.append(module.training_step(x))


    class Logger:
        def __init__(self):
            self.metrics = {}

        def log_loss(self, model, x):
            self.metrics["loss"] = model(x).pow(2).mean()
    '''
)


@pytest.fixture
def fakelib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``fakelib`` 1.2.3, imported from a folder gradguard takes for a ``site-packages``, with three
    known leaks of its own (fixed in 1.2.4): one the user can fix on what they hand it, one through the
    method they override, one only upgrading fixes."""
    site = tmp_path / "site-packages"
    (site / "fakelib").mkdir(parents=True)
    (site / "fakelib" / "__init__.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(installed, "library_dirs", lambda: (str(site.resolve()) + "/",))
    common = dict(package="fakelib", distribution="fakelib", affected="==1.2.3", fixed="1.2.4",
                  reference="https://example.org/fakelib/1.2.4", what="keeps it")  # fmt: skip
    table = (
        KnownLeak(owner="fakelib.SumOfSquares", attribute="total", hook=None, remedy="m.update(p.detach())", **common),
        KnownLeak(
            owner="fakelib.Loop",
            attribute="outputs",
            hook="fakelib.Module.training_step",
            remedy="return x.detach()",
            **common,
        ),  # fmt: skip
        KnownLeak(owner="fakelib.Logger", attribute="metrics", hook=None, remedy=None, **common),
    )
    monkeypatch.setattr(installed, "KNOWN_LEAKS", table)
    installed.library_of_module.cache_clear()
    installed.package_version.cache_clear()
    module = importlib.import_module("fakelib")
    yield module
    sys.modules.pop("fakelib", None)
    installed.library_of_module.cache_clear()
    installed.package_version.cache_clear()


def _fix(fragment: str) -> str:
    [entry] = [e for e in gradguard.audit() if fragment in e.holder]
    return entry.fix


KEPT: dict[str, object] = {}


@pytest.fixture(autouse=True)
def _clear() -> Iterator[None]:
    yield
    KEPT.clear()


def test_the_programs_own_list_is_told_to_detach_first_and_offered_the_guard_as_the_net() -> None:
    model = nn.Linear(4, 1)
    KEPT["history"] = [model(torch.randn(2, 4)).sum() for _ in range(2)]
    assert _fix("KEPT['history']") == (
        f"detach before storing into KEPT['history'][0] (in {__name__}): t.detach() or t.item(); "
        f"or KEPT['history'] = gradguard.guard([]){NET}"
    )


def test_a_frame_local_is_told_to_detach_at_its_line() -> None:
    model = nn.Linear(4, 1)
    loss_sum = model(torch.randn(2, 4)).sum()
    loss_sum = loss_sum + model(torch.randn(2, 4)).sum()
    fix = _fix(" in test_a_frame_local_is_told_to_detach_at_its_line: loss_sum")
    assert re.fullmatch(
        r"detach before storing into loss_sum \(in tests/watch/test_fix_texts\.py:\d+ in "
        r"test_a_frame_local_is_told_to_detach_at_its_line\): t\.detach\(\) or t\.item\(\)",
        fix,
    ), fix
    del loss_sum


def _train(store: list[object], detach: bool) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = lambda r: "test_fix_texts" not in r.path  # noqa: E731 - what other tests of this worker left is theirs
    with gradguard.watch(every=1, mode="raise", ignore=mine):
        for _ in range(4):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            store.append({"loss": loss.detach() if detach else loss})
            opt.step()
            opt.zero_grad()


def test_following_the_first_fix_passes_raise_mode_and_the_net_refuses_there() -> None:
    """The fix a user applies to their code is the detach: in ``raise`` mode the guarded store refuses
    the record it would have detached, so following the guard alone still fails a CI run."""
    with pytest.raises(gradguard.GraphRetentionError) as caught:
        _train([], detach=False)
    fix = last_fix(str(caught.value))
    assert fix.startswith("detach before storing into store[0]['loss']") and fix.endswith(NET)
    del caught  # its traceback keeps the frames of that run, and their graphs (3.13's frames keep their locals)
    previous = gradguard.set_mode("raise")  # as under `gradguard run --mode raise`: stores refuse too
    try:
        _train([], detach=True)  # the first fix: passes
        with pytest.raises(gradguard.GradGuardError):  # the net, in raise mode, refuses the record
            _train(gradguard.guard([]), detach=False)
    finally:
        gradguard.set_mode(previous)


def test_a_librarys_state_reached_through_the_users_object_names_the_change_and_the_release(
    fakelib: ModuleType,
) -> None:
    KEPT["mse"] = metric = fakelib.SumOfSquares()
    metric.update(nn.Linear(4, 1)(torch.randn(3, 4)))
    assert _fix("KEPT['mse']") == (
        "fakelib 1.2.3 keeps it in fakelib.SumOfSquares (its state, not your program's); detach what reaches your "
        "KEPT['mse']: m.update(p.detach()); or upgrade to fakelib 1.2.4, which fixed this known leak "
        "(https://example.org/fakelib/1.2.4)"
    )


def test_a_librarys_state_fed_by_a_method_the_user_overrides_names_that_method_and_its_line(
    fakelib: ModuleType,
) -> None:
    model = nn.Linear(4, 1)

    class MyModule(fakelib.Module):  # type: ignore[misc, name-defined]
        def training_step(self, x: torch.Tensor) -> torch.Tensor:
            return model(x).sum()

    KEPT["loop"] = loop = fakelib.Loop()
    loop.run(MyModule(), [torch.randn(2, 4) for _ in range(2)])
    fix = _fix("KEPT['loop']")
    line = MyModule.training_step.__code__.co_firstlineno
    assert fix == (
        "fakelib 1.2.3 keeps it in fakelib.Loop (its state, not your program's); in your "
        f"test_a_librarys_state_fed_by_a_method_the_user_overrides_names_that_method_and_its_line.<locals>.MyModule"
        f".training_step (tests/watch/test_fix_texts.py:{line}): return x.detach(); or upgrade to fakelib 1.2.4, "
        "which fixed this known leak (https://example.org/fakelib/1.2.4)"
    )


def test_a_librarys_state_no_change_of_the_users_releases_says_so_and_to_upgrade(fakelib: ModuleType) -> None:
    KEPT["logger"] = logger = fakelib.Logger()
    logger.log_loss(nn.Linear(4, 1), torch.randn(2, 4))
    assert _fix("KEPT['logger']") == (
        "fakelib 1.2.3 keeps it in fakelib.Logger (its state, not your program's); it computes that value itself, "
        "nothing in your code can detach it: upgrade to fakelib 1.2.4, which fixed this known leak "
        "(https://example.org/fakelib/1.2.4)"
    )


def test_an_unknown_librarys_state_names_the_users_object_and_upstream(fakelib: ModuleType) -> None:
    KEPT["mse"] = metric = fakelib.SumOfSquares()
    metric.update(nn.Linear(4, 1)(torch.randn(3, 4)))
    installed.package_version.cache_clear()
    sys.modules["fakelib"].__version__ = "1.2.4"  # the fixed release: no known leak matches
    assert _fix("KEPT['mse']") == (
        "fakelib 1.2.4 keeps it in fakelib.SumOfSquares (its state, not your program's); it reached that state "
        "through your KEPT['mse']: detach what you hand it (t.detach() or t.item()); else upgrade fakelib or "
        "report it upstream"
    )
