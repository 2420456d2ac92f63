"""When the watch audits: the schedule of each thread (the start-up check, the constant-time signals, the
budgets, hunting with ``every=N``). The memory figure and the clock are injected: no timing and no
allocator reading in these tests."""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch
from torch import nn

import gradguard
from gradguard._watch import schedule as _schedule
from gradguard._watch import threads as _threads
from gradguard._watch import watcher as _watch
from gradguard._watch.schedule import (
    BACKSTOP_SHARE,
    FIRST_COST,
    HUNTING_BACKSTOP_SHARE,
    IDLE_SHARE,
    REPEAT_SHARE,
    Schedule,
)
from gradguard._watch.trigger import TriggerSettings

KiB = 1024


class FakeReader:
    """A memory figure the test sets: ``level`` bytes of CPU memory in use."""

    cpu_source = "statm"
    cuda = False
    seconds = 0.0

    def __init__(self) -> None:
        self.level = 100 * 1024 * KiB
        self.readings = 0

    def __call__(self) -> dict[str, int]:
        self.readings += 1
        return {"cpu": self.level}

    def describe(self) -> str:
        return "cpu: a test's figure"

    def short(self) -> str:
        return "a test's figure"

    def next_due(self) -> float:
        return -math.inf  # read at every boundary


class Run:
    """Drives a schedule: one boundary per call, with the signals given, audits costing ``cost``."""

    def __init__(self, schedule: Schedule, step: float = 0.02, cost: float = 0.05) -> None:
        self.schedule, self.step, self.cost = schedule, step, cost
        self.now = 0.0
        self.boundary = 0
        self.reasons: list[str | None] = []

    def __call__(
        self,
        old: int | None = None,
        held: Mapping[str, int] | None = None,
        *,
        new: bool = False,
        found: bool = False,
        pending: bool = False,
        partial: bool = False,
    ) -> str | None:
        self.boundary += 1
        self.now += self.step
        reason = self.schedule.boundary(self.now, self.boundary, old, held)
        self.reasons.append(reason)
        if reason is not None:
            self.schedule.audited(
                self.cost,
                reason,
                new=new,
                found=found,
                unexplained=False,
                boundary=self.boundary,
                pending=pending,
                partial=partial,
            )
            self.now += self.cost
        return reason

    def audited_at(self, reason: str) -> list[int]:
        return [b for b, r in enumerate(self.reasons, start=1) if r == reason]


# --------------------------------------------------------------------------------------------------
# The schedule alone
# --------------------------------------------------------------------------------------------------


def test_the_first_boundary_is_audited_then_only_what_a_signal_or_the_backstop_asks() -> None:
    reader = FakeReader()
    run = Run(Schedule("auto", TriggerSettings(), reader=lambda: reader))
    for _ in range(2000):
        run()
    assert run.reasons[0] == "start" and run.audited_at("start") == [1]
    assert set(run.reasons[1:]) <= {None, "time"}
    # the backstop's first audit waits until its share affords FIRST_COST, and it keeps to its share
    first = run.audited_at("time")[0] if run.audited_at("time") else None
    assert first is None or first * 0.02 * BACKSTOP_SHARE >= FIRST_COST - 1e-9
    assert len(run.audited_at("time")) * 0.05 <= BACKSTOP_SHARE * run.now + 0.05
    assert reader.readings == 2000


def test_a_cheap_start_up_check_does_not_bring_the_backstop_forward() -> None:
    # A start-up check that read the collector's young generations only says nothing of what a search
    # of the heap costs: the backstop's first audit waits for FIRST_COST however little it took.
    run = Run(Schedule("auto", TriggerSettings(), reader=FakeReader), step=0.0005, cost=0.0002)
    run(partial=True)
    assert run.reasons == ["start"]
    run.cost = 0.05
    for _ in range(20000):
        run()
    assert run.audited_at("time") == []  # 10 s of steps: FIRST_COST affords no audit before 500 s


def test_a_graph_that_lived_through_two_boundaries_asks_for_an_audit() -> None:
    run = Run(Schedule("auto", None))
    run()
    assert run(old=0) is None  # stamped at epoch 0: at boundary 2 it lived through one boundary
    assert run(old=0) == "old"  # at 3, through two


def test_searches_for_old_graphs_that_keep_finding_nothing_are_held_to_a_small_share() -> None:
    run = Run(Schedule("auto", None), step=0.001, cost=0.05)
    run()
    for b in range(2, 3000):
        run(old=b - 3, pending=True)  # a two-optimizer loop whose previous result always looks old
    old = run.audited_at("old")
    assert old[0] == 2  # the first is always searched
    assert len(old) - 1 <= IDLE_SHARE * run.now / 0.05 + 1
    # a search that finds a new leak is free: the next old graph is searched at once
    schedule = Schedule("auto", None)
    productive = Run(schedule, step=0.001, cost=0.05)
    productive()
    assert [productive(old=b - 3, new=True) for b in range(2, 8)][2:] == ["old"] * 4


