"""Cyclic garbage is not a leak, and costs no heap search: a graph that only waits for the collector (a
kept exception, a self-referencing record, a collector disabled and run by hand) is told apart by asking
the collector, while a graph a program holds is still reported."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _helpers import env, watch_clock
from torch import nn

import gradguard
from gradguard._watch.garbage import COLLECT_SHARE, Collector
from gradguard._watch.governor import Governor

KEPT: list[Any] = []


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    KEPT.clear()
    gc.collect()  # graphs other tests left as garbage would be old graphs of this run
    yield
    KEPT.clear()
    gc.collect()


def elsewhere(entry: gradguard.Retention) -> bool:
    return "test_garbage" not in entry.path


# --------------------------------------------------------------------------------------------------
# The collector, asked (injected: no real collection, no timing)
# --------------------------------------------------------------------------------------------------


class FakeGc:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.count = 0
        self.collects = 0
        self.time = 0.0
        self.cost = 0.001
        self.alive: list[int] = []  # epochs of old graphs alive
        self.garbage: list[int] = []  # of them, those a young collection frees

    def collect(self) -> None:
        self.collects += 1
        self.count += 1
        self.time += self.cost
        self.alive = [e for e in self.alive if e not in self.garbage]

    def oldest(self) -> int | None:
        return min(self.alive, default=None)

    def collector(self) -> Collector:
        governor = Governor(clock=lambda: self.time)
        governor.start(0.0)
        return Collector(
            governor,
            clock=lambda: self.time,
            collect=self.collect,
            enabled=lambda: self.enabled,
            collections=lambda: self.count,
        )


def test_an_old_graph_a_young_collection_frees_is_garbage_and_one_it_does_not_stands() -> None:
    fake = FakeGc()
    collector = fake.collector()
    fake.alive, fake.garbage = [3], [3]
    assert collector.garbage(fake.oldest, boundary=7) is True
    assert fake.collects == 1 and fake.alive == []
    fake.time += 1.0  # the share affords the next collection
    fake.alive = [5]
    assert collector.garbage(fake.oldest, boundary=9) is False
    assert fake.collects == 2


def test_the_watchs_own_collections_are_rationed_to_their_share_the_first_free() -> None:
    fake = FakeGc()
    collector = fake.collector()
    fake.cost = 0.01
    fake.alive, fake.garbage = [1], [1, 2]
    assert collector.garbage(fake.oldest, boundary=4) is True  # the first: free, whatever the share
    fake.alive = [2]
    fake.time += 0.01
    assert collector.garbage(fake.oldest, boundary=5) is None  # 0.01 s spent in 0.02 s: declined
    assert fake.collects == 1
    fake.time = 0.01 / COLLECT_SHARE + 1.0
    assert collector.garbage(fake.oldest, boundary=6) is True
    assert fake.collects == 2
    assert collector.ration.seconds == pytest.approx(0.02)


def test_with_the_collector_disabled_a_request_waits_for_the_programs_next_collection() -> None:
    fake = FakeGc(enabled=False)
    collector = fake.collector()
    fake.alive = [2, 6]
    for boundary in (5, 9, 10):
        assert collector.garbage(fake.oldest, boundary) is True  # the program has not collected yet
    assert fake.collects == 0  # never one of the watch's own
    fake.count += 1  # the program collected; the graph of epoch 2 was made before boundary 10 and outlived it
    assert collector.garbage(fake.oldest, boundary=12) is False


def test_with_the_collector_disabled_a_graph_made_after_the_last_check_waits_for_the_collection_after() -> None:
    fake = FakeGc(enabled=False)
    collector = fake.collector()
    fake.alive = [4]
    assert collector.garbage(fake.oldest, boundary=7) is True
    fake.count += 1
    fake.alive = [9]  # epoch 4's graph was freed; epoch 9's may have been made after the collection
    assert collector.garbage(fake.oldest, boundary=12) is True
    fake.count += 1
    assert collector.garbage(fake.oldest, boundary=20) is False  # it outlived the next one


# --------------------------------------------------------------------------------------------------
# Real programs
# --------------------------------------------------------------------------------------------------


def _keep_in_a_cycle(loss: torch.Tensor, out: torch.Tensor) -> None:
    record: dict[str, Any] = {"out": out}
    record["self"] = record  # held, with its graph, until the collector runs


def _keep_an_exception(loss: torch.Tensor, out: torch.Tensor) -> None:
    try:
        raise ValueError(f"a caught, kept exception (loss {loss.shape})")
    except ValueError as e:
        kept = e  # noqa: F841  the frame holds it, its traceback the frame: a cycle that holds ``out``


def _train(
    extra: Callable[[torch.Tensor, torch.Tensor], None],
    steps: int,
    collect_every: int | None = None,
    watched: bool = True,
) -> tuple[Any, list[torch.Tensor], int | None]:
    """``steps`` steps of a tiny model inside ``watch(mode="raise")`` (or unwatched), calling
    ``extra(loss, out)`` each step; ``collect_every``: the collector disabled and run by hand every that
    many steps. The watch's figures (``None`` unwatched), the gradients of the last step, and the step
    whose boundary raised."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    raised = None
    if collect_every is not None:
        gc.disable()
    try:
        scope = gradguard.watch(mode="raise", ignore=elsewhere) if watched else None
        with scope or contextlib.nullcontext():
            for step in range(1, steps + 1):
                out = model(torch.randn(4, 8))
                loss = out.pow(2).mean()
                loss.backward()
                extra(loss, out)
                if collect_every is not None and step % collect_every == 0:
                    gc.collect()
                grads = [p.grad.clone() for p in model.parameters()]
                try:
                    opt.step()
                except gradguard.GraphRetentionError:
                    raised = step
                    break
                opt.zero_grad()
        return (scope.watcher.figures() if scope is not None else None), grads, raised
    finally:
        gc.enable()


