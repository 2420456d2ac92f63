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
from gradguard._launch import _identity, _read, _report, _settings
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
        ({"RANK": "x", "WORLD_SIZE": "2"}, "pid PID", None),
        ({"RANK": "²", "WORLD_SIZE": "2"}, "pid PID", None),  # str.isdigit takes it, int() does not
        ({"RANK": "1", "WORLD_SIZE": "٣"}, "rank 1", "RANK"),
        ({}, "pid PID", None),
    ],
)
def test_a_process_is_named_by_its_launchers_rank_else_its_pid(
    environ: dict[str, str], label: str, source: str | None
) -> None:
    """The ids are the same in every pytest-xdist worker: the pid is put in here, not in the parameters."""
    identity = _identity.identify(environ)
    assert (identity.label, identity.rank_from) == (label.replace("PID", str(os.getpid())), source)
    assert identity.tag.endswith(f"pid {os.getpid()} on {identity.host}")


def test_a_process_keeps_its_start_time_across_exec() -> None:
    """Its start time, with its pid, names a process across the programs it runs (``os.execv``)."""
    here = _identity.started()
    assert here is not None and here == _identity.started(os.getpid())
    code = "import os, sys; sys.path[:0] = [os.environ['SRC']]; from gradguard._launch import _identity; "
    execed = subprocess.run(
        [sys.executable, "-c", code + "print(os.getpid(), _identity.started()); sys.stdout.flush(); "
         "os.execv(sys.executable, [sys.executable, '-c', sys.argv[1] + 'print(os.getpid(), _identity.started())', "
         "sys.argv[1]])", code],
        capture_output=True, text=True, env=env(SRC=str(Path(gradguard.__file__).parents[1])), timeout=120,
    )  # fmt: skip
    before, after = execed.stdout.split("\n")[:2]
    assert before == after, execed.stderr
    assert _identity.started(1) != here  # another process: its own start time


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
    return {"out": run.stdout, "err": run.stderr, "reports": _read.read_run(str(tmp_path / "run"), None).reports}


def test_a_process_that_never_imports_torch_imports_nothing_of_gradguard(tmp_path: Path) -> None:
    shown = json.loads(_armed(tmp_path, _SHOW)["out"])
    assert shown["heavy"] == [] and shown["finders"][0] == "_WaitForTorch"
    assert shown["sitecustomize"] == os.path.join(_settings.BOOTSTRAP, "sitecustomize.py")
    assert not (tmp_path / "run").exists()  # not reached: no report


