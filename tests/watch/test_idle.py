"""The idle looks: programs that run no backward and step no optimizer, and keep graphs that pile up.

Each loop here runs until the watch has looked twice (or a generous deadline passes), so that the test does
not depend on how fast a loaded machine schedules the look's thread.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import gradguard
from gradguard._watch import idle

DEADLINE = 60.0


def elsewhere(entry: gradguard.Retention) -> bool:
    """Graphs other tests of this process left behind: not this file's business."""
    return "test_idle" not in entry.path


def _looked(scope: Any, start: float, least: int = 2) -> bool:
    return scope.watcher.audits >= least or time.monotonic() - start > DEADLINE


def _evaluation_in_grad_mode(scope: Any) -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
    results = []
    start = time.monotonic()
    while not _looked(scope, start):
        results.append(model(torch.randn(64, 32)))  # predictions kept with their graphs
        time.sleep(0.002)


def _simulation_chaining_its_state(scope: Any) -> None:
    k = nn.Parameter(torch.tensor(0.5))
    pos, vel = torch.randn(16, 3), torch.zeros(16, 3)
    start = time.monotonic()
    while not _looked(scope, start):
        force = k * (pos.mean(0) - pos)
        vel = vel + 1e-3 * force
        pos = pos + 1e-3 * vel  # never detached: each step's graph chains onto the last
        time.sleep(0.002)


def _rollouts_without_no_grad(scope: Any) -> None:
    value = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    buffer = []
    start = time.monotonic()
    while not _looked(scope, start):
        obs = torch.randn(32, 8)
        buffer.append({"obs": obs, "ret": value(obs).squeeze(-1) * 0.99})
        time.sleep(0.002)


