"""A process's report carries its watch's timeline and the versions it ran with: written on one line,
read back, optional (a report without them is whole), and a damaged one names the file left out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _reports import process

from gradguard._launch import _names, _read, _report, commands
from gradguard._watch.timeline import Timeline


def _timeline() -> Timeline:
    timeline = Timeline(most=64)
    for i in range(1000):
        timeline.point("micro", i // 4, i, 10_000 + 64 * i, 30, i * 0.01)
        if i % 4 == 3:
            timeline.point("step", i // 4 + 1, i + 1, 10_000 + 64 * i, 30, i * 0.01)
    timeline.event("leak-start", "__main__:losses[*]", 1, 4, 0.04, bytes=64)
    return timeline


def _write(folder: Path, report: dict[str, Any], pid: int = 100) -> Path:
    path = folder / _names.file_name(report["run"], report["host"], pid)
    _report.write(str(path), report)
    return path


def test_a_report_with_a_timeline_reads_back_with_it_and_one_without_is_whole(tmp_path: Path) -> None:
    timeline = _timeline().to_dict()
    path = _write(tmp_path, {**process(), "timeline": timeline, "platform": {"python": "3.11.0", "torch": "2.13.0"}})
    _write(tmp_path, process(pid=101), pid=101)
    assert len(path.read_text().splitlines()) < 60  # the timeline's numbers on one line
    found = _read.read_run(str(tmp_path), "r1")
    assert found.problems == [] and len(found.reports) == 2
    with_it, without = sorted(found.reports, key=lambda r: r.pid)
    assert with_it.timeline == json.loads(json.dumps(timeline)) and with_it.platform["torch"] == "2.13.0"
    assert without.timeline is None and without.platform is None


def test_content_carries_the_watchers_timeline_and_the_versions() -> None:
    from gradguard._launch import _identity

    record = _report.content(
        _identity.identify(), run="r1", started=None, top=True, every=1, mode="warn", figures=None, holders=[],
        stats={}, base=_report.Baseline(), at_exit=True, error=None, timeline=_timeline(),
    )  # fmt: skip
    assert record.timeline is not None and record.timeline["format"] == "gradguard-timeline"
    assert record.platform is not None and {"python", "gradguard", "machine"} <= set(record.platform)
    document = _report.to_json(record)
    assert _read.check(json.loads(json.dumps(document))) is None


def test_a_damaged_timeline_names_the_file_left_out_and_the_rest_is_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timeline = _timeline().to_dict()
    timeline["clocks"]["micro"]["memory_max"] = timeline["clocks"]["micro"]["memory_max"][:-1]
    bad = _write(tmp_path, {**process(boundaries=3, audits=3), "timeline": timeline})
    newer = process(pid=102, boundaries=3, audits=3)
    newer["version"] = _report.VERSION + 1
    newer_path = _write(tmp_path, newer, pid=102)
    (tmp_path / "report-r1-node-1-103-00.json").write_text('{"format": "gradguard-run-report", "vers')
    _write(tmp_path, process(pid=101, boundaries=3, audits=3), pid=101)
    found = _read.read_run(str(tmp_path), "r1")
    assert len(found.reports) == 1 and len(found.problems) == 3
    said = "\n".join(found.problems)
    assert f"{bad.name}: the field 'timeline' is not a timeline: timeline field 'clocks.micro.memory_max' has" in said
    assert f"{newer_path.name}: a gradguard-run-report of version {_report.VERSION + 1}" in said
    assert "report-r1-node-1-103-00.json: unreadable (" in said
    assert commands.report(str(tmp_path), None) == 1
    out = capsys.readouterr().out
    assert "(3 processes not covered: above)" in out and "pid 101  3           3" in out


def test_a_twenty_thousand_step_runs_report_stays_under_a_megabyte(tmp_path: Path) -> None:
    timeline = Timeline()
    for step in range(20_000):
        for micro in range(8):
            timeline.point(
                "micro", step, 8 * step + micro, 40 * 2**30 + 4096 * step + micro * 2**20, 90_000, step * 0.5
            )
        timeline.point("step", step + 1, 8 * step + 8, 40 * 2**30 + 4096 * step, 90_000, step * 0.5 + 0.4)
        if step % 50 == 0:
            timeline.event("audit", "", step, 8 * step, step * 0.5)
    path = _write(tmp_path, {**process(boundaries=20_000, audits=400), "timeline": timeline.to_dict()})
    assert path.stat().st_size <= 1_000_000, path.stat().st_size
    (report,) = _read.read_run(str(tmp_path), "r1").reports
    assert report.timeline is not None and len(report.timeline["clocks"]["micro"]["step"]) <= 4096


def test_a_process_makes_its_reports_timeline_again_only_now_and_then_and_at_exit(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from gradguard._launch import _process
    from gradguard._launch._settings import Settings

    process = _process._Process(Settings({"GRADGUARD_REPORT_DIR": str(tmp_path), "GRADGUARD_RUN_ID": "r1"}))
    watcher: Any = SimpleNamespace(timeline=_timeline())
    first = process._timeline(watcher)
    watcher.timeline.point("step", 999, 4000, 1, 1, 99.0)
    assert process._timeline(watcher) is first  # within the interval: the same object, dumped once
    process.at_exit = True
    last = process._timeline(watcher)
    assert last is not first and last is not None and last["clocks"]["step"]["step"][-1] == 999
    assert process._timeline(SimpleNamespace()) is None  # a watcher that keeps no timeline