@pytest.mark.parametrize("extra", [_keep_in_a_cycle, _keep_an_exception], ids=["cycles", "kept-exception"])
def test_graphs_kept_by_cyclic_garbage_cost_no_audit_after_the_start_up_check(extra: Any) -> None:
    # A thread with many garbage graphs at once: the young generation holds them past two boundaries.
    threshold = gc.get_threshold()
    gc.set_threshold(100_000, *threshold[1:])
    try:
        figures, grads, raised = _train(extra, steps=40)
    finally:
        gc.set_threshold(*threshold)
    assert raised is None
    assert figures.audits == 2  # the start-up check's two: every old graph was freed by a young collection
    assert figures.garbage >= 1
    plain = _train(extra, steps=40, watched=False)[1]
    assert all(torch.equal(a, b) for a, b in zip(grads, plain, strict=True))


def test_with_the_collector_disabled_its_garbage_costs_no_audit_until_it_runs_and_none_after() -> None:
    figures, _, raised = _train(_keep_in_a_cycle, steps=40, collect_every=10)
    assert raised is None
    assert figures.audits == 2
    assert figures.collecting >= 1 and figures.garbage >= 1


@pytest.fixture
def slow_steps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The watch's clock, advanced by the test: steps as long as a GPU's, so the share affords every
    collection (how soon a rationed one runs depends on the machine's speed: not this test's question)."""
    return watch_clock(monkeypatch)


def test_a_graph_held_in_a_program_that_also_makes_cyclic_garbage_is_still_reported(slow_steps: list[float]) -> None:
    threshold = gc.get_threshold()
    gc.set_threshold(100_000, *threshold[1:])

    def both(loss: torch.Tensor, out: torch.Tensor) -> None:
        _keep_in_a_cycle(loss, out)
        if _step[0] >= 20:
            KEPT.append(loss)
        _step[0] += 1
        slow_steps[0] += 0.05

    _step = [1]
    try:
        _, _, raised = _train(both, steps=40)
    finally:
        gc.set_threshold(*threshold)
    assert raised is not None and 20 <= raised <= 22  # by the old signal at 22, or an earlier audit


def test_with_the_collector_disabled_a_held_graph_is_reported_after_the_programs_collection() -> None:
    def keep(loss: torch.Tensor, out: torch.Tensor) -> None:
        if _step[0] >= 5:
            KEPT.append(loss)
        _step[0] += 1

    _step = [1]
    _, _, raised = _train(keep, steps=40, collect_every=10)
    assert raised == 10  # the boundary right after the program's collection (in step 10)


def test_the_start_up_collection_leaves_a_first_step_record_in_the_checks_sight(tmp_path: Any) -> None:
    # The second start-up check reads the young generations; a collection of both before it would move
    # what the first step kept after its optimizer.step() to the oldest, out of its sight.
    (tmp_path / "train.py").write_text(
        textwrap.dedent(
            """
            import torch
            m = torch.nn.Linear(8, 1)
            opt = torch.optim.SGD(m.parameters(), 0.1)
            NORMS = []
            for s in range(6):
                loss = m(torch.randn(4, 8)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                NORMS.append(m.weight.sum())  # no parameter saved, never backwarded: no signal sees it
            """
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "gradguard", "run", "--mode", "raise", "train.py"],
        capture_output=True, text=True, cwd=tmp_path, env=env(), timeout=300,
    )  # fmt: skip
    assert run.returncode == 1 and "NORMS[*]" in run.stderr, run.stderr