CASES: dict[str, tuple[Callable[[Any], None], str]] = {
    "an evaluation loop in grad mode keeping its predictions": (_evaluation_in_grad_mode, "results[*]"),
    "a simulation chaining its state": (_simulation_chaining_its_state, "pos"),
    "rollouts scored without no_grad, kept in a buffer": (_rollouts_without_no_grad, "buffer[*]['ret']"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_graphs_piling_up_with_no_backward_are_named_when_the_watch_ends(case: str) -> None:
    run, holder = CASES[case]
    scope = gradguard.watch(mode="raise", ignore=elsewhere)
    with pytest.raises(gradguard.GraphRetentionError) as raised:
        with scope:
            run(scope)
    text = " ".join(str(raised.value).split())  # the message wraps within 100 columns
    assert holder in text and "grew while no backward ran" in text, text
    assert "grew while no backward ran" in " ".join(scope.watcher.summary().split())


def test_a_first_step_whose_forwards_are_all_kept_before_their_backward_is_silent() -> None:
    """A GPipe schedule's first step: every forward kept, no backward yet, while the watch looks; then the
    backwards run: nothing is said."""
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradguard.watch(mode="raise", ignore=elsewhere) as scope:
        outputs = []
        start = time.monotonic()
        while not _looked(scope, start):
            outputs.append(model(torch.randn(64, 32)).pow(2).mean())
            time.sleep(0.002)
        for loss in reversed(outputs):
            loss.backward()
        outputs.clear()
        opt.step()
    assert scope.watcher.history() == []


def test_an_evaluation_loop_under_no_grad_is_said_to_have_nothing_to_check() -> None:
    model = nn.Linear(32, 4)
    with gradguard.watch(mode="raise", ignore=elsewhere) as scope, torch.no_grad():
        results = [model(torch.randn(64, 32)) for _ in range(200)]
    assert len(results) == 200 and scope.watcher.history() == []
    assert "no optimizer step and no backward" in scope.watcher.summary()


def test_warn_mode_warns_when_the_watch_ends() -> None:
    run, holder = CASES["an evaluation loop in grad mode keeping its predictions"]
    scope = gradguard.watch(mode="warn", ignore=elsewhere)
    with pytest.warns(gradguard.GraphRetentionWarning, match=r"results\[\*\]"), scope:
        run(scope)


@pytest.fixture(autouse=True)
def _nothing_left_looked_at() -> Iterator[None]:
    yield
    with contextlib.suppress(Exception):
        assert idle.following() == 0


def test_looks_run_in_the_main_thread_and_leave_a_tuple_it_is_building_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A census of the heap holds a reference to every object it lists: taken from another thread, it could
    hold one to a tuple the main thread is filling from a generator, whose resize then fails (``SystemError``).
    The looks run in the main thread, between two of its bytecodes, and let go of everything before it goes on."""
    import threading

    from gradguard._watch.watcher import Watcher

    threads: list[threading.Thread] = []
    look = Watcher._idle_look

    def recorded(self: Watcher) -> bool:
        threads.append(threading.current_thread())
        return look(self)

    monkeypatch.setattr(Watcher, "_idle_look", recorded)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
    kept = []
    scope = gradguard.watch(mode="warn", ignore=elsewhere)

    def rows() -> Iterator[int]:
        start = time.monotonic()
        while not _looked(scope, start):
            kept.append(model(torch.randn(64, 32)))
            yield len(kept)
            time.sleep(0.002)

    with warnings.catch_warnings(), scope:
        warnings.simplefilter("ignore", gradguard.GraphRetentionWarning)
        built = tuple(rows())  # filled from a generator: resized as it grows, while the looks run
    assert built == tuple(range(1, len(kept) + 1))
    assert threads and all(t is threading.main_thread() for t in threads)


def test_a_program_that_handles_the_signal_itself_keeps_its_handler() -> None:
    import signal

    if not hasattr(signal, "SIGURG"):
        pytest.skip("no SIGURG here: the watch takes no look")
    seen: list[int] = []

    def own(signum: int, frame: Any) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGURG, own)
    try:
        with gradguard.watch(mode="warn", ignore=elsewhere) as scope:
            assert signal.getsignal(signal.SIGURG) is own and idle.following() == 0
        assert scope.watcher.audits == 0
    finally:
        signal.signal(signal.SIGURG, previous)


def test_the_signal_is_given_back_when_the_watch_ends() -> None:
    import signal

    if not hasattr(signal, "SIGURG"):
        pytest.skip("no SIGURG here: the watch takes no look")
    before = signal.getsignal(signal.SIGURG)
    with gradguard.watch(mode="warn", ignore=elsewhere):
        assert signal.getsignal(signal.SIGURG) is not before
    assert signal.getsignal(signal.SIGURG) is before


def test_the_off_mode_takes_no_look() -> None:
    run, _ = CASES["an evaluation loop in grad mode keeping its predictions"]
    scope = gradguard.watch(mode="off", ignore=elsewhere)
    with scope:
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
        results = []
        start = time.monotonic()
        while time.monotonic() - start < 1.0:  # long enough for the memory figure to ask several times
            results.append(model(torch.randn(64, 32)))
            time.sleep(0.002)
    assert scope.watcher.audits == 0 and scope.watcher.history() == []


def test_a_handler_the_program_sets_later_is_never_called_by_the_watch() -> None:
    import signal

    if not hasattr(signal, "SIGURG"):
        pytest.skip("no SIGURG here: the watch takes no look")
    called: list[int] = []
    before = signal.getsignal(signal.SIGURG)
    scope = gradguard.watch(mode="warn", ignore=elsewhere)
    with scope:
        signal.signal(signal.SIGURG, lambda signum, frame: called.append(signum))
        try:
            model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
            results = []
            start = time.monotonic()
            while time.monotonic() - start < 1.0:  # the memory figure rises: the watch would ask for looks
                results.append(model(torch.randn(64, 32)))
                time.sleep(0.002)
        finally:
            signal.signal(signal.SIGURG, before)
    assert called == [] and scope.watcher.audits == 0
