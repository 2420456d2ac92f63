"""When the watch audits: the schedule of each thread (``every``, the memory trigger, the backstop on
time). The memory figure and the clock are injected: no timing and no allocator reading in these
tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import gradguard
from gradguard._watch import schedule as _schedule
from gradguard._watch import watcher as _watch
from gradguard._watch.schedule import BACKSTOP_SHARE, FIRST_COST, Schedule
from gradguard._watch.trigger import TriggerSettings

KiB = 1024


class FakeReader:
    """A memory figure the test sets: ``level`` bytes of CPU memory in use."""

    cpu_source = "mallinfo2"
    cuda = False

    def __init__(self) -> None:
        self.level = 100 * 1024 * KiB
        self.readings = 0

    def __call__(self) -> dict[str, int]:
        self.readings += 1
        return {"cpu": self.level}

    def describe(self) -> str:
        return "cpu: a test's figure"


class NoFigure(FakeReader):
    cpu_source = None  # type: ignore[assignment]

    def __call__(self) -> dict[str, int]:
        return {}


def run(schedule: Schedule, boundaries: int, step: float = 0.02, cost: float = 0.05) -> list[str | None]:
    reasons: list[str | None] = []
    now = 0.0
    for _ in range(boundaries):
        now += step
        reason = schedule.boundary(now)
        reasons.append(reason)
        if reason is not None:
            schedule.audited(cost, new=False)
            now += cost
    return reasons


def test_every_n_audits_every_nth_boundary_and_reads_no_memory() -> None:
    reader = FakeReader()
    schedule = Schedule(3, TriggerSettings(), reader=lambda: reader)
    assert run(schedule, 7) == [None, None, "every", None, None, "every", None]
    assert reader.readings == 0


def test_without_a_figure_the_first_two_boundaries_then_one_percent() -> None:
    schedule = Schedule("auto", TriggerSettings(), reader=NoFigure)
    reasons = run(schedule, 2000, step=0.02, cost=0.05)  # an audit costs 2.5 steps
    assert reasons[:3] == ["first", "first", None]
    elapsed = 2000 * 0.02 + schedule.spent
    assert schedule.spent <= _schedule.AUTO_SHARE * elapsed  # two audits of margin keep it under
    assert 4 <= sum(r is not None for r in reasons) <= 2000 * 0.02 * 0.01 / 0.05 + 1
    assert Schedule("auto", None).trigger is None  # memory=False: the same schedule


def test_a_clean_run_with_a_figure_is_audited_by_the_backstop_alone() -> None:
    reader = FakeReader()
    schedule = Schedule("auto", TriggerSettings(), reader=lambda: reader)
    reasons = run(schedule, 2000, step=0.02, cost=0.05)
    elapsed = 2000 * 0.02
    assert "memory" not in reasons and "first" not in reasons
    # the backstop's first audit waits until BACKSTOP_SHARE of the time affords FIRST_COST
    first = reasons.index("time") if "time" in reasons else None
    assert first is None or (first + 1) * 0.02 * BACKSTOP_SHARE >= FIRST_COST - 1e-9
    assert schedule.spent <= BACKSTOP_SHARE * elapsed + 0.05
    assert reader.readings == 2000


def test_the_backstops_first_audit_keeps_a_clean_run_within_its_share() -> None:
    """``gradguard bench --late-leak``, pp-last-stage on 2 CPU cores: 2000 clean steps of 64 ms, and the
    backstop's one audit took 0.13 s where 0.05 s was assumed, 0.1% of the run instead of 0.05%
    (the clean run's share was 0.229%). The first audit now waits until the share affords an audit
    of the heap a training process has."""
    reader = FakeReader()
    schedule = Schedule("auto", TriggerSettings(), reader=lambda: reader)
    reasons = run(schedule, 2000, step=0.064, cost=0.13)
    assert schedule.spent <= BACKSTOP_SHARE * 2000 * 0.064
    assert "time" not in reasons  # too short a run for the first audit
    # a run long enough is audited, and stays within the share once the first cost is known
    long_run = Schedule("auto", TriggerSettings(), reader=lambda: reader)
    reasons = run(long_run, 40000, step=0.064, cost=0.13)
    assert 1 <= reasons.count("time") and long_run.spent <= BACKSTOP_SHARE * 40000 * 0.064


def test_a_leak_that_starts_late_is_audited_at_once_and_confirmed() -> None:
    reader = FakeReader()
    schedule = Schedule("auto", TriggerSettings(), reader=lambda: reader)
    reasons: list[str | None] = []
    now = 0.0
    for boundary in range(1, 601):
        if boundary >= 500:
            reader.level += 260 * KiB  # a kept 256 KiB leaf and its objects, from step 500
        now += 0.02
        reason = schedule.boundary(now)
        reasons.append(reason)
        if reason is not None:
            schedule.audited(0.05, new=boundary >= 502)
    audited = [b for b, r in enumerate(reasons, 1) if r == "memory"]
    assert audited[:2] == [501, 502]  # two boundaries above the mark, then the confirming audit


def test_a_resident_set_figure_gets_the_coarser_floor() -> None:
    class Resident(FakeReader):
        cpu_source = "statm"

    schedule = Schedule("auto", TriggerSettings(), reader=Resident)
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


def test_the_watch_reports_a_late_leak_within_a_few_boundaries_of_its_start(figure: FakeReader) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    found_at = None
    try:
        with gradguard.watch(mode="raise", ignore=elsewhere) as scope:  # every="auto", memory=True
            for step in range(1, 80):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                loss.backward()
                if step >= 40:
                    KEPT.append(loss)  # the leak starts here
                    figure.level += 256 * KiB
                try:
                    opt.step()
                except gradguard.GraphRetentionError:
                    found_at = step
                    break
                opt.zero_grad()
    finally:
        KEPT.clear()
    assert found_at is not None and 40 < found_at <= 45, found_at
    assert scope.watcher.memory_audits >= 2 and scope.watcher.audits == scope.watcher.memory_audits


def test_a_summary_of_a_run_the_trigger_never_audited_says_what_it_watched(figure: FakeReader) -> None:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradguard.watch(mode="raise", ignore=elsewhere) as scope:
        for _ in range(20):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
    text = scope.watcher.summary()
    assert "20 step boundaries, 0 audited" in text and "no audit ran, nothing was checked" in text
    assert "memory (cpu: a test's figure) was read at each boundary" in text
    assert "never rose 256.0 KiB over its low-water mark of the last 64 boundaries" in text


def test_memory_settings_are_validated() -> None:
    with pytest.raises(gradguard.GradGuardError, match=r"memory='yes' is not accepted; accepted: True"):
        gradguard.watch(memory="yes")
    with pytest.raises(gradguard.GradGuardError, match=r"every=3: the memory trigger schedules audits for"):
        gradguard.Watcher(every=3, memory=gradguard.TriggerSettings())
    with pytest.raises(gradguard.GradGuardError, match=r"TriggerSettings\(floor=0\) is not accepted"):
        gradguard.TriggerSettings(floor=0)
    assert gradguard.Watcher(every=3).memory is None and gradguard.Watcher(memory=False).memory is None


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
    assert watcher.audits == 3 and watcher.read_seconds == 0.0  # every=1 reads no figure
