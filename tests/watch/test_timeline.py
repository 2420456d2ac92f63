"""The watch's timeline: bounded whatever the run's length, a step in the curve never smoothed away, read
back as written, and bad input refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _helpers import env

from gradguard._watch.timeline import Timeline

ROOT = Path(__file__).resolve().parents[2]


def _memory(timeline: Timeline, clock: str = "micro") -> tuple[list[int], list[int]]:
    buckets = timeline.buckets(clock)
    return [b[3] for b in buckets], [b[4] for b in buckets]


def test_few_points_are_kept_as_they_are() -> None:
    timeline = Timeline(most=16)
    for i in range(5):
        timeline.point("micro", i // 2, i, 100 + i, 7, i * 0.5)
    timeline.point("step", 2, 5, None, None, 3.0)
    assert timeline.buckets("micro") == [[i // 2, i, i * 0.5, 100 + i, 100 + i, 7, 7, 1] for i in range(5)]
    assert timeline.buckets("step") == [[2, 5, 3.0, None, None, None, None, 1]]


def test_decimation_keeps_each_buckets_lowest_and_highest_figure() -> None:
    """A one-point spike and a step up survive ten thousand points in 64 buckets."""
    timeline = Timeline(most=64)
    for i in range(10_000):
        memory = 1000 + (5000 if i == 4321 else 0) + (700 if i >= 7000 else 0)
        timeline.point("micro", i // 4, i, memory, i % 3, i / 100)
    low, high = _memory(timeline)
    assert len(low) <= 64 and sum(b[7] for b in timeline.buckets("micro")) == 10_000
    assert max(high) == 6000 and high.count(6000) == 1  # the spike, in one bucket
    assert min(low) == 1000 and low[-1] == 1700  # the step up: flat after it
    crossing = [i for i, (lo, hi) in enumerate(zip(low, high)) if lo == 1000 and hi == 1700]
    assert len(crossing) <= 1  # the bucket of the step itself holds both sides
    steps = [b[0] for b in timeline.buckets("micro")]
    assert steps == sorted(steps) and steps[-1] == 9999 // 4


def test_none_figures_merge_with_read_ones() -> None:
    timeline = Timeline(most=4)
    for i in range(40):
        timeline.point("step", i, i, None if i % 2 else i, None, float(i))
    buckets = timeline.buckets("step")
    assert all(b[3] is not None and b[5] is None for b in buckets)


def test_a_million_boundaries_serialize_under_a_megabyte_and_point_stays_cheap() -> None:
    timeline = Timeline()
    start = time.perf_counter()
    for i in range(1_000_000):
        timeline.point("micro", i // 8, i, 12_345_678_901 + i * 1024, 120_000 + i % 97, i * 0.0123)
        if i % 8 == 7:
            timeline.point("step", i // 8 + 1, i, 12_345_678_901 + i * 1024, 120_000, i * 0.0123)
    spent = time.perf_counter() - start
    for k in range(3000):  # far more events than are kept
        timeline.event("audit", "", k, k, float(k), text="x" * 1000)
        timeline.event("report", f"__main__:h{k}[*]", k, k, float(k), bytes=10**12)
    text = json.dumps(timeline.to_dict(), separators=(",", ":"))
    assert len(text) <= 1_000_000, len(text)
    assert len(timeline.buckets("micro")) <= 4096 and len(timeline.buckets("step")) <= 4096
    assert sum(b[7] for b in timeline.buckets("micro")) == 1_000_000
    # not a timing assertion of the watch's budget (benchmarks/watch measures it): a bound that only a
    # quadratic folding would break, on the slowest CI machine
    assert spent < 60, spent


def test_events_keep_the_first_per_holder_and_kind_the_latest_and_a_count() -> None:
    timeline = Timeline()
    for k in range(20):
        timeline.event("audit", "", k, 2 * k, k / 10)
    timeline.event("leak-start", "__main__:losses[*]", 2, 4, 0.2, bytes=64)
    timeline.event("repair", "__main__:losses[*]", 3, 6, 0.3, bytes=64, text="gave back 64 B")
    events = timeline.events()
    audits = [e for e in events if e["kind"] == "audit"]
    assert [e["step"] for e in audits] == [0, 1, 2, 3, 4, 5, 6, 7, 19]
    counted = {(c["holder"], c["kind"]): c["count"] for c in timeline.to_dict()["counts"]}
    assert counted[("", "audit")] == 20 and counted[("__main__:losses[*]", "repair")] == 1
    assert [e["seconds"] for e in events] == sorted(e["seconds"] for e in events)


def test_the_latest_point_is_of_either_clock() -> None:
    timeline = Timeline(most=4)
    assert timeline.latest() is None
    for i in range(30):
        timeline.point("micro", i // 2, i, 100 + i, 5, float(i))
    timeline.point("step", 15, 30, 500, 9, 30.5)
    assert timeline.latest() == {"clock": "step", "step": 15, "micro": 30, "memory": 500, "nodes": 9, "seconds": 30.5}
    timeline.point("micro", 15, 31, 131, None, 31.0)
    latest = timeline.latest()
    assert latest == {"clock": "micro", "step": 15, "micro": 31, "memory": 131, "nodes": None, "seconds": 31.0}


def test_a_timeline_reads_back_as_it_was_written_and_goes_on() -> None:
    timeline = Timeline(most=32)
    for i in range(500):
        timeline.point("micro", i // 4, i, 1000 + i, 3, i * 0.01)
    timeline.event("leak-start", "__main__:losses[*]", 5, 20, 0.2, bytes=8)
    data = json.loads(json.dumps(timeline.to_dict()))
    back = Timeline.from_dict(data)
    assert back.to_dict() == timeline.to_dict()
    back.point("micro", 125, 500, 5000, 3, 5.0)
    assert back.buckets("micro")[-1][4] == 5000 and len(back.buckets("micro")) <= 32


def _data() -> dict[str, Any]:
    timeline = Timeline(most=8)
    timeline.point("step", 1, 2, 10, 3, 0.5)
    timeline.event("audit", "", 1, 2, 0.5)
    return timeline.to_dict()


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda d: d.update(format="other"), "timeline field 'format' is 'other', not 'gradguard-timeline'"),
        (lambda d: d.update(version=9), "timeline field 'version' is 9, not 1 (written by another gradguard)"),
        (lambda d: d.update(most=1), "timeline field 'most' is 1, not a whole number >= 2"),
        (lambda d: d.pop("clocks"), "timeline field 'clocks' is None"),
        (
            lambda d: d["clocks"]["step"]["memory_min"].append(3),
            "timeline field 'clocks.step.memory_min' has 2 values, not 1 (as many as 'step')",
        ),
        (lambda d: d["clocks"]["step"].update(seconds=[-1]), "timeline field 'clocks.step.seconds[]' is -1"),
        (lambda d: d["clocks"]["micro"].update(step="x"), "timeline field 'clocks.micro.step' is 'x', not a list"),
        (lambda d: d["events"][0].update(kind="boom"), "timeline field 'events[0].kind' is 'boom', not one of"),
        (lambda d: d["events"][0].update(step=True), "timeline field 'events[0].step' is True"),
        (lambda d: d.update(counts={}), "timeline field 'counts' is {}"),
    ],
)
def test_a_bad_timeline_is_refused_naming_what_is_wrong(change: Any, said: str) -> None:
    data = _data()
    change(data)
    with pytest.raises(ValueError, match="^" + __import__("re").escape(said)):
        Timeline.from_dict(data)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=r"clock='minute' is not accepted; accepted: 'step' or 'micro'"):
        Timeline().point("minute", 0, 0, None, None, 0.0)
    with pytest.raises(ValueError, match=r"event kind='oops' is not accepted"):
        Timeline().event("oops", "", 0, 0, 0.0)
    with pytest.raises(ValueError, match=r"Timeline\(most=1\) is not accepted"):
        Timeline(most=1)
    with pytest.raises(ValueError, match="a timeline is a JSON object, not list"):
        Timeline.from_dict([])  # type: ignore[arg-type]


_FINALIZER_IN_A_FOLD = """
import torch
import gradguard
from gradguard._watch.timeline import Timeline