def test_known_leaks_found_again_are_held_to_the_repeat_share() -> None:
    run = Run(Schedule("auto", None), step=0.01, cost=0.05)
    run()
    for b in range(2, 2000):
        run(old=b - 3, found=True)  # warn mode: the same leak, found again at every search
    searches = len(run.audited_at("old"))
    assert 2 <= searches <= REPEAT_SHARE * run.now / 0.05 + 2


def test_a_rise_of_the_parameters_reference_count_asks_at_once_and_a_steady_count_never() -> None:
    run = Run(Schedule("auto", None))
    run(held={"p": 10})
    for _ in range(50):
        assert run(held={"p": 10}) is None
    assert run(held={"p": 11}) == "held"  # a forward kept with its graph: one more reference
    assert run(held={"p": 11}) is None  # audited: the mark moved up with it


def test_memory_growth_alone_spends_only_the_idle_share() -> None:
    reader = FakeReader()
    fast = Run(Schedule("auto", TriggerSettings(), reader=lambda: reader), step=0.0005, cost=0.08)
    for _ in range(2000):
        reader.level += 32 * KiB * 1024  # a detached replay buffer: the figure climbs, no graph is old
        fast()
    assert fast.audited_at("memory") == []  # 1 s of 0.5 ms steps cannot afford an 80 ms audit
    slow = Run(Schedule("auto", TriggerSettings(), reader=lambda: reader), step=0.5, cost=0.08)
    for _ in range(400):
        reader.level += 32 * KiB * 1024
        slow()
    memory = slow.audited_at("memory")
    assert memory and len(memory) * 0.08 <= IDLE_SHARE * slow.now + 0.08


def test_old_graphs_no_holder_was_found_for_are_looked_for_again_less_and_less_often() -> None:
    schedule = Schedule("auto", None)
    now = 0.0
    looked = []
    for b in range(1, 200):
        now += 0.01
        reason = schedule.boundary(now, b, None, None)
        if reason is not None:
            looked.append((b, reason))
            schedule.audited(0.001, reason, new=False, found=False, unexplained=True, boundary=b)
    retries = [b for b, reason in looked if reason == "retry"]
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert looked[0] == (1, "start") and retries[:3] == [2, 4, 8] and gaps == sorted(gaps)


def test_hunting_acts_on_the_signals_of_every_nth_boundary_at_once_and_otherwise_only_on_its_backstop() -> None:
    reader = FakeReader()
    run = Run(Schedule(2, TriggerSettings(), reader=lambda: reader), step=0.001, cost=0.05)
    run()
    reasons = [run(old=b - 2) for b in range(2, 40)]  # every old graph: each even boundary searches
    assert reasons[0::2] == ["old"] * 19 and reasons[1::2] == [None] * 19
    quiet = Run(Schedule(1, TriggerSettings(), reader=lambda: reader))
    reasons = [quiet() for _ in range(500)]
    assert reasons[0] == "start" and set(reasons[1:]) == {None, "time"}  # no signal: the backstop only
    backstop = quiet.audited_at("time")
    assert backstop[0] > 2  # its first once three times the start-up check's cost went by
    assert len(backstop) * 0.05 <= HUNTING_BACKSTOP_SHARE * quiet.now + 0.05
    assert reader.readings == 1 + 19 + 500  # the figure is read at every checked boundary


def test_a_short_hunt_gets_a_backstop_audit_timed_by_its_start_up_check() -> None:
    # A leak no signal sees (a torch.func forward saves no sampled parameter) in a 6-step run: the
    # start-up check read the young generations only, and the backstop's first audit is timed by it
    # (once three times its cost went by); the next ones keep within their share.
    run = Run(Schedule(1, None), step=0.005, cost=0.0005)
    run(partial=True)
    run.cost = 0.05
    reasons = [run() for _ in range(5)]
    assert reasons[0] == "time" and reasons[1:] == [None] * 4  # then its share waits for 1 s


def test_a_resident_set_figure_gets_the_coarser_floor() -> None:
    schedule = Schedule("auto", TriggerSettings(), reader=FakeReader)
    assert schedule.trigger is not None and schedule.trigger.settings.floor == _schedule.RESIDENT_FLOOR


# --------------------------------------------------------------------------------------------------
# Through the Watcher
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def figure(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeReader]:
    reader = FakeReader()
    monkeypatch.setattr(_schedule, "AllocatedReader", lambda **kwargs: reader)
    yield reader


KEPT: list[Any] = []


def elsewhere(entry: gradguard.Retention) -> bool:
    return "test_schedule" not in entry.path


@pytest.fixture
def slow_steps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The watch's clock, advanced by the test: steps as long as a GPU's, so every budget affords its work."""
    clock = [0.0]
    for module in (_watch, _threads):
        monkeypatch.setattr(module, "_clock", lambda: clock[0])
    return clock


def _train(keep: Any, start: int, steps: int = 60, clock: list[float] | None = None) -> int | None:
    """Train a tiny model inside ``watch(mode="raise")``, keeping ``keep(loss, out, model)`` from ``start``;
    the step whose boundary raised. ``clock``: advanced by 50 ms a step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with gradguard.watch(mode="raise", ignore=elsewhere):  # every="auto", memory=True
            for step in range(1, steps):
                out = model(torch.randn(4, 8))
                loss = out.pow(2).mean()
                loss.backward()
                if step >= start:
                    keep(loss, out, model)
                if clock is not None:
                    clock[0] += 0.05
                try:
                    opt.step()
                except gradguard.GraphRetentionError:
                    return step
                opt.zero_grad()
    finally:
        KEPT.clear()
    return None


