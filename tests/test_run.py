"""``gradguard run``: a script or ``-m module`` under ``enforce()`` and the watch, with no code change.

The runs that train start a fresh interpreter (``python -m gradguard run ...``): every audit sees the
whole process, and the exit status and the summary at exit are the point. How the target is run
(``sys.argv``, ``__main__``, ``sys.path[0]``, the exit status) and the refusals are checked
in-process, without a watch.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _helpers import env

from gradguard import _cli, _enforce

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
        opt.step()
        opt.zero_grad()
    print("steps done:", steps, "leaked:", sum(r["loss"].grad_fn is not None for r in HISTORY))


if __name__ == "__main__":
    main(int(sys.argv[1]))
"""


def _gradguard(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradguard", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env(GRADGUARD_AUDIT=None),
        timeout=180,
    )


def test_raise_mode_fails_the_run_at_the_step_that_found_the_leak(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LEAKY)
    run = _gradguard("run", "--mode", "raise", "--audit-every", "1", "train.py", "4", "--leak", cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert "steps done" not in run.stdout  # the error came out of the third optimizer.step()
    err = run.stderr
    assert err.startswith("Traceback (most recent call last):\n  File ") and 'train.py", line ' in err
    assert "gradguard._cli" not in err.split("GraphRetentionError")[0]  # the traceback starts at the script
    assert "gradguard.GraphRetentionError: gradguard: 1 holder keeps autograd graphs" in err
    assert "gradguard stats: no guarded store saw a record" in err
    # a list at the script's top level is a variable of __main__: found once it survived two boundaries
    assert "gradguard watch: 3 step boundaries, 3 audited" in err
    summary = err[err.index("gradguard watch:") :].splitlines()
    assert summary[1].split() == ["holder", "tensors", "pinned", "nodes", "steps", "survived", "outcome", "fix"]
    assert summary[3].split()[:4] == ["__main__:HISTORY[*]['loss']", "3", "0", "B"]
    assert summary[3].split()[7:9] == ["2", "raised"]


def test_a_module_in_detach_mode_is_repaired_and_counted(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(LEAKY)
    run = _gradguard("run", "--mode=detach", "--audit-every=1", "-m", "pkg.train", "4", "--leak", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "steps done: 4 leaked: 2" in run.stdout  # the last two steps' records (a variable's grace) keep theirs
    err = run.stderr
    assert "audit  __main__:HISTORY[*]['loss']  2        2" in err  # stats: 2 repairs, 2 tensors detached
    assert "gradguard watch: 4 step boundaries, 4 audited" in err and "repaired" in err


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
    assert "train.py:18: GraphRetentionWarning: gradguard: __main__:HISTORY[*] keeps an autograd graph" in err


def test_a_clean_script_passes_in_raise_mode(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LEAKY)
    run = _gradguard("run", "--mode", "raise", "--audit-every", "1", "train.py", "3", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "steps done: 3 leaked: 0" in run.stdout
    assert "gradguard watch: 3 step boundaries, 3 audited" in run.stderr
    assert "at the 3 audited boundaries, no autograd graph had outlived a step boundary" in run.stderr


def test_the_script_runs_as_main_with_its_own_argv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
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
    code = _cli.main(["run", "--mode", "warn", "--audit-every", "0", str(script), "3", "--mode", "x"])
    out, err = capsys.readouterr()
    assert code == 3 and sys.argv == argv and _enforce.installed() == {}
    assert f"NAME __main__ ARGV {[str(script), '3', '--mode', 'x']} PATH0 {tmp_path} MODE warn" in out
    assert "gradguard stats: no guarded store saw a record" in err and "gradguard watch" not in err


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
    assert "GraphRetentionWarning: gradguard: __main__:HISTORY[*] keeps an autograd graph" in run.stderr
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
    assert "gradguard watch: 3 step boundaries, 3 audited" in run.stderr  # one watch, each boundary once
