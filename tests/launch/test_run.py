"""``gradguard run``: a command (a script, ``-m module``, a program) with ``enforce()`` and the watch set
up in the process it starts, with no change to the code; the reports, the one summary, the exit status;
``gradguard env`` and ``gradguard report`` for processes it does not start.

The runs that train start a fresh interpreter (``python -m gradguard run ...``), which starts the
command as its child: the exit status and the summary at exit are the point. How the target is run
(``sys.argv``, ``__main__``, ``sys.path[0]``, the exit status) and the refusals are checked from
``_cli.main`` in this process, which also starts the command as a child. Launchers, multiprocessing
and Ray are in ``tests/integration/test_launchers.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _helpers import env
from _tables import table_rows

import gradguard
from gradguard._launch._settings import python_path
from gradguard._scope import enforce as _enforce
from gradguard._tools import cli as _cli

LEAKY = """
import sys

import torch

HISTORY = []


def main(steps):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        if "--leak" in sys.argv:
            HISTORY.append({"loss": loss})
        print("stepping", flush=True)
        opt.step()
        opt.zero_grad()
    print("steps done:", steps, "leaked:", sum(r["loss"].grad_fn is not None for r in HISTORY))


if __name__ == "__main__":
    main(int(sys.argv[1]))
"""


ANNOUNCED = "gradguard run: each process's report goes to "


def _row(summary: str, holder: str) -> list[str]:
    """The cells of the summary's table row of ``holder``, its fix the last."""
    (row,) = [row for row in table_rows(summary) if row[0] == holder]
    return row


