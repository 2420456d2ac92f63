"""Every way of turning the watch on checks a run from its first boundaries, with no ``every=``: a 6-step
script that keeps its loss from the first step fails in ``raise`` mode, and the same script, fixed, passes.

The ways in: ``gradguard.watch()``, ``gradguard run``, ``GRADGUARD_AUDIT=auto`` and pytest's
``--gradguard-audit=auto`` (the Lightning and Hugging Face callbacks: ``tests/integration/test_callbacks.py``).
"""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _helpers import env, watch_clock
from torch import nn

import gradguard
from gradguard._watch.governor import Governor

TRAINER = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Trainer:
        def __init__(self):
            torch.manual_seed(0)
            self.model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.running = {"epoch_loss": 0.0}

        def step(self, fixed):
            loss = self.model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            self.running["epoch_loss"] += loss.detach() if fixed else loss
            self.opt.step()
            self.opt.zero_grad()

    def train(fixed=False, steps=6):
        trainer = Trainer()
        for _ in range(steps):
            trainer.step(fixed)
        return trainer
    """
)

SCRIPT = TRAINER + "\nimport sys\ntrain(fixed=sys.argv[1:] == ['fixed'])\nprint('trained')\n"
HOLDER = "self.running['epoch_loss']"


def _namespace() -> dict[str, object]:
    space: dict[str, object] = {"__name__": "first_steps_trainer"}
    exec(compile(TRAINER, "first_steps_trainer.py", "exec"), space)
    return space


def _child(argv: list[str], cwd: Path, **changes: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, cwd=cwd, env=env(TMPDIR=str(cwd), **changes), timeout=300
    )


def test_watch_raises_at_the_third_boundary() -> None:
    train = _namespace()["train"]
    with gradguard.watch(mode="raise") as scope:
        trainer = train(fixed=True)  # clean: nothing is reported
    assert scope.watcher.history() == [] and scope.watcher.boundaries == 6
    del trainer
    steps: list[int] = []
    with gradguard.watch(mode="raise") as scope:
        with pytest.raises(gradguard.GraphRetentionError, match=r"running\['epoch_loss'\]"):
            train(fixed=False)  # type: ignore[operator]
        steps.append(scope.watcher.boundaries)
    assert steps == [3]  # a thread's first boundaries stamp every backward: the leak's third


def test_gradguard_run_fails_a_six_step_script(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    leaky = _child([sys.executable, "-m", "gradguard", "run", "--mode", "raise", "train.py"], tmp_path)
    assert leaky.returncode != 0, leaky.stdout + leaky.stderr
    assert "GraphRetentionError" in leaky.stderr and HOLDER in leaky.stderr
    fixed = _child([sys.executable, "-m", "gradguard", "run", "--mode", "raise", "train.py", "fixed"], tmp_path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "trained" in fixed.stdout


def test_gradguard_audit_auto_fails_a_six_step_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import gradguard\n" + SCRIPT)
    leaky = _child([sys.executable, str(script)], tmp_path, GRADGUARD="raise", GRADGUARD_AUDIT="auto")
    assert leaky.returncode != 0 and HOLDER in leaky.stderr, leaky.stdout + leaky.stderr
    fixed = _child([sys.executable, str(script), "fixed"], tmp_path, GRADGUARD="raise", GRADGUARD_AUDIT="auto")
    assert fixed.returncode == 0 and "trained" in fixed.stdout, fixed.stdout + fixed.stderr


def test_pytest_audit_auto_fails_a_six_step_test(tmp_path: Path) -> None:
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "test_train.py").write_text(
        "from trainer import train\n\n"
        "def test_leaky():\n    train(fixed=False)\n\n"
        "def test_fixed():\n    train(fixed=True)\n"
    )
    run = _child(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--gradguard-audit=auto"],
        tmp_path,
        PYTHONPATH=str(tmp_path),
    )
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    assert "test_leaky" in run.stdout and HOLDER in run.stdout


def test_a_short_clean_run_is_checked_and_said_so() -> None:
    gc.collect()  # graphs other tests left as garbage would be old graphs no holder keeps
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradguard.watch(mode="raise") as scope:
        for _ in range(6):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    text = scope.watcher.summary()
    assert text.startswith("gradguard watch: 6 step boundaries (") and scope.watcher.audits >= 1
    assert "nothing was checked" not in text and scope.watcher.history() == []


class _Running:
    """A metric of the program's own: a running sum of squared errors kept with its graph (the leak)."""

    def __init__(self) -> None:
        self.total = torch.tensor(0.0)
        self.kept: list[torch.Tensor] = []


RUNNING = _Running()


def _steps_held(total: torch.Tensor) -> int:
    """How many steps' additions the running sum's graph still holds (its AddBackward0 chain)."""
    count, node = 0, total.grad_fn
    while node is not None and type(node).__name__ == "AddBackward0":
        count += 1
        node = node.next_functions[0][0]
    return count


def test_detach_keeps_a_leak_the_program_keeps_filling_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once reported, the holder is read again by name at every boundary its share affords (a clock that
    moves only between steps: every one here), and repaired whenever what it took lived through two."""
    clock = watch_clock(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    held: list[int] = []
    RUNNING.total = torch.tensor(0.0)
    try:
        with gradguard.watch(mode="detach") as scope:
            for _ in range(40):
                out = model(torch.randn(4, 8))
                out.pow(2).mean().backward()
                RUNNING.total = RUNNING.total + (out - 1).pow(2).sum()  # the leak: out's graph, every step
                opt.step()
                opt.zero_grad()
                held.append(_steps_held(RUNNING.total))
                clock[0] += 1.0
        [entry] = scope.watcher.history()
        assert entry.holder.endswith("RUNNING.total") and entry.outcome == "repaired"
        reported = entry.found_at
        assert reported <= 3
        assert max(held[reported + 5 :]) <= 3, str(held)  # repaired again and again: never more than a few steps
    finally:
        RUNNING.total = torch.tensor(0.0)


def test_detach_bounds_a_leak_on_steps_too_short_for_the_revisit_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step far shorter than a read of the holder: the share never affords the full read. The holder
    repaired before is still read at every boundary while it keeps filling (its newest records), so
    only the current step's forward keeps its graph; the gradients are those of the unwatched run."""
    clock = watch_clock(monkeypatch)
    monkeypatch.setattr(Governor, "affords", lambda *args, **kwargs: False)  # nothing but the signals' first asks

    def run(watched: bool) -> tuple[list[int], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        RUNNING.kept = []
        held, grads = [], []
        with gradguard.watch(mode="detach") if watched else contextlib.nullcontext():
            for _ in range(60):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                grads.extend(p.grad.clone() for p in model.parameters())  # type: ignore[union-attr]
                RUNNING.kept.append(model(torch.randn(4, 8)))  # the leak: an evaluation forward with its graph
                opt.step()
                opt.zero_grad()
                held.append(sum(t.grad_fn is not None for t in RUNNING.kept))
                clock[0] += 1.0
        return held, grads

    try:
        plain_held, plain_grads = run(False)
        held, grads = run(True)
    finally:
        RUNNING.kept = []
    assert plain_held[-1] == 60
    reported = next(i for i, n in enumerate(held, 1) if n < i)
    assert reported <= 4, held
    assert max(held[reported + 5 :]) <= 2, held  # bounded: the last step's forward, at most the one before
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))  # bitwise
