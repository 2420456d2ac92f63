"""A run's reports read back and merged into the one summary, in-process: what is said of each process,
of the ones that did not report, and of a report that cannot be used; a run reads only its own reports."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from _reports import holder, process, process_record, rank, records
from _tables import table_rows

from gradguard._launch import _merge, _names, _read, _report, commands
from gradguard._watch import summary

# --------------------------------------------------------------------------- what was checked, and by whom


def test_a_run_that_nothing_reported_to_says_why_that_can_be_and_claims_nothing_more() -> None:
    merged = _merge.merge([], folder="/tmp/run")
    assert merged.text.startswith("gradguard run: no process reported to /tmp/run: nothing was checked. Either none ")
    assert "not reached" in merged.text and "-I, -E or -S" in merged.text
    assert "no process of the command imported torch" not in merged.text  # it may well have: not a claim to make
    assert (merged.raised, merged.reached, merged.checked) == (False, 0, False)
    hinted = _merge.merge([], folder="/tmp/run", hint="the command's Python ignores PYTHONPATH (-I)")
    assert hinted.text == (
        "gradguard run: no process reported to /tmp/run: nothing was checked: the command's Python ignores "
        "PYTHONPATH (-I); its child processes are checked only if they import torch and run without those flags"
    )


def test_processes_that_ran_no_optimizer_step_are_not_called_clean() -> None:
    one = _merge.merge(records(process(top=True)))
    nothing = "gradguard watch: no optimizer step and no backward was seen: nothing was checked"
    assert one.text.splitlines()[-1] == nothing
    two = _merge.merge(records(process(top=True), process(pid=101)))
    assert two.text.splitlines()[-2:] == [
        "gradguard watch: no optimizer step and no backward was seen in 2 processes: nothing was checked",
        "(pid 100 (the command), pid 101 imported torch but ran no optimizer step)",
    ]
    unaudited = _merge.merge(records(process(top=True, boundaries=3, every=5)))
    assert unaudited.text.splitlines()[-1] == (
        "gradguard watch: 3 step boundaries, 0 audited: no audit ran, nothing was checked"
    )
    assert not (one.checked or two.checked or unaudited.checked)


def test_a_run_with_the_watch_off_says_so_rather_than_nothing() -> None:
    merged = _merge.merge(records(process(top=True, every=None)))
    assert merged.text.splitlines() == [
        "gradguard stats: no guarded store saw a record",
        "gradguard watch: off (audit 0) in every process: no step boundary was checked",
    ]
    assert not merged.checked


def test_ranks_holding_the_same_holder_merge_into_one_row() -> None:
    reports = records(
        process(top=True),  # torchrun's agent: imported torch, ran no step
        rank(1, boundaries=4, audits=4, holders=[holder(1024)], at_exit=False),
        rank(0, boundaries=4, audits=4, holders=[holder(3072)]),
    )
    merged = _merge.merge(reports)
    lines = merged.text.splitlines()
    assert lines[0] == "gradguard stats: no guarded store saw a record"
    assert lines[1:4] == [
        "gradguard watch: 8 step boundaries, 8 audited, in 3 processes",
        "  1 holder kept autograd graphs across step boundaries in 2 processes (4.0 KiB of tensors and ~0 B",
        "    of graph nodes pinned at their last audit)",
    ]
    assert lines[4].split() == [
        "holder", "processes", "tensors", "pinned", "(max)", "pinned", "(sum)", "nodes", "steps", "survived",
        "outcome",
    ]  # fmt: skip
    assert table_rows(merged.text) == [
        ["__main__:KEPT[*]", "ranks 0-1 of 2", "3", "3.0 KiB", "4.0 KiB", "0", "2", "raised",
         "KEPT = gradguard.guard([]) (in __main__)"]
    ]  # fmt: skip
    assert lines[11].split()[:5] == ["rank", "0/2", "4", "4", "1"] and lines[11].endswith("at exit")
    assert lines[12].split()[:5] == ["rank", "1/2", "4", "4", "1"] and lines[12].endswith("(no exit handler ran)")
    assert lines[13] == "(and 1 process that imported torch but ran no optimizer step: pid 100 (the command))"
    assert merged.raised and merged.reached == 3 and merged.checked


def test_one_process_reads_as_its_watchs_own_summary_and_stats_add_up() -> None:
    site = {
        "store": "audit",
        "site": "__main__:KEPT[*]",
        "records": 3,
        "tensors_detached": 3,
        "pinned_bytes_per_record": 8,
        "pinned_bytes_released": 24,
        "refused": 0,
    }
    report = process(top=True, boundaries=4, audits=4, holders=[holder(0, "repaired")], stats=[site])
    merged = _merge.merge(records(report))
    lines = merged.text.splitlines()
    assert lines[0] == "gradguard stats:" and lines[3].split()[:4] == ["audit", "__main__:KEPT[*]", "3", "3"]
    assert lines[4] == "gradguard watch: 4 step boundaries, 4 audited"
    assert lines[5].startswith("  1 holder kept autograd graphs")
    assert lines[7].split() == ["holder", "tensors", "pinned", "nodes", "steps", "survived", "outcome"]
    assert lines[9].split()[:7] == ["__main__:KEPT[0]", "3", "0", "B", "0", "2", "repaired"]
    assert lines[10] == "  fix: KEPT = gradguard.guard([]) (in __main__)"
    assert not merged.raised and len(lines) == 11
    one = process_record(report)
    assert "\n".join(lines[4:]) == summary.render(one.figures, one.holders)  # the watch's own renderer


def test_a_process_not_covered_and_one_killed_are_said_after_the_watchs_summary() -> None:
    one = process(top=True, boundaries=4, audits=4, at_exit=False)
    record = process_record(one)
    killed = _merge.merge(records(one), ["report-x.json: unreadable (...): its process is not covered"])
    assert killed.text.splitlines()[2:] == [
        *summary.render(record.figures, record.holders).splitlines(),
        "(the command's report is from its last audit: it ended without running its exit handlers (killed by",
        " a signal, os._exit, or a crash), so what it did after that audit was not checked)",
        "(1 other process not covered: above)",
    ]


def test_a_bounded_holder_is_listed_not_counted_and_unexplained_old_graphs_are_no_all_clear() -> None:
    kept = holder(64, "bounded", holder="__main__:Trainer.last_loss", path="__main__:Trainer.last_loss")
    reports = records(rank(0, boundaries=3, audits=3, holders=[kept]), rank(1, boundaries=3, audits=3, unexplained=2))
    merged = _merge.merge(reports)
    lines = merged.text.splitlines()
    assert lines[2] == "  no holder was found keeping a graph" and "outlived" not in merged.text
    assert "  bounded, not acted on (one step's graph, replaced every step): __main__:Trainer.last_loss (64 B)" in lines
    assert lines[3].startswith(
        "  NOT EXPLAINED in rank 1/2: 2 graphs older than two step boundaries were alive at the last audit"
    )
    assert not merged.raised


def test_the_command_itself_with_a_rank_says_which_rank() -> None:
    """``torchrun -m gradguard run train.py`` and ``srun gradguard run train.py``: one summary per rank."""
    merged = _merge.merge(records(rank(1, top=True, boundaries=2, audits=2, holders=[holder(0)])))
    lines = merged.text.splitlines()
    assert lines[1] == "gradguard watch: 2 step boundaries, 2 audited, in 1 process"
    assert lines[2].startswith("  1 holder kept")
    assert table_rows(merged.text)[0][:2] == ["__main__:KEPT[0]", "rank 1 of 2"]


@pytest.mark.parametrize("leak", [False, True], ids=["clean", "leaking"])
def test_a_single_process_that_ended_without_its_exit_handlers_says_its_report_is_from_its_last_audit(
    leak: bool,
) -> None:
    """Killed by a signal, or ``os._exit``: what it did after its last audit was not checked, and that is said
    for one process as for many."""
    report = process(top=True, boundaries=8, audits=8, at_exit=False, holders=[holder(8)] if leak else [])
    last = _merge.merge(records(report)).text.splitlines()[-2:]
    assert last[0].startswith("(the command's report is from its last audit: it ended without running its exit ")
    assert "not checked" in last[1]
    assert "exit handler" not in _merge.merge(records(dict(report, at_exit=True))).text


def test_the_programs_one_process_ran_through_exec_are_one_process() -> None:
    """``import torch`` then ``os.execv`` into a trainer: the pid and the start time are the same; one entry."""
    before = process(top=True, pid=300, started=777, written=1.0, argv=["launcher.py"], at_exit=False)
    after = process(top=True, pid=300, started=777, written=2.0, boundaries=4, audits=4, holders=[holder(8)])
    merged = _merge.merge(records(before, after))
    assert merged.text.count("(the command)") == 0  # one process: the command's summary, as always
    assert "ran no optimizer step" not in merged.text and merged.reached == 1
    assert merged.text.splitlines()[1:3] == [
        "gradguard watch: 4 step boundaries, 4 audited",
        "  1 holder kept autograd graphs across step boundaries (8 B of tensors and ~0 B of graph nodes",
    ]
    reused = process(top=False, pid=300, started=999, written=3.0)  # the same pid, a later process: another one
    assert _merge.merge(records(before, after, reused)).reached == 2


def test_a_hundred_processes_that_never_stepped_are_one_short_sentence() -> None:
    """DataLoader workers, Pool helpers (spawned: each reports once it imports torch): counted, not listed."""
    workers = [process(pid=1000 + i, role="multiprocessing child") for i in range(100)]
    ray = [process(pid=2000 + i, role="Ray worker") for i in range(4)]
    actor = process(pid=3000, actor="Trainer", label="actor Trainer")
    merged = _merge.merge(records(process(top=True, boundaries=3, audits=3), *workers, *ray, actor, process(pid=4000)))
    assert merged.text.splitlines()[-2:] == [
        "(and 106 processes that imported torch but ran no optimizer step: actor Trainer, 100 multiprocessing",
        " children, 4 Ray workers, 1 other process)",
    ]
    assert "pid 1000" not in merged.text and "pid 2000" not in merged.text and len(merged.text.splitlines()) == 8
    few = _merge.merge(records(process(top=True, boundaries=3, audits=3), *workers[:2]))
    assert few.text.splitlines()[-1].endswith("ran no optimizer step: pid 1000, pid 1001)")


def test_a_world_whose_ranks_did_not_all_report_says_which_did_not() -> None:
    merged = _merge.merge(records(rank(0, boundaries=2, audits=2)))
    last = merged.text.splitlines()[-1]
    assert last.startswith("gradguard run: no report from rank 1 of 2: not checked in this run (")
    assert "no report from" not in _merge.merge(records(rank(0, boundaries=2, audits=2), rank(1))).text
    # torchrun ... -m gradguard run: each rank is the command of a run of its own, which checks it
    assert "no report from" not in _merge.merge(records(rank(0, top=True, boundaries=2, audits=2))).text


def test_a_rank_that_stepped_but_was_never_audited_is_named_as_not_checked() -> None:
    merged = _merge.merge(records(rank(0, boundaries=4, audits=2), rank(1, boundaries=4)))
    said = "  no graph the watch followed outlived two step boundaries\n  not audited, so not checked: rank 1/2\n"
    assert said in merged.text


def _not_set_up(**fields: Any) -> dict[str, Any]:
    record = {key: value for key, value in process(**fields).items() if key in _report.FIELDS["not-set-up"]}
    record.update(kind="not-set-up", executable="/venv2/bin/python", error="ModuleNotFoundError: No module named 'x'")
    return record


def test_a_process_gradguard_could_not_be_set_up_in_is_said_never_counted_as_not_importing_torch() -> None:
    merged = _merge.merge(records(_not_set_up(top=True)), folder="/tmp/run")
    assert merged.text.splitlines() == [
        "gradguard run: pid 100 (the command) imported torch, but gradguard could not be set up in it: "
        "ModuleNotFoundError: No module named 'x' (its Python: /venv2/bin/python; gradguard must be installed for "
        "every interpreter the command runs): not checked",
        "gradguard run: nothing was checked: no report of a process gradguard was set up in could be used",
    ]
    beside = _merge.merge(records(_not_set_up(pid=5), process(top=True, boundaries=2, audits=2))).text
    assert "pid 5 imported torch, but gradguard could not be set up" in beside
    assert beside.splitlines()[-1] == "(1 other process not covered: above)"  # the all-clear does not cover it


def test_a_nested_run_is_said_with_its_outcome_and_a_leak_it_raised_fails_the_outer_run() -> None:
    record = _report.nested_record(
        run="r1", pid=400, host="node-1", top=True, folder="/tmp/inner", nested_run="abc", code=1, raised=True,
        reached=1, checked=True,
    )  # fmt: skip
    assert _read.check(_report.to_json(record)) is None
    merged = _merge.merge([record])
    assert merged.text == (
        "gradguard run: pid 400 (the command) is a gradguard run of its own: it watched its command and printed its "
        "own summary (1 process reported to it, a leak was found in raise mode, exit status 1); its reports are in "
        "/tmp/inner"
    )
    assert merged.raised and merged.checked


# --------------------------------------------------------------------------- one renderer


def _watched(tmp_path: Path) -> tuple[str, _report.ProcessReport]:
    """A real watcher's summary, and the report a process with that watcher writes, from the same moment."""
    import warnings

    import torch

    import gradguard
    from gradguard._launch import _identity

    class Trainer:
        last: torch.Tensor | None = None

    trainer, kept, model = Trainer(), [], torch.nn.Linear(2, 1)
    watcher = gradguard.Watcher(every=1, mode="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(6):
            loss = model(torch.randn(1, 2)).sum()
            kept.append(model(torch.randn(1, 2)).sum())  # a leak
            watcher.boundary()
            trainer.last = loss  # one step's graph, replaced at every step: bounded
    while True:  # the share of the time moves as time passes: the same wording before and after, so in between
        before = summary.render(watcher.figures(), watcher.history(), watcher.bounded())
        said = watcher.summary()
        report = _report.content(
            _identity.identify(), run="r1", started=None, top=True, every=1, mode="warn", figures=watcher.figures(),
            holders=[*watcher.history(), *watcher.bounded()], stats={}, base=_report.Baseline(), at_exit=True,
            error=None,
        )  # fmt: skip
        if summary.render(watcher.figures(), watcher.history(), watcher.bounded()) == before:
            return said, report


def test_one_process_merged_from_its_report_reads_exactly_as_its_watcher_summary(tmp_path: Path) -> None:
    said, report = _watched(tmp_path)
    assert "1 holder kept autograd graphs" in said and "bounded, not acted on" in said and "%" in said
    _report.write(str(tmp_path / _names.file_name("r1", "node-1", 1)), report)
    found = _read.read_run(str(tmp_path), "r1")
    assert found.reports == [report] and found.problems == []  # read back into the very records written
    assert _merge.merge(found.reports).text.splitlines()[1:] == said.splitlines()


def test_several_processes_are_the_same_renderer_over_each_ones_records(tmp_path: Path) -> None:
    said, report = _watched(tmp_path)
    ranks = [dataclasses.replace(report, pid=200 + r, rank=r, world_size=2, label=f"rank {r}/2", top=False)
             for r in (0, 1)]  # fmt: skip
    merged = _merge.merge(ranks).text.splitlines()
    expected = summary.summarize(
        [summary.WatchRecord(r.figures, r.holders, r.label) for r in ranks], who=lambda indices: "ranks 0-1 of 2"
    )
    assert merged[1 : 1 + len(expected.splitlines())] == expected.splitlines()
    assert merged[1].startswith(f"gradguard watch: {2 * report.figures.boundaries} step boundaries, ")
    assert "in 2 processes" in merged[1] and " in rank 0/2: " not in merged[1]  # one memory clause said once


# --------------------------------------------------------------------------- reading a folder back


def _write(folder: Path, report: dict[str, Any], name: str | None = None) -> Path:
    path = folder / (name or _names.file_name(report["run"], report["host"], report["pid"]))
    _report.write(str(path), report)
    return path


def test_reports_are_written_whole_and_a_run_reads_only_its_own(tmp_path: Path) -> None:
    mine = _write(tmp_path, process(run="r1", boundaries=2, audits=2))
    _write(tmp_path, process(run="r2", boundaries=2, audits=2, holders=[holder(8)]))  # another run's leak
    (tmp_path / "report-r2-broken-1-00.json").write_text("{")  # another run's damaged file: never opened
    found = _read.read_run(str(tmp_path), "r1")
    assert [r.run for r in found.reports] == ["r1"] and found.problems == [] and found.others == {"r2": 2}
    assert _names.run_of(mine.name) == "r1" and not list(tmp_path.glob("*.tmp"))
    merged = _merge.merge(found.reports, found.problems)
    assert not merged.raised and "no graph the watch followed outlived two step boundaries" in merged.text


def test_a_file_named_for_this_run_that_carries_another_run_id_is_not_taken(tmp_path: Path) -> None:
    _write(tmp_path, process(run="r2"), name="report-r1-node-1-100-00.json")
    (problem,) = _read.read_run(str(tmp_path), "r1").problems
    assert problem == (
        "report-r1-node-1-100-00.json: it carries the run id 'r2', not this run's 'r1': its process is not covered"
    )


def _inside(report: dict[str, Any], field: str) -> tuple[dict[str, Any], str]:
    """The object holding ``field`` (``figures.audits``, ``holders.fix``: in the first row) and its name."""
    if "." not in field:
        return report, field
    table, name = field.split(".")
    return (report[table][0] if isinstance(report[table], list) else report[table]), name


def _without(report: dict[str, Any], field: str) -> dict[str, Any]:
    report = json.loads(json.dumps(report))
    inside, name = _inside(report, field)
    del inside[name]
    return report


def _spelled(field: str) -> str:
    """A field as the problem line spells it: ``holders[0].fix``, ``figures.audits``."""
    return field if field.startswith("figures.") else field.replace(".", "[0].")


_EVERY_FIELD = (
    [f for f in _report.FIELDS["process"] if f not in ("format", "version", "kind")]
    + [f"figures.{f}" for f in _report.FIGURES_FIELDS]
    + [f"holders.{f}" for f in _report.HOLDER_FIELDS]
    + [f"stats.{f}" for f in _report.STATS_FIELDS]
)
_STATS_ROW = {
    "store": "s", "site": "x.py:1", "records": 1, "tensors_detached": 1, "pinned_bytes_per_record": 4,
    "pinned_bytes_released": 4, "refused": 0,
}  # fmt: skip


@pytest.mark.parametrize("field", _EVERY_FIELD)
def test_a_report_missing_any_field_the_summary_reads_is_named_and_never_counted_clean(
    tmp_path: Path, field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    report = process(run="r1", top=True, boundaries=3, audits=3, holders=[holder(8)], stats=[_STATS_ROW])
    path = _write(tmp_path, _without(report, field), name="report-r1-node-1-100-00.json")
    _write(tmp_path, process(run="r1", pid=101, boundaries=3, audits=3))
    found = _read.read_run(str(tmp_path), "r1")
    name = _spelled(field)
    assert found.problems == [f"{path.name}: the field {name!r} is missing: its process is not covered"]
    assert commands.report(str(tmp_path), None) == 1  # a report that cannot be used may have held a leak
    out = capsys.readouterr().out
    assert f"gradguard: {path.name}: the field {name!r} is missing" in out
    assert "(1 process not covered: above)" in out and "Traceback" not in out


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"figures.boundaries": "3"}, "the field 'figures.boundaries' is \"3\", not a whole number >= 0"),
        ({"figures.boundaries": True}, "the field 'figures.boundaries' is true, not a whole number >= 0"),
        ({"figures.audits": -1}, "the field 'figures.audits' is -1, not a whole number >= 0"),
        ({"figures.seconds": "1"}, "the field 'figures.seconds' is \"1\", not a number >= 0"),
        ({"figures": []}, "the field 'figures' is [], not an object of the watch's figures"),
        ({"every": 0}, "the field 'every' is 0, not a positive whole number, 'auto' or null"),
        ({"holders": {}}, "the field 'holders' is {}, not a list of holder records"),
        ({"holders.alive": 1}, "the field 'holders[0].alive' is 1, not true or false"),
        ({"top": "yes"}, "the field 'top' is \"yes\", not true or false"),
        ({"kind": "launcher"}, "the field 'kind' is \"launcher\", not one of 'process', 'not-set-up', 'nested-run'"),
        (
            {"version": 1},
            f"a gradguard-run-report of version 1, not {_report.VERSION}: written by another gradguard; merge it with",
        ),
        ({"format": "other"}, 'not a gradguard-run-report file (format "other")'),
    ],
    ids=[
        "text-count",
        "bool-count",
        "negative",
        "text-number",
        "figures-list",
        "every-0",
        "holders-dict",
        "holder-flag",
        "top-text",
        "kind",
        "version",
        "format",
    ],  # fmt: skip
)
def test_a_report_with_a_wrong_value_is_named_with_what_is_wrong(
    tmp_path: Path, change: dict[str, Any], said: str
) -> None:
    report = process(run="r1", holders=[holder(8)])
    for field, value in change.items():
        inside, name = _inside(report, field)
        inside[name] = value
    path = _write(tmp_path, report)
    (problem,) = _read.read_run(str(tmp_path), "r1").problems
    assert problem.startswith(f"{path.name}: {said}") and problem.endswith(": its process is not covered")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "unreadable (Expecting value: line 1 column 1 (char 0))"),
        ('{"format": "gradguard-run-report", "vers', "unreadable (Unterminated string starting at"),
        ("[1, 2]", "not a gradguard-run-report file (a JSON list, not an object)"),
        ("\udcff".encode("utf-8", "surrogateescape").decode("latin-1"), "unreadable ("),
    ],
    ids=["empty", "truncated", "a-list", "not-utf8"],
)
def test_a_damaged_report_is_one_line_naming_the_file_and_gradguard_report_exits_1(
    tmp_path: Path, text: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "report-r1-node-1-7-00.json").write_text(text, encoding="latin-1")
    assert commands.report(str(tmp_path), None) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"gradguard: report-r1-node-1-7-00.json: {said}") and len(out) == 2


