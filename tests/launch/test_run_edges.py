"""``gradguard run`` at its edges: what the command's environment holds (an empty ``PYTHONPATH`` entry),
runs that share a folder, every option and variable checked before the command starts, and processes
the bootstrap cannot reach or set up (``python -I``, an interpreter without gradguard, a nested
``gradguard run``), a process that ``exec``s, and one killed before its exit handlers.

The runs start fresh interpreters (``python -m gradguard run ...``); the refusals are checked from
``_cli.main`` in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import env

import gradguard
from gradguard._errors import GradGuardError
from gradguard._launch import _settings, commands
from gradguard._tools import cli as _cli
from gradguard._watch import scope as _watcher

TRAIN = """
import sys
import torch

torch.set_num_threads(1)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for _ in range(4):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss if "--leak" in sys.argv else loss.item())
print("trained", flush=True)
"""


def _gradguard(*argv: str, cwd: Path, **environ: str | None) -> subprocess.CompletedProcess[str]:
    changes: dict[str, str | None] = {"GRADGUARD_AUDIT": None, "TMPDIR": str(cwd), "OMP_NUM_THREADS": "1", **environ}
    return subprocess.run(
        [sys.executable, "-m", "gradguard", *argv], capture_output=True, text=True, cwd=cwd, env=env(**changes),
        timeout=300,
    )  # fmt: skip


# --------------------------------------------------------------------------- the command's environment


def test_an_empty_pythonpath_entry_still_means_the_current_folder(tmp_path: Path) -> None:
    """``PYTHONPATH=':/lib'`` from a project's root: the program imports the project's package through the
    empty entry, under ``gradguard run`` as without; ``gradguard env`` keeps the entry too."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("NAME = 'the project'\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text("import pkg\nprint(pkg.NAME)\n")
    search = f"{os.pathsep}{tmp_path / 'lib'}"
    if os.environ.get("PYTHONPATH"):  # the caller's entries (this checkout, where it is not installed) after it
        search += os.pathsep + os.environ["PYTHONPATH"]
    plain = subprocess.run([sys.executable, "sub/train.py"], capture_output=True, text=True, cwd=tmp_path,
                           env=env(PYTHONPATH=search), timeout=120)  # fmt: skip
    assert plain.stdout == "the project\n", plain.stderr
    run = _gradguard("run", "sub/train.py", cwd=tmp_path, PYTHONPATH=search)
    assert run.returncode == 0 and run.stdout == "the project\n", run.stderr
    exported = json.loads(_gradguard("env", "--json", "--report-dir", "gg", cwd=tmp_path, PYTHONPATH=search).stdout)
    assert exported["PYTHONPATH"] == f"{_settings.BOOTSTRAP}{os.pathsep}{search}"


@pytest.mark.parametrize(
    ("current", "expected"),
    [
        (None, "B"),
        ("", "B"),  # Python ignores an empty PYTHONPATH: no entries
        (":/lib", "B::/lib"),
        ("/lib:", "B:/lib:"),
        ("/a::/b", "B:/a::/b"),
        ("B:/lib", "B:/lib"),  # an outer run's: the bootstrap once
        ("/lib:B", "B:/lib"),
    ],
)
def test_the_bootstrap_goes_first_and_every_other_entry_stays_as_it_was(current: str | None, expected: str) -> None:
    boot = _settings.BOOTSTRAP
    given = None if current is None else current.replace("B", boot).replace(":", os.pathsep)
    assert _settings.python_path(given) == expected.replace("B", boot).replace(":", os.pathsep)


WAITS = (
    """
import os, sys, time

deadline = time.monotonic() + 600
while not os.path.exists("go"):  # both runs have started on the empty folder before either reports
    assert time.monotonic() < deadline, "never told to go"
    time.sleep(0.05)
"""
    + TRAIN
)


