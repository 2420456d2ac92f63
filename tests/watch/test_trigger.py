"""The low-water rise rule, pinned with injected readings (no memory read, no clock).

``tests/data/trigger_noise_cpu.json`` is real noise: glibc's in-use bytes (and the resident set) at each
of 2000 boundaries of each ``gradguard bench`` scenario, recorded by ``python -m benchmarks.trigger``.
``watch()`` below is a model of the watch around the trigger: the start-up check audits the first
boundary, every request is audited, and an audit stamps what is alive, so a leak is judged two
boundaries after the audit that first saw it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

from gradguard import GradGuardError
from gradguard._watch.trigger import RESIDENT_FLOOR, Request, Trigger, TriggerSettings

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
LEAK = 256 * KiB
NOISE = json.loads((Path(__file__).parents[1] / "data" / "trigger_noise_cpu.json").read_text())
SCENARIOS = sorted(NOISE["scenarios"])


def recorded(scenario: str, figure: str = "mallinfo2") -> list[int]:
    """The clean run's figures at each boundary, in bytes."""
    entry = NOISE["scenarios"][scenario][figure]
    values = [entry["first"]]
    for delta in entry["deltas"]:
        values.append(values[-1] + delta)
    return [v * entry["unit_bytes"] for v in values]


def leaking(figures: list[int], start: int, per_step: int = LEAK) -> list[int]:
    """``figures`` with a leak that keeps ``per_step`` more bytes at each boundary from ``start`` (1-based) on."""
    return [v + max(0, b - start + 1) * per_step for b, v in enumerate(figures, start=1)]


@dataclasses.dataclass
class Outcome:
    requests: list[tuple[int, Request]]
    audits: list[int]
    reported: int | None
    trigger: Trigger

    def boundaries(self) -> list[int]:
        return [b for b, _ in self.requests]


def watch(
    series: Iterable[Mapping[str, int]],
    *,
    leak_start: int | None = None,
    settings: TriggerSettings | None = None,
    startup: tuple[int, ...] = (1,),
) -> Outcome:
    """The trigger inside a model of the watch (see the module documentation); ``warn`` mode: a leak found
    again is not new."""
    trigger = Trigger(settings)
    requests: list[tuple[int, Request]] = []
    audits: list[int] = []
    reported = seen = None
    for b, readings in enumerate(series, start=1):
        request = trigger.observe(readings)
        if request is not None:
            requests.append((b, request))
        elif b not in startup and (seen is None or b != seen + 2):
            continue
        new = False
        if leak_start is not None and b >= leak_start:
            if seen is None:
                seen = b  # the audit stamps the leak's graphs; two boundaries later they are old
            elif reported is None and b >= seen + 2:
                reported, new = b, True
        audits.append(b)
        trigger.audited(new)
    return Outcome(requests, audits, reported, trigger)


def cpu(figures: Iterable[int]) -> list[dict[str, int]]:
    return [{"cpu": v} for v in figures]


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


def test_the_defaults_are_the_documented_ones() -> None:
    s = TriggerSettings()
    values = (s.floor, s.fraction, s.window, s.boundaries, s.backoff)
    assert values == (256 * KiB, 1 / 1024, 64, 2, 2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.floor = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value, accepted",
    [
        ("floor", 0, "a whole number of bytes >= 1"),
        ("floor", 1.5, "a whole number of bytes >= 1"),
        ("floor", True, "a whole number of bytes >= 1"),
        ("window", 0, "a whole number of boundaries >= 1"),
        ("boundaries", -1, "a whole number of boundaries >= 1"),
        ("fraction", 1.0, "a number >= 0 and < 1"),
        ("fraction", float("nan"), "a number >= 0 and < 1"),
        ("fraction", "0.1", "a number >= 0 and < 1"),
        ("backoff", 0.5, r"a number >= 1 \(1: no back-off\)"),
    ],
)
def test_a_bad_setting_names_the_value_and_what_is_accepted(field: str, value: object, accepted: str) -> None:
    message = rf"TriggerSettings\({field}={value!r}\) is not accepted; accepted: {accepted}"
    with pytest.raises(GradGuardError, match=message):
        TriggerSettings(**{field: value})  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Clean runs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_clean_recorded_run_asks_for_no_audit_in_2000_boundaries(scenario: str) -> None:
    outcome = watch(cpu(recorded(scenario)))
    assert len(recorded(scenario)) == 2000
    assert outcome.requests == [] and outcome.audits == [1]  # the start-up check, nothing more


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_resident_set_with_its_own_floor_asks_for_nothing_and_still_sees_the_leak(scenario: str) -> None:
    """The resident set (the fallback without glibc's mallinfo2) moves by whole mappings: it gets
    ``RESIDENT_FLOOR``."""
    settings = TriggerSettings(floor=RESIDENT_FLOOR)
    figures = recorded(scenario, "statm")
    assert watch(cpu(figures), settings=settings).requests == []
    leaked = watch(cpu(leaking(figures, 500)), leak_start=500, settings=settings)
    assert leaked.reported is not None and leaked.reported <= 500 + RESIDENT_FLOOR // LEAK + 4


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_resident_set_under_the_default_floor_settles_after_a_few_back_offs(scenario: str) -> None:
    """Each clean episode doubles the threshold until the noise fits under it."""
    outcome = watch(cpu(recorded(scenario, "statm")))
    grew = outcome.boundaries()
    assert len(grew) <= 6
    assert outcome.trigger.backoffs == len(grew)