def test_gradguard_report_of_a_folder_two_runs_share_asks_which(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path, process(run="r1", boundaries=2, audits=2))
    _write(tmp_path, process(run="r2", boundaries=2, audits=2, holders=[holder(8)]))
    assert commands.report(str(tmp_path), None) == 2
    err = capsys.readouterr().err
    assert f"gradguard report: {str(tmp_path)!r} holds the reports of 2 runs; give one with --run ID:" in err
    assert "r1: 1 report(s), the last written " in err and "r2: 1 report(s)" in err
    assert commands.report(str(tmp_path), "r1") == 0 and commands.report(str(tmp_path), "r2") == 1
    capsys.readouterr()
    assert commands.report(str(tmp_path), "r-1") == 2
    assert "gradguard report: --run='r-1' is not accepted; accepted: 1 to 64 letters, digits or '_'" in (
        capsys.readouterr().err
    )


def test_the_report_fields_are_what_a_process_writes(tmp_path: Path) -> None:
    """The schema the reader checks is the one the writer fills: a real process's report passes it."""
    import subprocess
    import sys

    from _helpers import env

    from gradguard._launch import _settings

    environ = env(PYTHONPATH=_settings.python_path(os.environ.get("PYTHONPATH")), GRADGUARD_AUDIT=None,
                  GRADGUARD_REPORT_DIR=str(tmp_path), GRADGUARD_RUN_ID="r9", GRADGUARD_RUN_AUDIT="1")  # fmt: skip
    code = (
        "import torch\nm = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\nkept = []\n"
        "for _ in range(3):\n    loss = m(torch.randn(1, 2)).sum()\n    loss.backward()\n    kept.append(loss)\n"
        "    opt.step()\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300)
    assert run.returncode == 0, run.stderr
    found = _read.read_run(str(tmp_path), "r9")
    (report,) = found.reports
    assert isinstance(report, _report.ProcessReport) and found.problems == []
    assert report.holders and report.figures.boundaries == 3 and report.figures.audits > 0