def _gradguard(*argv: str, cwd: Path, **environ: str | None) -> subprocess.CompletedProcess[str]:
    changes: dict[str, str | None] = {"GRADGUARD_AUDIT": None, "TMPDIR": str(cwd), **environ}
    return subprocess.run(
        [sys.executable, "-m", "gradguard", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env(**changes),
        timeout=180,
    )


def test_raise_mode_fails_the_run_at_the_step_that_found_the_leak(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LEAKY)
    run = _gradguard("run", "--mode", "raise", "--audit-every", "1", "train.py", "4", "--leak", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "steps done" not in run.stdout  # the error came out of an optimizer.step()
    announced, err = run.stderr.split("\n", 1)  # the run folder is said first, then the command's own stderr
    assert announced.startswith(ANNOUNCED + str(tmp_path / "gradguard-run-"))
    assert err.startswith("Traceback (most recent call last):\n  File ") and 'train.py", line ' in err
    assert "gradguard._tools.cli" not in err.split("GraphRetentionError")[0]  # the traceback starts at the script
    assert "gradguard.GraphRetentionError: gradguard: 1 holder keeps autograd graphs" in err
    # the summary: the stats, then the command's watch in its own words (what it checked is the watch's to say)
    summary = err[err.index("gradguard stats: no guarded store saw a record") :].splitlines()
    assert summary[1].startswith(f"gradguard watch: {run.stdout.count('stepping')} step boundar")
    assert _row("\n".join(summary), "__main__:HISTORY[*]['loss']")[-2:] == [
        "raised", "detach before storing into HISTORY[0]['loss'] (in __main__): t.detach() or t.item(); "
        "or HISTORY = gradguard.guard([]), which detaches what is stored, or refuses it in raise mode"
    ]  # fmt: skip


def test_a_module_in_detach_mode_is_repaired_and_counted(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(LEAKY)
    run = _gradguard("run", "--mode=detach", "--audit-every=1", "-m", "pkg.train", "4", "--leak", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    leaked = int(run.stdout.split("leaked: ")[1])
    assert leaked < 4  # repaired: only the records the watch's grace leaves are still attached
    err = run.stderr
    (line,) = [line for line in err.splitlines() if line.startswith("audit  __main__:HISTORY[*]['loss']  ")]
    stats = [cell.strip() for cell in line.split("  ") if cell.strip()]  # the repairs, counted in the stats table
    assert int(stats[2]) == int(stats[3]) == 4 - leaked
    assert err[err.index("gradguard watch:") :].startswith("gradguard watch: 4 step boundaries")
    assert _row(err, "__main__:HISTORY[*]['loss']")[-2].startswith("repaired")  # and what it gave back, measured


WARNS = """
import warnings

import torch

import gradguard

warnings.simplefilter("always")
STORE = gradguard.guard([], mode="warn", name="records")
HISTORY = []
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    STORE.append({"loss": loss})
    HISTORY.append(loss)
    opt.step()
print("stored graphs:", sum(r["loss"].grad_fn is not None for r in STORE))
"""


def test_warnings_at_a_module_run_with_dash_m_name_its_line(tmp_path: Path) -> None:
    """``python -m pkg.mod`` runs the module as ``__main__`` while its loader serves only ``pkg.mod``:
    a warning attributed to its line must not ask that loader for ``__main__``'s source (ImportError)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(WARNS)
    run = _gradguard("run", "--mode=warn", "--audit-every=1", "-m", "pkg.train", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "stored graphs: 0" in run.stdout
    err = run.stderr
    assert "train.py:16: GraphRetentionWarning: 1 tensor(s) carr" in err  # the store's warning, at STORE.append
    assert "train.py:18: GraphRetentionWarning: gradguard: __main__:HISTORY[*]\n  keeps an autograd graph" in err


def test_a_clean_script_passes_in_raise_mode(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LEAKY)
    run = _gradguard("run", "--mode", "raise", "--audit-every", "1", "train.py", "3", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "steps done: 3 leaked: 0" in run.stdout
    watch = run.stderr[run.stderr.index("gradguard watch:") :]
    assert watch.startswith("gradguard watch: 3 step boundaries") and "kept autograd graphs" not in watch


def test_the_script_runs_as_main_with_its_own_argv(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GRADGUARD_AUDIT", raising=False)
    script = tmp_path / "show.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import gradguard
            print("NAME", __name__, "ARGV", sys.argv, "PATH0", sys.path[0], "MODE", gradguard.get_mode())
            sys.exit(int(sys.argv[1]))
            """
        )
    )
    argv = list(sys.argv)
    code = _cli.main(
        ["run", "--mode", "warn", "--audit-every", "0", "--report-dir", str(tmp_path / "run"), str(script), "3"]
        + ["--mode", "x"]
    )
    out, err = capfd.readouterr()  # the script runs in a child process: its output is the file descriptors'
    assert code == 3 and sys.argv == argv and _enforce.installed() == {}
    assert f"NAME __main__ ARGV {[str(script), '3', '--mode', 'x']} PATH0 {tmp_path} MODE warn" in out
    assert "gradguard stats: no guarded store saw a record" in err
    assert err.splitlines()[-1] == "gradguard watch: off (audit 0) in every process: no step boundary was checked"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--audit-every", "often", "x.py"], "--audit-every='often' is not accepted; accepted: a positive"),
        (["--mode", "loud", "x.py"], "gradguard run: --mode='loud' is not a gradguard mode"),
        (["missing.py"], "gradguard run: cannot open 'missing.py': no such file or directory"),
    ],
)
def test_bad_arguments_are_refused_before_the_script_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli.main(["run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_target_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _cli.main(["run", "--mode", "raise"])
    assert exited.value.code == 2
    assert "give a script to run, or -m MODULE" in capsys.readouterr().err


IMPORTS_GRADGUARD = """
import sys

import torch

import gradguard  # the program uses gradguard (guard(), @forward_step, ...): GRADGUARD_AUDIT needs nothing more

HISTORY = []
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    HISTORY.append(loss)
    opt.step()
print("done")
"""


def _python(script: Path, **environ: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env(**environ), timeout=180
    )


def test_gradguard_audit_turns_the_watch_on_for_the_whole_process(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(IMPORTS_GRADGUARD)
    run = _python(script, GRADGUARD_AUDIT="1", GRADGUARD="warn")
    assert run.returncode == 0 and "done" in run.stdout, run.stderr
    assert "GraphRetentionWarning: gradguard: __main__:HISTORY[*]\n  keeps an autograd graph" in run.stderr
    unset = _python(script, GRADGUARD_AUDIT=None, GRADGUARD="warn")
    assert unset.returncode == 0 and "GraphRetentionWarning" not in unset.stderr, unset.stderr
    repaired = _python(script, GRADGUARD_AUDIT="1", GRADGUARD=None)  # the default mode: detach repairs
    assert repaired.returncode == 0 and "GraphRetentionWarning" not in repaired.stderr, repaired.stderr


def test_a_bad_gradguard_audit_is_refused_at_the_first_step(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(IMPORTS_GRADGUARD)
    run = _python(script, GRADGUARD_AUDIT="often")
    assert run.returncode == 1 and "done" not in run.stdout
    assert "opt.step()" in run.stderr  # out of the first optimizer step, not out of the import
    assert "gradguard.GradGuardError: GRADGUARD_AUDIT='often'" in run.stderr, run.stderr


def test_gradguard_run_takes_the_process_watch_over(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LEAKY)
    run = subprocess.run(
        [sys.executable, "-m", "gradguard", "run", "--mode", "raise", "train.py", "4", "--leak"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env(GRADGUARD_AUDIT="1"),
        timeout=180,
    )
    assert run.returncode == 1, run.stderr
    steps = run.stdout.count("stepping")  # one watch: each optimizer step one boundary, not two
    assert f"gradguard watch: {steps} step boundaries" in run.stderr and steps < 4


# --------------------------------------------------------------------------- any command, its exit status, signals


def test_a_program_is_found_on_path_and_an_unknown_one_is_refused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "mytrainer"  # a launcher as pip installs one: a script on PATH that starts Python
    program.write_text(f'#!/bin/sh\nexec {sys.executable} -c "import sys; print(\'ARGS\', sys.argv[1:])" "$@"\n')
    program.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert _cli.main(["run", "--report-dir", str(tmp_path / "run"), "mytrainer", "--nproc", "2", "x.py"]) == 0
    out, err = capfd.readouterr()
    assert "ARGS ['--nproc', '2', 'x.py']" in out
    assert err.splitlines()[-1].startswith(
        f"gradguard run: no process reported to {tmp_path / 'run'}: nothing was checked. Either none of the command's "
        "processes imported torch, or the ones that did were not reached"
    )
    assert _cli.main(["run", "no-such-launcher", "--flag"]) == 2
    assert capfd.readouterr().err == (
        "gradguard run: 'no-such-launcher' is neither a file nor a program on PATH; give a script (train.py), "
        "-m MODULE, or a program on PATH (torchrun, accelerate, deepspeed, python, ...)\n"
    )


@pytest.mark.parametrize("command", ["run", "env"])
def test_a_report_dir_holding_an_earlier_run_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    (tmp_path / "report-0123456789ab-node-1-7-00.json").write_text("{")
    argv = [sys.executable, "-c", "raise SystemExit('the command must not start')"] if command == "run" else []
    assert _cli.main([command, "--report-dir", str(tmp_path), *argv]) == 2
    assert f"gradguard {command}: --report-dir={str(tmp_path)!r} already holds 1 report(s) of an earlier run" in (
        capsys.readouterr().err
    )


def test_a_command_ended_by_a_signal_exits_128_plus_its_number(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    assert _cli.main(["run", "--report-dir", str(tmp_path / "run"), sys.executable, "-c", kill]) == 128 + 15


SLEEPER = """
import signal, sys, time

def stop(signum, frame):
    print("child got", signal.Signals(signum).name, flush=True)
    sys.exit(7)

signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 7), (signal.SIGINT, 130)], ids=["TERM", "INT"])
def test_sigterm_and_sigint_are_passed_on_to_the_command(tmp_path: Path, signum: int, status: int) -> None:
    """Not from a terminal (stdin is not one here): the signal reached gradguard run only, which passes it on;
    SIGINT ends the Python child with KeyboardInterrupt (130), SIGTERM runs its handler. gradguard run's
    handlers are in place before the command starts, so the signal is sent as soon as the child is ready."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    run = subprocess.Popen(
        [sys.executable, "-m", "gradguard", "run", "--report-dir", str(tmp_path / "run"), "sleeper.py"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env(GRADGUARD_AUDIT=None),
        start_new_session=True,  # its own process group: a failed test kills all of it, the sleeper too
    )
    try:
        assert run.stdout is not None and run.stdout.readline() == "ready\n"
        run.send_signal(signum)
        out, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
    assert run.returncode == status, err
    assert ("child got SIGTERM" in out) == (signum == signal.SIGTERM)
    assert "gradguard run: no process reported to " in err  # the summary still comes


# --------------------------------------------------------------------------- processes gradguard run does not start


def test_gradguard_env_then_gradguard_report_as_a_cluster_job_would(tmp_path: Path) -> None:
    """The SLURM recipe without SLURM: the environment exported, a task started with the rank srun gives it,
    the reports merged afterwards; the JSON form carries the same variables (Ray's runtime_env, a pod spec)."""
    (tmp_path / "train.py").write_text(LEAKY)
    folder = tmp_path / "run"
    cli = f"{sys.executable} -m gradguard"
    job = (
        f'eval "$({cli} env --report-dir {folder} --mode raise --audit-every 1)" && '
        f"SLURM_PROCID=1 SLURM_NTASKS=2 {sys.executable} train.py 4 --leak; "
        f"{cli} report {folder}"
    )
    run = subprocess.run(
        ["bash", "-c", job], capture_output=True, text=True, cwd=tmp_path, env=env(GRADGUARD_AUDIT="1"), timeout=300
    )
    assert run.returncode == 1, run.stderr  # gradguard report: a leak found in raise mode
    assert "[rank 1/2, pid " in run.stderr and "] gradguard: 1 holder keeps autograd graphs" in run.stderr
    trained, merged = run.stdout.split("gradguard stats:")  # the task's output, then gradguard report's
    summary = ("gradguard stats:" + merged).splitlines()
    steps = trained.count("stepping")
    assert summary[1].startswith(f"gradguard watch: {steps} step boundaries (") and ", in 1 process" in summary[1]
    assert _row(merged, "__main__:HISTORY[*]['loss']")[:2] == ["__main__:HISTORY[*]['loss']", "rank 1 of 2"]
    assert summary[-1].startswith("gradguard report: no report from rank 0 of 2: not checked in this run")
    exported = json.loads(
        subprocess.run(
            [sys.executable, "-m", "gradguard", "env", "--json", "--report-dir", str(tmp_path / "other")],
            capture_output=True,
            text=True,
            env=env(PYTHONPATH="/opt/mine"),
            check=True,
            timeout=120,
        ).stdout
    )
    bootstrap = os.path.join(os.path.dirname(gradguard.__file__), "_launch", "bootstrap")
    run_id = exported.pop("GRADGUARD_RUN_ID")
    assert exported == {
        "PYTHONPATH": f"{bootstrap}{os.pathsep}/opt/mine",
        "GRADGUARD_REPORT_DIR": str(tmp_path / "other"),
        "GRADGUARD_RUN_AUDIT": "auto",
    }
    assert len(run_id) == 12 and int(run_id, 16) >= 0  # a new run each time


def test_gradguard_run_inside_a_reached_process_reports_its_command_and_leaves_a_record_outside(
    tmp_path: Path,
) -> None:
    """``torchrun -m gradguard run train.py`` under an outer run, or with ``gradguard env`` exported: the inner
    gradguard run watches its command; the outer run's folder gets the record of the inner run, and nothing
    of the inner's processes."""
    (tmp_path / "train.py").write_text(LEAKY)
    outer, inner = tmp_path / "outer", tmp_path / "inner"
    armed = python_path(os.environ.get("PYTHONPATH"))  # the bootstrap first, as an outer run exports it
    outer_run = {"PYTHONPATH": armed, "GRADGUARD_REPORT_DIR": str(outer), "GRADGUARD_RUN_ID": "outer1"}
    run = _gradguard("run", "--report-dir", str(inner), "train.py", "2", cwd=tmp_path, **outer_run)
    assert run.returncode == 0, run.stderr
    (record,) = [json.loads(p.read_text()) for p in outer.glob("report-outer1-*.json")]
    assert (record["kind"], record["folder"], record["raised"], record["reached"]) == ("nested-run", str(inner),
                                                                                     False, 1)  # fmt: skip
    (report,) = [json.loads(p.read_text()) for p in inner.glob("report-*.json")]
    assert report["top"] and report["figures"]["boundaries"] == 2 and report["run"] == record["nested_run"]


def test_a_store_refusal_is_in_the_summary(tmp_path: Path) -> None:
    # a guarded store refuses a record before any optimizer step: the summary says so, not that nothing was seen
    (tmp_path / "train.py").write_text(
        "import torch, gradguard\n"
        "records = gradguard.guard([], name='metrics')\n"
        "loss = torch.nn.Linear(4, 1)(torch.randn(2, 4)).sum()\n"
        "records.append({'loss': loss})\n"
    )
    run = _gradguard("run", "--mode", "raise", "train.py", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "gradguard.GraphRetentionError: 1 tensor(s) carrying an autograd graph reached store metrics" in run.stderr
    summary = run.stderr[run.stderr.index("gradguard stats:") :].splitlines()
    assert summary[1].split() == ["store", "site", "records", "tensors", "detached", "released", "(est.)", "refused"]
    assert summary[3].split() == ["metrics", f"{tmp_path / 'train.py'}:4", "1", "0", "0", "B", "1"]
    assert summary[4:6] == [
        "gradguard watch: no optimizer step and no backward was seen: no step boundary was checked (the",
        "  guarded stores' records were: above)",
    ]