def test_empty_readings_never_ask() -> None:
    outcome = watch([{}] * 500)
    assert outcome.requests == [] and outcome.trigger.thresholds() == {}


def test_a_step_in_the_level_costs_one_audit_then_backs_off() -> None:
    """A dataloader's prefetch filling up, a cache made once: the level steps up by 8 MiB at boundary 300."""
    figures = recorded("lora-checkpoint")
    figures = [v + (8 * MiB if b >= 300 else 0) for b, v in enumerate(figures, start=1)]
    outcome = watch(cpu(figures))
    assert outcome.boundaries() == [301]
    assert outcome.trigger.backoffs == 1
    assert outcome.trigger.thresholds()["cpu"] == 2 * 256 * KiB


def test_a_step_at_the_first_boundary_is_absorbed_by_the_start_up_audit() -> None:
    """Optimizer state made at the first step: the start-up check audits that boundary, and every audit
    re-bases the mark."""
    figures = recorded("pp-last-stage")
    figures = [v + (0 if b == 1 else 64 * MiB) for b, v in enumerate(figures, start=1)]
    assert watch(cpu(figures), startup=(1, 2)).requests == []
    # Without it the trigger alone sees the step once, and backs off once.
    alone = watch(cpu(figures), startup=())
    assert alone.boundaries() == [3] and alone.trigger.backoffs == 1


def test_a_ramp_slower_than_floor_over_window_never_asks() -> None:
    """4 KiB per boundary is the slowest growth the default rule sees: below it, drift is ignored."""
    figures = [100 * MiB + b * 3 * KiB for b in range(2000)]
    assert watch(cpu(figures)).requests == []


@pytest.mark.parametrize("per_step", [16 * KiB, 64 * KiB, 256 * KiB])
def test_a_warm_up_ramp_costs_a_few_episodes_not_a_storm(per_step: int) -> None:
    """A level that climbs for 200 boundaries and then holds: episodes end each time with nothing found and
    double the threshold, until the ramp's growth over the window no longer crosses it."""
    figures = recorded("megatron-gpt")
    figures = [v + min(max(0, b - 100), 200) * per_step for b, v in enumerate(figures, start=1)]
    outcome = watch(cpu(figures))
    grew = outcome.boundaries()
    # each episode doubles the threshold; none once it exceeds what the ramp adds over a window
    assert 1 <= len(grew) <= math.log2(64 * per_step / (256 * KiB)) + 2
    assert all(b <= 320 for b in grew)  # nothing once the ramp has ended
    assert outcome.trigger.backoffs == len(grew)


# --------------------------------------------------------------------------------------------------
# Leaks
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_leak_of_256_kib_per_step_from_step_500_is_reported_within_four_boundaries(scenario: str) -> None:
    outcome = watch(cpu(leaking(recorded(scenario), 500)), leak_start=500)
    assert outcome.boundaries()[0] in (501, 502)
    assert outcome.requests[0][1].devices == ("cpu",)
    assert outcome.reported is not None and outcome.reported <= 504


def test_a_persisting_leak_in_warn_mode_backs_off_and_falls_silent() -> None:
    """Reported once, kept (``warn``): every later episode finds nothing new, so each doubles the threshold;
    the gaps between episodes grow, and once the threshold exceeds what the leak adds over a window the
    trigger leaves it to the backstop."""
    outcome = watch(cpu(leaking(recorded("lora-checkpoint"), 500)), leak_start=500)
    grew = outcome.boundaries()
    gaps = [b - a for a, b in zip(grew, grew[1:])]
    assert gaps[1:] == sorted(gaps[1:]) and gaps[-1] >= 8 * gaps[1]
    assert len(outcome.requests) <= 25
    assert max(outcome.boundaries()) < 1000  # nothing over the last 1000 of its 1500 leaking boundaries
    assert outcome.trigger.thresholds()["cpu"] > 64 * LEAK  # window x rate: this leak can no longer cross it