def test_two_runs_started_at_once_on_one_folder_read_only_their_own_reports(tmp_path: Path) -> None:
    """A leaking run in raise mode and a clean one, given the same ``--report-dir`` at the same time: both
    pass the start (the folder is empty), and the clean one stays clean."""
    (tmp_path / "train.py").write_text(WAITS)
    shared = str(tmp_path / "shared")
    argv = [sys.executable, "-m", "gradguard", "run", "--mode", "raise", "--audit-every", "1", "--report-dir", shared]
    environ = env(GRADGUARD_AUDIT=None, OMP_NUM_THREADS="1")
    runs = [
        subprocess.Popen([*argv, "train.py", *extra], cwd=tmp_path, env=environ, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
        for extra in (["--leak"], [])
    ]  # fmt: skip
    try:
        for run in runs:  # announced: each passed its start, the folder still empty
            assert run.stderr is not None and "report goes to" in run.stderr.readline()
        (tmp_path / "go").write_text("")
        (leaky_out, leaky_err), (clean_out, clean_err) = [run.communicate(timeout=600) for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                os.killpg(run.pid, 9)
                run.communicate()
    assert runs[0].returncode == 1 and "losses[*]" in leaky_err, leaky_err
    assert runs[1].returncode == 0 and "trained" in clean_out, clean_err
    assert "losses" not in clean_err and "kept autograd graphs" not in clean_err
    assert clean_err[clean_err.index("gradguard watch:") :].startswith("gradguard watch: 4 step boundaries")
    assert len(list(Path(shared).glob("report-*.json"))) == 2  # nothing overwritten, nothing lost


# --------------------------------------------------------------------------- every option, checked before the start


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--audit-every", "", "x.py"],
            "gradguard run: --audit-every='' (an empty value) is not accepted; accepted: a positive whole number N",
        ),
        (["--audit-every=", "x.py"], "--audit-every='' (an empty value) is not accepted"),
        (["--audit-every", "-1", "x.py"], "--audit-every='-1' is not accepted; accepted: a positive whole number N"),
        (["--audit-every", "²", "x.py"], "--audit-every='²' is not accepted"),
        (
            ["--report-dir", "", "x.py"],
            "gradguard run: --report-dir='' (an empty value) is not accepted; accepted: a new or empty folder",
        ),
        (["--report-dir", "   ", "x.py"], "--report-dir='   ' (an empty value) is not accepted"),
        (
            ["--report-dir", "x.py", "x.py"],
            "gradguard run: --report-dir='x.py' is a file; accepted: a new or empty folder",
        ),
        (["--mode", "", "x.py"], "gradguard run: --mode='' (an empty value) is not a gradguard mode; accepted: off/0"),
        (["-m", ""], "gradguard run: -m '' names no module; give -m MODULE"),
        ([""], "gradguard run: '' (an empty name) is not a command; give a script (train.py), -m MODULE, or"),
    ],
    ids=[
        "audit-empty",
        "audit-equals-empty",
        "audit-negative",
        "audit-superscript",
        "dir-empty",
        "dir-blank",
        "dir-file",
        "mode-empty",
        "module-empty",
        "script-empty",
    ],  # fmt: skip
)
def test_every_empty_or_bad_run_option_is_a_usage_error_naming_it(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("raise SystemExit('the command must not start')\n")
    assert _cli.main(["run", *argv]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [tmp_path / "x.py"]  # nothing started, no folder made


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--audit-every", ""], "gradguard env: --audit-every='' (an empty value) is not accepted"),
        (["--report-dir", ""], "gradguard env: --report-dir='' (an empty value) is not accepted"),
        (["--mode", "loud"], "gradguard env: --mode='loud' is not a gradguard mode"),
    ],
)
def test_every_empty_or_bad_env_option_is_a_usage_error_naming_it(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _cli.main(["env", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_a_blank_gradguard_audit_counts_as_unset_and_a_bad_one_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADGUARD_AUDIT", "  ")
    assert _cli.main(["env", "--json", "--report-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["GRADGUARD_RUN_AUDIT"] == "auto"
    monkeypatch.setenv("GRADGUARD_AUDIT", "sometimes")
    assert _cli.main(["run", sys.executable, "-c", "pass"]) == 2
    assert "gradguard run: GRADGUARD_AUDIT='sometimes' is not accepted; accepted:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "value", ["auto", " AUTO ", "1", "12", "0", "off", "OFF", "false", "no", "none", "often", "-1", "1.5", "x1", "²"]
)
def test_a_process_of_the_run_reads_a_watch_setting_as_enforce_does(value: str) -> None:
    """``GRADGUARD_RUN_AUDIT`` in a reached process (read by the launcher's settings, which never import the
    watch) and ``enforce(audit=...)`` take the same words and refuse the same values, each naming its option
    as spelled, the value and the same list of what is accepted."""

    def after_name(error: str) -> str:
        return error.split("=", 1)[1]

    settings = _settings.Settings({"GRADGUARD_REPORT_DIR": "/tmp/x", "GRADGUARD_RUN_AUDIT": value})
    launcher = after_name(settings.errors[0]) if settings.errors else settings.every
    try:
        installs = gradguard.enforce(engines="none", audit=value).installs
        watch: object = installs[0].watcher.every if installs else None  # type: ignore[attr-defined]
    except GradGuardError as exc:
        watch = after_name(str(exc))
    assert launcher == watch
    if settings.errors:
        assert settings.errors[0].startswith(f"GRADGUARD_RUN_AUDIT={value!r} is not accepted; accepted: ")
    assert _settings.AUDIT_ENV == _watcher.AUDIT_ENV


def test_a_bad_run_id_in_a_process_is_said_in_its_report() -> None:
    settings = _settings.Settings({"GRADGUARD_REPORT_DIR": "/tmp/x", "GRADGUARD_RUN_ID": "../etc"})
    assert settings.run == "" and "GRADGUARD_RUN_ID='../etc' is not accepted" in settings.errors[0]
    blank = _settings.Settings({"GRADGUARD_RUN_AUDIT": " ", "GRADGUARD_RUN_ID": "abc", "GRADGUARD_RUN_PARENT": "x"})
    assert (blank.every, blank.run, blank.parent, blank.errors) == ("auto", "abc", None, [])


# --------------------------------------------------------------------------- processes out of reach, or out of the way


def test_a_python_started_with_dash_i_is_said_to_be_out_of_reach(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    run = _gradguard("run", "--mode", "raise", "--audit-every", "1", sys.executable, "-I", "train.py", "--leak",
                     cwd=tmp_path)  # fmt: skip
    assert "trained" in run.stdout, run.stderr
    assert "the command's Python ignores PYTHONPATH (-I): the bootstrap cannot reach it" in run.stderr
    assert "no process of the command imported torch" not in run.stderr
    assert run.stderr.splitlines()[-1].startswith("gradguard run: no process reported to ")
    assert "nothing was checked" in run.stderr


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["python", "-I", "x.py"], "ignores PYTHONPATH (-I)"),
        (["python3.11", "-uE", "x.py"], "ignores PYTHONPATH (-E)"),
        (["python", "-X", "dev", "-S", "-c", "pass"], "skips site, which runs it (-S)"),
        (["python", "-W", "ignore", "x.py", "-I"], None),  # the script's own -I
        (["python", "-c", "-I"], None),
        (["torchrun", "-I"], None),
    ],
)
def test_the_flags_that_put_the_commands_own_python_out_of_reach(command: list[str], said: str | None) -> None:
    found = commands.python_flags(command)
    assert (found is None) == (said is None) and (said is None or said in str(found))


def test_a_process_that_cannot_import_gradguard_is_said_not_checked(tmp_path: Path) -> None:
    """Here gradguard is made unimportable in the command; a second virtualenv with torch but not gradguard
    is the case in tests/integration/test_launchers.py."""
    (tmp_path / "train.py").write_text("import sys\nsys.modules['gradguard'] = None\n" + TRAIN)
    run = _gradguard("run", "--mode", "raise", "train.py", "--leak", cwd=tmp_path)
    assert run.returncode == 0 and "trained" in run.stdout, run.stderr
    lines = run.stderr.splitlines()
    assert (
        lines[-2].startswith("gradguard run: pid ") and "(the command) imported torch, but gradguard could" in lines[-2]
    )
    assert (
        lines[-1] == "gradguard run: nothing was checked: no report of a process gradguard was set up in could be used"
    )


def test_a_nested_gradguard_run_watches_its_command_and_the_outer_summary_says_so(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    inner = [sys.executable, "-m", "gradguard", "run", "--mode", "raise", "--audit-every", "1", "train.py", "--leak"]
    run = _gradguard("run", "--mode", "raise", "--audit-every", "1", *inner, cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "__main__:losses[*]" in run.stderr and "raised" in run.stderr  # the inner run's summary
    last = run.stderr.splitlines()[-1]
    assert last.startswith("gradguard run: pid ") and "(the command) is a gradguard run of its own: it watched" in last
    assert "(1 process reported to it, a leak was found in raise mode, exit status 1)" in last
    assert "no process" not in last


EXEC = """
import os, sys
import torch  # reached here: a report for this program

os.execv(sys.executable, [sys.executable, "train.py", "--leak"])
"""


def test_a_process_that_execs_into_its_trainer_is_listed_once(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "launch.py").write_text(EXEC)
    run = _gradguard("run", "--mode", "warn", "--audit-every", "1", "launch.py", cwd=tmp_path)
    assert run.returncode == 0 and "trained" in run.stdout, run.stderr
    summary = run.stderr[run.stderr.index("gradguard stats:") :]
    assert "__main__:losses[*]" in summary and "ran no optimizer step" not in summary
    assert "(the command)" not in summary  # one process: summarised as the command always was


def test_a_single_process_killed_after_its_last_audit_says_so(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN + "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    run = _gradguard("run", "--mode", "warn", "--audit-every", "1", "train.py", cwd=tmp_path)
    assert run.returncode == 128 + 9, run.stderr
    assert run.stderr.splitlines()[-2].startswith(
        "(the command's report is from its last audit: it ended without running its exit handlers (killed by"
    )


POOL = """
import multiprocessing
import sys

import torch  # each spawned worker imports the main module, so torch: it is reached, and never steps


def square(x):
    sys.stdout.write(f"{x * x}\\n")  # one write: the workers' lines never interleave
    sys.stdout.flush()


if __name__ == "__main__":
    workers = [multiprocessing.get_context("spawn").Process(target=square, args=(x,)) for x in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:  # joined: each one's setup is done (a pool's terminate() could stop one before it)
        worker.join()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(1, 2)).sum().backward()
        opt.step()
"""


def test_spawned_workers_that_never_step_are_counted_in_one_line(tmp_path: Path) -> None:
    """Spawned workers (DataLoader and pool workers alike) that import torch and never step."""
    (tmp_path / "train.py").write_text(POOL)
    run = _gradguard("run", "--mode", "raise", "train.py", cwd=tmp_path)
    assert run.returncode == 0 and sorted(run.stdout.split()) == ["0", "1", "4", "9"], run.stderr
    last = run.stderr.splitlines()[-1]
    assert last == "(and 4 processes that imported torch but ran no optimizer step: 4 multiprocessing children)"
