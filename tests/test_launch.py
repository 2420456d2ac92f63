"""The pieces ``gradguard run`` reaches every process with, in-process where they can be: the watch's
``on_audit`` listeners and the warnings' origin tag; a process's identity; its report file; the merged
summary; the bootstrap (in fresh interpreters: what it costs a process that never imports torch, that
it sets up once torch is imported, and that it chains to a user's own ``sitecustomize``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import env

import gradguard
from gradguard._launch import _identity, _merge, _report, _settings
from gradguard._policy import site as _site


def _leaky_steps(watcher: gradguard.Watcher, steps: int) -> list[torch.Tensor]:
    kept = []
    model = torch.nn.Linear(2, 1)
    for _ in range(steps):
        kept.append(model(torch.randn(1, 2)).sum())
        watcher.boundary()
    return kept


# --------------------------------------------------------------------------- the watch's listeners, the origin


def test_on_audit_listeners_run_after_each_audit_and_see_the_error_before_it_leaves() -> None:
    seen: list[tuple[int, int, str | None]] = []

    def listener(watcher: gradguard.Watcher, error: BaseException | None) -> None:
        outcomes = [h.outcome for h in watcher.history()]
        seen.append((watcher.audits, len(outcomes), None if error is None else type(error).__name__))
        if error is not None:
            error.args = (f"[tagged] {error.args[0]}",)

    watcher = gradguard.Watcher(every=1, mode="raise")
    watcher.on_audit(listener)
    with pytest.raises(gradguard.GraphRetentionError, match=r"^\[tagged\] gradguard: 1 holder keeps"):
        _leaky_steps(watcher, 3)
    # a frame's list: a leak once it survived two boundaries (the watch's grace for frame variables)
    assert seen == [(1, 0, None), (2, 0, None), (3, 1, "GraphRetentionError")]


def test_the_origin_prefixes_the_watch_warnings() -> None:
    watcher = gradguard.Watcher(every=1, mode="warn")
    _site.set_origin(lambda: "rank 1/2, pid 7 on node-3")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kept = _leaky_steps(watcher, 3)
    finally:
        _site.set_origin(None)
    del kept
    assert [str(w.message)[:39] for w in caught] == ["[rank 1/2, pid 7 on node-3] gradguard: "]


# --------------------------------------------------------------------------- identity


@pytest.mark.parametrize(
    ("environ", "label", "source"),
    [
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "rank 1/2", "RANK"),  # torchrun, accelerate, deepspeed
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, "rank 3/4", "SLURM_PROCID"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8"}, "rank 0/8", "OMPI_COMM_WORLD_RANK"),
        ({"RANK": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "rank 2", "RANK"),  # torchrun under srun: RANK wins
        ({"RANK": "x", "WORLD_SIZE": "2"}, f"pid {os.getpid()}", None),
        ({}, f"pid {os.getpid()}", None),
    ],
)
def test_a_process_is_named_by_its_launchers_rank_else_its_pid(
    environ: dict[str, str], label: str, source: str | None
) -> None:
    identity = _identity.identify(environ)
    assert (identity.label, identity.rank_from) == (label, source)
    assert identity.tag.endswith(f"pid {os.getpid()} on {identity.host}")


# --------------------------------------------------------------------------- reports and the merged summary


def _report_of(**fields: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "format": _report.FORMAT,
        "version": _report.VERSION,
        "pid": 100,
        "host": "node-1",
        "rank": None,
        "world_size": None,
        "local_rank": None,
        "rank_from": None,
        "actor": None,
        "label": "pid 100",
        "top": False,
        "every": "auto",
        "mode": "raise",
        "boundaries": 0,
        "audits": 0,
        "audit_seconds": 0.0,
        "holders": [],
        "stats": [],
        "at_exit": True,
        "error": None,
    }
    report.update(fields)
    return report


def _holder(pinned: int, outcome: str = "raised", path: str = "__main__:KEPT[0]") -> dict[str, Any]:
    return {
        "holder": "__main__:KEPT[*]",
        "path": path,
        "fix": "KEPT = gradguard.guard([]) (in __main__)",
        "outcome": outcome,
        "tensors": 3,
        "pinned_bytes": pinned,
        "survived": 2,
        "audits": 2,
        "repaired": 0,
    }


def _rank(rank: int, **fields: Any) -> dict[str, Any]:
    return _report_of(pid=200 + rank, rank=rank, world_size=2, rank_from="RANK", label=f"rank {rank}/2", **fields)


def test_a_run_that_reached_no_process_says_nothing_was_checked() -> None:
    merged = _merge.merge([], folder="/tmp/run")
    assert merged.text == (
        "gradguard run: no process of the command imported torch (no report in /tmp/run): nothing was checked"
    )
    assert (merged.raised, merged.reached, merged.checked) == (False, 0, False)


def test_processes_that_ran_no_optimizer_step_are_not_called_clean() -> None:
    one = _merge.merge([_report_of(top=True)])
    assert one.text.splitlines()[-1] == (
        "gradguard watch: 0 step boundaries, 0 audited; nothing was checked: no optimizer step ran"
    )
    two = _merge.merge([_report_of(top=True), _report_of(pid=101, label="pid 101")])
    assert two.text.splitlines()[-1] == (
        "gradguard watch: 0 step boundaries, 0 audited, in 2 processes; nothing was checked: no process ran an "
        "optimizer step (pid 100 (the command), pid 101 imported torch)"
    )
    unaudited = _merge.merge([_report_of(top=True, boundaries=3, every=5)])
    assert "3 step boundaries, 0 audited; nothing was checked: no step boundary was audited (every=5" in unaudited.text
    assert not (one.checked or two.checked or unaudited.checked)


def test_ranks_holding_the_same_holder_merge_into_one_row() -> None:
    reports = [
        _report_of(top=True, label="pid 100"),  # torchrun's agent: imported torch, ran no step
        _rank(1, boundaries=4, audits=4, holders=[_holder(1024)], at_exit=False),
        _rank(0, boundaries=4, audits=4, holders=[_holder(3072)]),
    ]
    merged = _merge.merge(reports)
    lines = merged.text.splitlines()
    assert lines[0] == "gradguard stats: no guarded store saw a record"
    assert lines[1] == (
        "gradguard watch: 8 step boundaries, 8 audited, in 3 processes; 1 holder kept autograd graphs across step "
        "boundaries in 2 processes (4.0 KiB of tensors and ~0 B of graph nodes pinned at their last audit):"
    )
    assert lines[2].split() == [
        "holder", "processes", "tensors", "pinned", "(max)", "pinned", "(sum)", "nodes", "steps", "survived",
        "outcome", "fix",
    ]  # fmt: skip
    assert lines[4].split()[:14] == [
        "__main__:KEPT[*]", "ranks", "0-1", "of", "2", "3", "3.0", "KiB", "4.0", "KiB", "0", "2", "raised", "KEPT",
    ]  # fmt: skip
    assert lines[7].split()[:5] == ["rank", "0/2", "4", "4", "1"] and lines[7].endswith("at exit")
    assert lines[8].split()[:5] == ["rank", "1/2", "4", "4", "1"] and lines[8].endswith("(no exit handler ran)")
    assert lines[9] == "(and 1 process that imported torch but ran no optimizer step: pid 100 (the command))"
    assert merged.raised and merged.reached == 3 and merged.checked


def test_one_process_reads_as_gradguard_run_always_printed_and_stats_add_up() -> None:
    site = {
        "store": "audit",
        "site": "__main__:KEPT[*]",
        "records": 3,
        "tensors_detached": 3,
        "pinned_bytes_per_record": 8,
        "pinned_bytes_released": 24,
    }
    merged = _merge.merge(
        [_report_of(top=True, boundaries=4, audits=4, holders=[_holder(0, "repaired")], stats=[site])]
    )
    lines = merged.text.splitlines()
    assert lines[0] == "gradguard stats:" and lines[3].split()[:4] == ["audit", "__main__:KEPT[*]", "3", "3"]
    assert lines[4].startswith("gradguard watch: 4 step boundaries, 4 audited; 1 holder kept autograd graphs")
    assert lines[5].split() == ["holder", "tensors", "pinned", "nodes", "steps", "survived", "outcome", "fix"]
    assert lines[7].split()[:7] == ["__main__:KEPT[0]", "3", "0", "B", "0", "2", "repaired"]
    assert not merged.raised


def test_reports_are_written_whole_and_unreadable_files_are_said(tmp_path: Path) -> None:
    identity = _identity.identify({"RANK": "0", "WORLD_SIZE": "2"})
    path = tmp_path / _report.file_name(identity)
    _report.write(str(path), _report_of(pid=identity.pid))
    (tmp_path / "report-broken-1-00.json").write_text("{")
    (tmp_path / "report-other-2-00.json").write_text(json.dumps({"format": "something else"}))
    reports, problems = _report.read_run(str(tmp_path))
    assert [r["pid"] for r in reports] == [identity.pid] and not list(tmp_path.glob("*.tmp"))
    assert sorted(p.split(":")[0] for p in problems) == ["report-broken-1-00.json", "report-other-2-00.json"]
    assert "gradguard: report-broken-1-00.json: unreadable" in _merge.merge(reports, problems).text


def test_a_fork_child_counts_from_the_fork_on() -> None:
    watcher = gradguard.Watcher(every=1, mode="warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = _leaky_steps(watcher, 3)  # the parent's own leak, found at its third boundary
        base = _report.Baseline.of(watcher, watcher.history(), {})
        kept += _leaky_steps(watcher, 2)  # the child's: the same holder, audited again
    del kept
    identity = _identity.identify({})
    report = _report.content(
        identity, top=False, every=1, mode="warn", watcher=watcher, history=watcher.history(), stats={}, base=base,
        at_exit=False, error=None,
    )  # fmt: skip
    assert (report["boundaries"], report["audits"]) == (2, 2)
    assert [(h["audits"], h["outcome"]) for h in report["holders"]] == [(2, "warned")]
    untouched = _report.content(
        identity, top=False, every=1, mode="warn", watcher=watcher, history=watcher.history(), stats={},
        base=_report.Baseline.of(watcher, watcher.history(), {}), at_exit=False, error=None,
    )  # fmt: skip
    assert (untouched["boundaries"], untouched["holders"]) == (0, [])


# --------------------------------------------------------------------------- the bootstrap, in fresh interpreters

_SHOW = """
import json, sys
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("gradguard", "torch", "wrapt"))
finders = [type(f).__name__ for f in sys.meta_path]
site = getattr(sys.modules.get("sitecustomize"), "__file__", None)
print(json.dumps({"heavy": heavy, "finders": finders, "sitecustomize": site}))
"""


def _armed(tmp_path: Path, code: str, *, user_site: Path | None = None, **extra: str) -> dict[str, Any]:
    paths = [_settings.BOOTSTRAP, *([str(user_site)] if user_site else []), os.environ.get("PYTHONPATH", "")]
    environ = env(PYTHONPATH=os.pathsep.join(p for p in paths if p), GRADGUARD_AUDIT=None, **extra)
    environ[_settings.REPORT_DIR] = str(tmp_path / "run")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=180)
    assert run.returncode == 0, run.stderr
    return {"out": run.stdout, "err": run.stderr, "reports": _report.read_run(str(tmp_path / "run"))[0]}


def test_a_process_that_never_imports_torch_imports_nothing_of_gradguard(tmp_path: Path) -> None:
    shown = json.loads(_armed(tmp_path, _SHOW)["out"])
    assert shown["heavy"] == [] and shown["finders"][0] == "_WaitForTorch"
    assert shown["sitecustomize"] == os.path.join(_settings.BOOTSTRAP, "sitecustomize.py")
    assert not (tmp_path / "run").exists()  # not reached: no report


@pytest.mark.parametrize("first", ["torch", "gradguard"])
def test_importing_torch_sets_the_process_up_once(tmp_path: Path, first: str) -> None:
    code = textwrap.dedent(
        f"""
        import os, sys
        import {first}
        import torch, gradguard
        from gradguard._launch import _process
        _process.setup()  # a second call: nothing
        assert not any(type(f).__name__ == "_WaitForTorch" for f in sys.meta_path)
        print(gradguard._scope.enforce.installed())
        """
    )
    result = _armed(tmp_path, code, GRADGUARD_RUN_AUDIT="3", RANK="1", WORLD_SIZE="2")
    assert "('watch', '#" in result["out"] and "('engine', 'megatron'): 1" in result["out"]
    (report,) = result["reports"]
    assert (report["label"], report["every"], report["at_exit"], report["top"]) == ("rank 1/2", 3, True, False)
    assert report["boundaries"] == 0 and report["error"] is None


def test_the_users_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    code = _SHOW + "import os; print(os.environ.get('USER_SITECUSTOMIZE'))"
    result = _armed(tmp_path, code, user_site=user)
    shown, ran = result["out"].splitlines()
    assert ran == "ran" and json.loads(shown)["sitecustomize"] == str(user / "sitecustomize.py")
    assert json.loads(shown)["heavy"] == [] and json.loads(shown)["finders"][0] == "_WaitForTorch"


def test_a_bad_run_audit_is_said_and_reported_not_raised_into_import_torch(tmp_path: Path) -> None:
    result = _armed(tmp_path, "import torch", GRADGUARD_RUN_AUDIT="often")
    assert "gradguard: GRADGUARD_RUN_AUDIT='often' is not accepted" in result["err"]
    (report,) = result["reports"]
    assert report["every"] is None and "GRADGUARD_RUN_AUDIT='often'" in report["error"]


def test_the_bootstrap_names_the_same_variable_as_the_settings() -> None:
    source = Path(_settings.BOOTSTRAP, "sitecustomize.py").read_text()
    assert f'_REPORT_DIR = "{_settings.REPORT_DIR}"' in source


def test_the_committed_start_up_cost_meets_its_budget_and_names_its_machine() -> None:
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    doc = json.loads((results / "launch-cpu.json").read_text())
    assert doc["machine_line"] in (results / "launch-cpu.md").read_text()
    (case,) = [c for c in doc["cases"] if c["case"] == "pass"]
    assert case["rounds"] >= 21 and case["paired_median_ms"] <= case["budget_ms"] == 20.0


def test_the_start_up_benchmark_quick_run(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    out, md = tmp_path / "launch.json", tmp_path / "launch.md"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.launch", "--quick", "--json", str(out), "--md", str(md)],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["machine_line"] in md.read_text()
    assert [(c["case"], c["rounds"]) for c in doc["cases"]] == [("pass", 5), ("import torch", 1)]
    assert [c["reports_written"] for c in doc["cases"]] == [0, 2]  # `pass` is never reached; `import torch` is


def test_the_command_itself_with_a_rank_says_which_rank() -> None:
    """``torchrun -m gradguard run train.py`` and ``srun gradguard run train.py``: one summary per rank."""
    merged = _merge.merge([_rank(1, top=True, boundaries=2, audits=2, holders=[_holder(0)])])
    lines = merged.text.splitlines()
    assert lines[1].startswith("gradguard watch: 2 step boundaries, 2 audited, in 1 process; 1 holder kept")
    assert lines[4].split()[:3] == ["__main__:KEPT[0]", "rank", "1"]