m, m2 = torch.nn.Linear(8, 1), torch.nn.Linear(4, 1)
opt, opt2 = torch.optim.SGD(m.parameters(), 0.01), torch.optim.SGD(m2.parameters(), 0.01)
fold, nested = Timeline._fold, [0]


def fold_running_a_finalizer(self, series):
    # What a collection inside the fold does when it frees an object whose __del__ trains a second model.
    if not nested[0]:
        nested[0] = 1
        m2(torch.ones(2, 4)).sum().backward()
        opt2.step()
        nested[0] = 0
    fold(self, series)


Timeline._fold = fold_running_a_finalizer
with gradguard.watch(mode="raise") as scope:
    for _ in range(1200):
        m(torch.ones(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
buckets = scope.watcher.timeline.buckets("step")
print("RESULT", len(buckets), all(a[0] <= b[0] for a, b in zip(buckets, buckets[1:])))
"""


def test_a_finalizer_that_steps_an_optimizer_inside_the_timeline_s_fold_does_not_hang(tmp_path: Path) -> None:
    """A boundary reached while the timeline folds its buffer, in the same thread (a collection inside the
    fold ran a finalizer that backwards and steps a second model), records its point without waiting for
    the lock its own thread holds, and the buckets stay in order."""
    (tmp_path / "train.py").write_text(_FINALIZER_IN_A_FOLD)
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    try:
        run = subprocess.run(
            [sys.executable, "train.py"],
            cwd=tmp_path,
            env=env(PYTHONPATH=path),
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the watched program hung: its boundary waited for the timeline's lock its own thread held")
    assert run.returncode == 0, run.stderr
    result, buckets, ordered = run.stdout.split()[-3:]
    assert result == "RESULT" and int(buckets) > 1000 and ordered == "True", run.stdout
