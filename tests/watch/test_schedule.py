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
from _helpers import watch_clock
from _tables import flat
from torch import nn

import gradguard
from gradguard._watch import schedule as _schedule
from gradguard._watch import threads as _threads
from gradguard._watch import watcher as _watch
from gradguard._watch.decision import Decision
from gradguard._watch.governor import BACKSTOP_SHARE, SHARE, Governor
from gradguard._watch.schedule import HUNTING_BACKSTOP_SHARE, STARTUP, Schedule
from gradguard._watch.trigger import DEFAULT_MEMORY, TriggerSettings

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


def _searched(decision: Decision) -> str | None:
    """The reason a decision searches for, or ``None`` when it does not search."""
    return decision.reason if decision.action == "search" else None


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
        pending: bool = False,
        partial: bool = False,
        collector: str | None = None,
    ) -> str | None:
        self.boundary += 1
        self.now += self.step
        signals = self.schedule.read(self.now, self.boundary, old, held)
        decision = self.schedule.decide(signals)
        if decision.action == "collect":  # as the watcher does: the collector "frees" the old graphs, or
            collected = {"frees": "garbage", "declines": "refused", None: "survived"}[collector]  # "declines"
            decision = self.schedule.decide(signals._replace(collected=collected))  # to tell now
        reason = _searched(decision)
        self.reasons.append(reason)
        if reason is not None:
            self.schedule.governor.charge(self.cost, startup=reason == "start")
            self.schedule.audited(
                self.cost,
                reason,
                new=new,
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


def _fresh(every: int | str = "auto", memory: TriggerSettings | None = None, **kwargs: Any) -> Schedule:
    clock = [0.0]
    return Schedule(every, memory, governor=Governor(lambda: clock[0]), **kwargs)


def test_the_first_boundaries_are_audited_then_only_what_a_signal_or_the_backstop_asks() -> None:
    reader = FakeReader()
    run = Run(_fresh(memory=TriggerSettings(), reader=lambda: reader))
    for _ in range(2000):
        run()
    assert run.audited_at("start") == list(range(1, STARTUP + 1))
    assert set(run.reasons[STARTUP:]) <= {None, "time"}
    # the backstop keeps to its part of the governor's share
    assert len(run.audited_at("time")) * 0.05 <= BACKSTOP_SHARE * run.now + 0.05
    assert reader.readings == 2000


def test_a_graph_that_lived_through_two_boundaries_asks_for_an_audit() -> None:
    run = Run(_fresh())
    for _ in range(STARTUP):
        run()
    assert run(old=STARTUP) is None  # stamped at the last start-up boundary: it lived through none yet
    run()
    assert run(old=STARTUP) == "old"  # three boundaries after its epoch: through two


def test_old_graphs_that_keep_finding_nothing_back_off_and_keep_to_the_share() -> None:
    # A kept exception each step (a cycle the collector frees late), gc off with a collect by hand, each
    # step's grad_fn kept: an old graph at every boundary, and no holder for any of them.
    run = Run(_fresh(), step=0.0005, cost=0.05)
    for _ in range(STARTUP):
        run()
    for b in range(STARTUP + 1, 40000):
        run(old=b - 3)
    old = run.audited_at("old")
    assert old[0] == STARTUP + 1  # the first request is served at once
    assert old[1] - old[0] > 1000  # then only as the share allows: not at every boundary
    charged = run.schedule.governor.spent
    assert charged <= SHARE * run.now + 0.05  # the whole cost within the share, but for one audit


def test_a_search_that_finds_a_new_leak_is_free_again() -> None:
    run = Run(_fresh(), step=0.001, cost=0.05)
    for _ in range(STARTUP):
        run()
    assert [run(old=b - 3, new=True) for b in range(3, 9)] == ["old"] * 6


def test_a_search_that_left_graphs_pending_gets_one_follow_up_at_once() -> None:
    run = Run(_fresh(), step=0.001, cost=0.05)
    for _ in range(STARTUP):
        run()
    assert run(old=0, pending=True) == "old"  # a graph still usable for backward: followed for a use
    assert run(old=0, pending=True) == "old"  # the follow-up judges it
    assert run(old=0, pending=True) is None  # then the signal backs off like any other


def test_known_leaks_found_again_back_off_within_the_share() -> None:
    run = Run(_fresh(), step=0.01, cost=0.05)
    for _ in range(STARTUP):
        run()
    for b in range(3, 2000):
        run(old=b - 3)  # warn mode: the same leak, found again at every search (nothing new)
    searches = len(run.audited_at("old"))
    assert 1 <= searches <= SHARE * run.now / 0.05 + 2


def test_a_rise_of_the_parameters_reference_count_asks_at_once_and_a_steady_count_never() -> None:
    run = Run(_fresh())
    run(held={"p": 10})
    run()
    for _ in range(50):
        assert run(held={"p": 10}) is None
    assert run(held={"p": 11}) == "held"  # a forward kept with its graph: one more reference
    assert run(held={"p": 11}) is None  # audited: the mark moved up with it


def test_memory_growth_asks_once_it_grew_well_past_its_threshold_then_each_time_it_doubled() -> None:
    reader = FakeReader()
    fast = Run(_fresh(memory=DEFAULT_MEMORY, reader=lambda: reader), step=0.0005, cost=0.08)
    for _ in range(2000):
        reader.level += 8 * KiB * 1024  # a detached replay buffer: the figure climbs, no graph is old
        fast()
    memory = fast.audited_at("memory")
    assert memory  # a large rise is seen early, whatever the share
    grown = [(b - STARTUP - 1) * 8 for b in memory]  # MiB over the first reading after the start-up check
    floor = _schedule.RESIDENT_FLOOR // (KiB * 1024)
    assert grown[0] >= _schedule.MEMORY_FIRST * floor  # growth alone proves nothing: not at its first crossing
    assert all(later >= 2 * earlier for earlier, later in zip(grown, grown[1:]))  # logarithmic in the growth


def test_old_graphs_no_holder_was_found_for_are_looked_for_again_less_and_less_often() -> None:
    schedule = _fresh()
    now = 0.0
    looked = []
    for b in range(1, 400):
        now += 0.01
        reason = _searched(schedule.boundary(now, b, None, None))
        if reason is not None:
            looked.append((b, reason))
            schedule.governor.charge(0.001, startup=reason == "start")
            schedule.audited(0.001, reason, new=False, unexplained=True, boundary=b)
    retries = [b for b, reason in looked if reason == "retry"]
    gaps = [b - a for a, b in zip(retries, retries[1:])]
    assert looked[0] == (1, "start") and 3 <= len(retries) <= 12
    assert gaps[-3:] == sorted(gaps[-3:]) and gaps[-1] >= 16  # less and less often


def test_a_new_entry_of_the_watch_is_checked_at_start_up_again() -> None:
    run = Run(_fresh(), step=0.001, cost=0.05)
    for b in range(1, 100):
        run(old=b - 3 if b > STARTUP else None)  # nothing new: the old signal backs off
    assert run(old=96) is None
    run.schedule.restart()  # the watch's scope entered again (a decorated function's next call)
    assert [run(), run()] == ["start", "start"]
    assert run(old=99) == "old"  # and every signal asks at once again


def test_hunting_acts_on_the_signals_of_every_nth_boundary_at_once_and_otherwise_only_on_its_backstop() -> None:
    reader = FakeReader()
    run = Run(_fresh(2, TriggerSettings(), reader=lambda: reader), step=0.001, cost=0.05)
    run()
    run()
    reasons = [run(old=b - 2) for b in range(3, 41)]  # every old graph: each even boundary searches
    assert reasons[1::2] == ["old"] * 19 and reasons[0::2] == [None] * 19
    quiet = Run(_fresh(1, TriggerSettings(), reader=lambda: reader))
    reasons = [quiet() for _ in range(500)]
    assert reasons[:STARTUP] == ["start"] * STARTUP and set(reasons[STARTUP:]) == {None, "time"}
    backstop = quiet.audited_at("time")
    assert backstop[0] > STARTUP + 1  # its first once three times the start-up check's cost went by
    assert len(backstop) * 0.05 <= HUNTING_BACKSTOP_SHARE * quiet.now + 0.05
    assert reader.readings == 2 + 19 + 500  # the figure is read at every checked boundary


def test_a_short_hunt_gets_a_backstop_audit_timed_by_its_start_up_check() -> None:
    # A leak no signal sees (a torch.func forward saves no sampled parameter) in a 6-step run: the
    # start-up check read the young generations only, and the backstop's first audit is timed by it
    # (once three times its cost went by); the next ones keep within their share.
    run = Run(_fresh(1), step=0.005, cost=0.0005)
    run(partial=True)
    run(partial=True)
    run.cost = 0.05
    reasons = [run() for _ in range(5)]
    assert reasons[0] == "time" and reasons[1:] == [None] * 4  # then its share waits for 1 s


def _thresholds(trigger: Any, readings: dict[str, int]) -> dict[str, int]:
    for _ in range(3):
        trigger.observe(readings)
    return dict(trigger.thresholds())


def test_a_resident_set_figure_gets_the_coarser_floor_for_itself_only() -> None:
    """The default rule's CPU figure, where it is the resident set, gets the coarser floor; a CUDA figure
    beside it keeps the rule's own."""
    schedule = Schedule("auto", DEFAULT_MEMORY, reader=FakeReader)
    assert schedule.trigger is not None
    thresholds = _thresholds(schedule.trigger, {"cpu": 100 * KiB, "cuda:0": 100 * KiB})
    assert thresholds == {"cpu": _schedule.RESIDENT_FLOOR, "cuda:0": DEFAULT_MEMORY.floor}


def test_a_floor_the_user_chose_is_kept_for_the_resident_set_too() -> None:
    mine = TriggerSettings(floor=64 * KiB)
    schedule = Schedule("auto", mine, reader=FakeReader)
    assert schedule.trigger is not None
    assert _thresholds(schedule.trigger, {"cpu": 100 * KiB}) == {"cpu": 64 * KiB}


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
    return watch_clock(monkeypatch)


def _train(keep: Any, start: int, steps: int = 60, clock: list[float] | None = None) -> int | None:
    """Train a tiny model inside ``watch(mode="raise")``, keeping ``keep(loss, out, model)`` from ``start``;
    the step whose boundary raised. ``clock``: advanced by 50 ms a step."""
    gc.collect()  # graphs other tests left as garbage would be old graphs no holder keeps
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


def _stamping(monkeypatch: pytest.MonkeyPatch) -> tuple[_threads.ThreadState, list[float]]:
    """A thread's state whose clock advances 10 us at each reading (the stamping's), and that clock (a
    test adds a step's time to it)."""
    clock = [0.0]

    def tick() -> float:
        clock[0] += 0.00001
        return clock[0]

    monkeypatch.setattr(_threads, "_clock", tick)
    return _threads.ThreadState(_fresh()), clock


def test_every_backward_is_stamped_and_below_its_roots_within_a_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reading of the clock is 10 us of stamping below the roots, a step 0.5 ms: a 0.2% share affords
    it one step in ten; every backward's roots and the node right below each are stamped, and the first
    boundaries stamp further below them too."""
    state, clock = _stamping(monkeypatch)
    roots, below = [], []
    x = torch.ones(2, requires_grad=True)
    for _ in range(400):
        loss = ((x * 2).exp() * 3).sum()
        placed = state.ledger.placed
        _threads.stamp_backward(state, (loss,), Governor(), False, _threads._clock())
        roots.append(state.ledger.placed >= placed + 2)  # the root, and the node right below it
        below.append(state.ledger.placed > placed + 2)
        state.clock.tick(None)
        clock[0] += 0.0005
    first = _schedule.STARTUP + 1  # the backwards of the start-up check's steps
    assert all(roots) and all(below[:first])
    assert 0.05 <= sum(below[first:]) / len(below[first:]) <= 0.12, sum(below[first:])


def test_the_start_up_check_s_steps_are_stamped_below_their_roots_after_each_entry_of_the_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new entry of the watch is a start-up check again (:meth:`Schedule.restart`): the backwards of its
    steps are stamped below their roots whatever it costs, as the first entry's were."""
    state, clock = _stamping(monkeypatch)
    x = torch.ones(2, requires_grad=True)

    def steps(n: int) -> list[bool]:
        below = []
        for _ in range(n):
            loss = ((x * 2).exp() * 3).sum()
            placed = state.ledger.placed
            _threads.stamp_backward(state, (loss,), Governor(), False, _threads._clock())
            below.append(state.ledger.placed > placed + 2)
            state.schedule.seen = state.clock.tick(None)
            clock[0] += 0.0005
        return below

    first = _schedule.STARTUP + 1  # the backwards of the start-up check's steps
    assert all(steps(first))
    assert sum(steps(200)) <= 30  # within the share
    state.schedule.restart()
    assert all(steps(first))


def test_a_backward_in_a_thread_that_never_steps_is_aged_by_the_thread_that_does(figure: FakeReader) -> None:
    """The loss is kept from step 20; its backward runs in a worker thread, the optimizer steps here."""
    from concurrent.futures import ThreadPoolExecutor

    gc.collect()  # graphs other tests left as garbage would be old graphs no holder keeps
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    found = None
    with ThreadPoolExecutor(1) as pool, gradguard.watch(mode="raise", ignore=elsewhere):
        for step in range(1, 60):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            pool.submit(loss.backward).result()
            if step >= 20:
                KEPT.append(loss)
            try:
                opt.step()
            except gradguard.GraphRetentionError:
                found = step
                break
            opt.zero_grad()
    KEPT.clear()
    assert found is not None and found <= 23


def test_a_kept_forward_without_backward_is_reported_within_three_boundaries(figure: FakeReader) -> None:
    """An evaluation forward kept with its graph: it saves the model's weights, whose reference count rises."""
    found = _train(lambda loss, out, model: KEPT.append(model(torch.randn(4, 8))), start=30)
    assert found is not None and 30 < found <= 33


def test_a_leak_from_the_first_step_fails_a_six_step_run(figure: FakeReader) -> None:
    found = _train(lambda loss, out, model: KEPT.append(out), start=1, steps=7)
    assert found is not None and found <= 3


def test_a_summary_of_a_clean_run_says_what_was_checked(figure: FakeReader) -> None:
    gc.collect()  # graphs other tests left as garbage would be old graphs no holder keeps
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradguard.watch(mode="raise", ignore=elsewhere) as scope:
        for _ in range(20):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
    text = flat(scope.watcher.summary())
    assert f"20 step boundaries (20 backwards), {STARTUP} audited" in text
    assert "no graph the watch followed outlived two step boundaries" in text
    assert "graph nodes followed)" in text
    # what the signals cannot see is said, with the boundaries since the last audit
    assert f"found by an audit only: the last ran {20 - STARTUP} step boundaries before the end" in text
    assert "memory" not in text  # the figure did not move


def test_a_summary_says_when_memory_grew_and_no_graph_explains_it(figure: FakeReader) -> None:
    gc.collect()  # graphs other tests left as garbage would be old graphs no holder keeps
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradguard.watch(mode="raise", ignore=elsewhere) as scope:
        for _ in range(20):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            figure.level += 4 * 1024 * KiB  # a detached buffer: the resident set grows, no graph is old
    text = flat(scope.watcher.summary())
    assert "no graph the watch followed outlived two step boundaries" in text
    grown = 4 * (20 - STARTUP - 1)  # MiB, from the first boundary after the start-up check
    assert f"memory (a test's figure) grew after the watch's first audits: cpu +{grown}.0 MiB" in text
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


def test_the_share_is_all_of_the_watchers_own_time(monkeypatch: pytest.MonkeyPatch, figure: FakeReader) -> None:
    clock = [0.0]
    monkeypatch.setattr(_watch, "_clock", lambda: clock[0])
    monkeypatch.setattr(_watch, "work_clock", lambda: clock[0])
    watcher = gradguard.Watcher(every=1, mode="raise", ignore=elsewhere)
    x = torch.ones(2, requires_grad=True)
    for _ in range(3):
        _ = x * 2
        clock[0] += 1.0
        watcher.boundary()
    figures = watcher.figures()
    assert watcher.audits >= 1 and figures.elapsed == 2.0 and figures.seconds == 0.0  # the fake clock did not move