@pytest.mark.parametrize(
    "first", ["import torch", "import gradguard", "from gradguard import guard", "import gradguard._guards.store"]
)
def test_importing_torch_sets_the_process_up_once(tmp_path: Path, first: str) -> None:
    """Whichever import brings torch in, the setup runs once it and every gradguard module being imported
    are complete (the setup imports gradguard's modules: never one half-initialised)."""
    code = textwrap.dedent(
        f"""
        import os, sys
        {first}
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
    assert (report.label, report.every, report.at_exit, report.top) == ("rank 1/2", 3, True, False)
    assert report.figures.boundaries == 0 and report.error is None


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
    assert report.every is None and "GRADGUARD_RUN_AUDIT='often'" in report.error


def test_the_bootstrap_names_the_same_variables_and_format_as_the_settings_and_the_report() -> None:
    source = Path(_settings.BOOTSTRAP, "sitecustomize.py").read_text()
    assert f'_REPORT_DIR = "{_settings.REPORT_DIR}"' in source
    assert f'_RUN_ID = "{_settings.RUN_ID}"' in source and f'_PARENT = "{_settings.PARENT}"' in source
    assert f'_FORMAT = "{_report.FORMAT}"' in source and f"_VERSION = {_report.VERSION}" in source


def test_a_process_that_imports_torch_but_not_gradguard_reports_why(tmp_path: Path) -> None:
    """An interpreter that cannot import gradguard (a second virtualenv with torch only, here: gradguard made
    unimportable) is said on stderr and reported, and the program goes on."""
    code = "import sys; sys.modules['gradguard'] = None; import torch; print('trained')"
    result = _armed(tmp_path, code, GRADGUARD_RUN_ID="abc", GRADGUARD_RUN_PARENT="1")
    assert result["out"] == "trained\n"
    assert "gradguard: not set up in process " in result["err"]
    (report,) = result["reports"]
    assert isinstance(report, _report.NotSetUp) and (report.run, report.executable) == ("abc", sys.executable)
    assert "ModuleNotFoundError" in str(report.error)


def test_the_committed_start_up_cost_meets_its_budget_and_names_its_machine() -> None:
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    doc = json.loads((results / "launch-cpu.json").read_text())
    assert doc["machine_line"] in (results / "launch-cpu.md").read_text()
    budgets = {c["case"]: (c["rounds"], c["paired_median_ms"], c["budget_ms"]) for c in doc["cases"]}
    for case, budget in (("gradguard run", 200.0), ("pass", 20.0)):
        rounds, paired, committed = budgets[case]
        assert rounds >= 21 and committed == budget and paired <= budget, case


def test_the_start_up_benchmark_quick_run(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
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
    assert [(c["case"], c["rounds"]) for c in doc["cases"]] == [("gradguard run", 5), ("pass", 5), ("import torch", 1)]
    assert [c["reports_written"] for c in doc["cases"]] == [0, 0, 2]  # only `import torch` is reached


def test_the_launcher_imports_no_torch_and_of_the_watch_only_its_summary_and_numbers(tmp_path: Path) -> None:
    """``gradguard run``'s own process: an interpreter's start-up, the launcher's modules and the watch's
    records and renderer, nothing more (``-X importtime`` lists what this process imported; the command, its
    child, is not listed)."""
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "gradguard", "run", "--report-dir", str(tmp_path / "run"),
         sys.executable, "-c", "import torch"],
        capture_output=True, text=True, env=env(GRADGUARD_AUDIT="1"), timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "gradguard._launch.commands" in imported and "gradguard._launch._merge" in imported
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "numpy"))
    watch = sorted(m for m in imported if m.startswith("gradguard._watch"))
    expected = ["gradguard._watch", "gradguard._watch.summary", "gradguard._watch.timeline", "gradguard._watch.tuning"]
    assert heavy == [] and watch == expected


LAZY = """
import sys
import gradguard
assert "torch" not in sys.modules and "gradguard._watch.watcher" not in sys.modules
assert gradguard.GradGuardError.__module__ == "gradguard" and gradguard.__version__
names = dir(gradguard)
assert set(gradguard.__all__) <= set(names)
from gradguard import guard  # the first public name that needs torch loads them all
assert "torch" in sys.modules and callable(guard) and gradguard.watch.__name__ == "watch"
try:
    gradguard.no_such_name
except AttributeError as exc:
    print(exc)
"""


def test_importing_gradguard_imports_no_torch_until_a_name_needs_it() -> None:
    run = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, env=env(), timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "module 'gradguard' has no attribute 'no_such_name'\n"


GRADGUARD_FIRST = """
import gradguard  # before torch: the process watch starts when the program imports torch
import torch

kept = []
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    loss = model(torch.randn(2, 4)).sum()
    loss.backward()
    kept.append(loss)
    opt.step()
print("done")
"""


def test_gradguard_audit_starts_the_watch_when_gradguard_is_imported_before_torch() -> None:
    run = subprocess.run(
        [sys.executable, "-c", GRADGUARD_FIRST], capture_output=True, text=True, timeout=300,
        env=env(GRADGUARD_AUDIT="1", GRADGUARD="warn"),
    )  # fmt: skip
    assert run.returncode == 0 and "done" in run.stdout, run.stderr
    assert "GraphRetentionWarning: gradguard: __main__:kept[*]\n  keeps an autograd graph" in run.stderr