def test_without_back_off_a_persisting_leak_keeps_asking() -> None:
    settings = TriggerSettings(backoff=1)
    outcome = watch(cpu(leaking(recorded("lora-checkpoint"), 500)), leak_start=500, settings=settings)
    assert len(outcome.boundaries()) > 300


def test_the_threshold_grows_with_the_level() -> None:
    """60 GiB allocated on a GPU: the threshold is 60 MiB, and a leak of 45 MiB per step crosses it at its
    second boundary and is asked for at its third."""
    figures = [60 * GiB] * 100 + [60 * GiB + k * 45 * MiB for k in range(1, 10)]
    outcome = watch([{"cuda:0": v} for v in figures])
    assert outcome.trigger.thresholds()["cuda:0"] >= 60 * MiB
    b, request = outcome.requests[0]
    assert (b, request.threshold["cuda:0"]) == (103, 60 * MiB)


def test_several_devices_are_judged_apart_and_only_the_one_that_grew_backs_off() -> None:
    rng = random.Random(0)
    cpu_figures = recorded("megatron-gpt")
    series: list[dict[str, int]] = []
    for b, figure in enumerate(cpu_figures, start=1):
        readings = {"cpu": figure, "cuda:0": 8 * GiB + rng.randrange(0, 2 * MiB)}
        if b >= 100 and b % 7:  # a device first used at boundary 100, and not read at every boundary
            readings["cuda:1"] = 2 * GiB + max(0, b - 500) * 45 * MiB if b < 900 else 2 * GiB + 400 * 45 * MiB
        series.append(readings)
    outcome = watch(series, leak_start=501)
    first_b, first = outcome.requests[0]
    assert first.devices == ("cuda:1",) and first_b in (501, 502, 503)
    assert outcome.reported is not None and outcome.reported <= first_b + 2
    thresholds = outcome.trigger.thresholds()
    assert thresholds["cpu"] == 256 * KiB and 8 * MiB <= thresholds["cuda:0"] < 8 * MiB + 4 * KiB  # not backed off
    assert thresholds["cuda:1"] > 2 * MiB
    assert all(r.devices == ("cuda:1",) for _, r in outcome.requests)


def test_an_audit_that_found_something_new_does_not_back_off_and_a_declined_request_neither() -> None:
    trigger = Trigger()
    for _ in range(10):
        assert trigger.observe({"cpu": 100 * MiB}) is None
    assert trigger.observe({"cpu": 101 * MiB}) is None
    assert trigger.observe({"cpu": 102 * MiB}) is not None
    trigger.audited(True)
    assert trigger.observe({"cpu": 102 * MiB}) is None
    assert trigger.backoffs == 0 and trigger.requests == 1
    trigger.observe({"cpu": 103 * MiB})
    assert trigger.observe({"cpu": 104 * MiB}) is not None
    trigger.declined()  # the caller's budget: no audit ran
    assert trigger.requests == 1
    assert trigger.observe({"cpu": 105 * MiB}) is not None  # still above: asked again
    trigger.audited(False)
    assert trigger.observe({"cpu": 105 * MiB}) is None
    assert trigger.observe({"cpu": 105 * MiB}) is None
    assert trigger.backoffs == 1 and trigger.thresholds()["cpu"] == 512 * KiB


def test_a_request_says_what_grew_by_how_much() -> None:
    trigger = Trigger()
    trigger.observe({"cpu": 100 * MiB})
    trigger.observe({"cpu": 101 * MiB})
    request = trigger.observe({"cpu": 102 * MiB})
    assert request is not None
    assert str(request) == "memory grew: cpu +2.0 MiB over its low-water mark (threshold 256.0 KiB)"


def test_a_count_rule_asks_at_a_rise_of_one() -> None:
    """The parameters' reference count (:mod:`gradguard._graph.held`): floor 1, no fraction, one boundary."""
    trigger = Trigger(TriggerSettings(floor=1, fraction=0.0, boundaries=1))
    for _ in range(5):
        assert trigger.observe({"held": 7}) is None
    assert trigger.observe({"held": 8}) is not None