def test_a_kept_loss_from_a_late_step_is_reported_two_boundaries_after_it_started(
    figure: FakeReader, slow_steps: list[float]
) -> None:
    assert _train(lambda loss, out, model: KEPT.append(loss), start=30, clock=slow_steps) == 32


def test_on_short_steps_backwards_are_stamped_within_their_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reading of the clock is 10 us of stamping, a step 0.5 ms: a 0.5% share affords a root stamp one
    step in four, a 0.2% share stamping below the roots one in ten; the first boundaries stamp every one."""
    clock = [0.0]

    def tick() -> float:
        clock[0] += 0.00001
        return clock[0]

    monkeypatch.setattr(_threads, "_clock", tick)
    state = _threads.ThreadState(Schedule("auto", None))
    roots, below = [], []
    x = torch.ones(2, requires_grad=True)
    for _ in range(400):
        loss = ((x * 2).exp() * 3).sum()
        placed = state.ledger.placed
        _threads.stamp_backward(state, (loss,), hunting=False)
        roots.append(state.ledger.placed > placed)
        below.append(state.ledger.placed > placed + 1)
        state.clock.tick(None)
        clock[0] += 0.0005
    first = _threads.STAMP_FIRST
    assert all(roots[:first]) and all(below[:first])
    assert 0.2 <= sum(roots[first:]) / len(roots[first:]) <= 0.3, sum(roots[first:])
    assert 0.05 <= sum(below[first:]) / len(below[first:]) <= 0.12, sum(below[first:])


def test_a_kept_forward_without_backward_is_reported_within_three_boundaries(figure: FakeReader) -> None:
    """An evaluation forward kept with its graph: it saves the model's weights, whose reference count rises."""
    found = _train(lambda loss, out, model: KEPT.append(model(torch.randn(4, 8))), start=30)
    assert found is not None and 30 < found <= 33


def test_a_leak_from_the_first_step_fails_a_six_step_run(figure: FakeReader) -> None:
    assert _train(lambda loss, out, model: KEPT.append(out), start=1, steps=7) == 3


def test_a_summary_of_a_clean_run_says_what_was_checked(figure: FakeReader) -> None:
    gc.collect()  # graphs other tests left as garbage would be old graphs no holder keeps
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradguard.watch(mode="raise", ignore=elsewhere) as scope:
        for _ in range(20):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
    text = scope.watcher.summary()
    assert "20 step boundaries, 1 audited" in text and "no autograd graph outlived two step boundaries" in text
    assert "stamped at backwards and audits were followed" in text
    assert "memory" not in text  # the figure did not move


def test_a_summary_says_when_memory_grew_and_no_graph_explains_it(figure: FakeReader) -> None:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradguard.watch(mode="raise", ignore=elsewhere) as scope:
        for _ in range(20):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            figure.level += 4 * 1024 * KiB  # a detached buffer: the resident set grows, no graph is old
    text = scope.watcher.summary()
    assert "no autograd graph outlived two step boundaries" in text
    assert "memory (a test's figure) grew after the start-up check: cpu +72.0 MiB" in text  # 18 boundaries
    assert "which no autograd graph the audits found explains" in text


def test_memory_settings_are_validated() -> None:
    with pytest.raises(gradguard.GradGuardError, match=r"memory='yes' is not accepted; accepted: True"):
        gradguard.watch(memory="yes")  # type: ignore[arg-type]
    with pytest.raises(gradguard.GradGuardError, match=r"TriggerSettings\(floor=0\) is not accepted"):
        gradguard.TriggerSettings(floor=0)
    assert gradguard.Watcher(every=3).memory == gradguard.TriggerSettings()
    assert gradguard.Watcher(memory=False).memory is None


def test_off_reads_nothing(figure: FakeReader) -> None:
    watcher = gradguard.Watcher(mode="off")
    x = torch.ones(2, requires_grad=True)
    for _ in range(5):
        _ = x * 2
        watcher.boundary()
    assert figure.readings == 0 and watcher.boundaries == 5


def test_the_clock_share_is_the_audits_and_the_readings(monkeypatch: pytest.MonkeyPatch, figure: FakeReader) -> None:
    clock = [0.0]
    monkeypatch.setattr(_watch, "_clock", lambda: clock[0])
    watcher = gradguard.Watcher(every=1, mode="raise", ignore=elsewhere)
    x = torch.ones(2, requires_grad=True)
    for _ in range(3):
        _ = x * 2
        clock[0] += 1.0
        watcher.boundary()
    figures = watcher.figures()
    assert watcher.audits >= 1 and figures.elapsed == 2.0 and figures.seconds == 0.0  # the fake clock did not move
