"""Right about what it saw: every backward seen wherever it runs, a graph in use never a leak, every
optimizer of a shared boundary ages its graphs, holders counted in full, the first steps of every entry
checked, and a summary that says what its signals did not cover instead of an all-clear."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from _helpers import env
from _tables import flat
from torch import nn

import gradguard
from gradguard._watch import backwards as _backwards

KEPT: list[Any] = []


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    KEPT.clear()
    gc.collect()  # graphs other tests left as garbage would be old graphs no holder keeps: the signal backs off
    yield
    KEPT.clear()
    gc.collect()


def elsewhere(entry: gradguard.Retention) -> bool:
    """Graphs other tests of this process left behind are not this file's business."""
    return "test_coverage" not in entry.path


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _raised_at(steps: int, step: Any) -> int | None:
    """Run ``step(i)`` for i in 1..steps; the step whose ``optimizer.step()`` raised."""
    for i in range(1, steps + 1):
        try:
            step(i)
        except gradguard.GraphRetentionError:
            return i
    return None


def _script(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, env=env(), timeout=300
    )


# --------------------------------------------------------------------------------------------------
# Every backward seen
# --------------------------------------------------------------------------------------------------


def _kept_from_30(backward: Any) -> int | None:
    """The step that raised, when each step's loss is kept from step 30 on and ``backward(loss)`` runs its
    backward."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradguard.watch(mode="raise", ignore=elsewhere):

        def step(i: int) -> None:
            loss = model(torch.randn(4, 8)).pow(2).mean()
            backward(loss)
            if i >= 30:
                KEPT.append(loss)
            opt.step()
            opt.zero_grad()

        return _raised_at(60, step)


def test_a_kept_loss_whose_backward_runs_in_a_worker_thread_is_reported() -> None:
    with ThreadPoolExecutor(1) as pool:
        found = _kept_from_30(lambda loss: pool.submit(loss.backward).result())
    assert found is not None and found <= 33


@pytest.mark.parametrize("scale", ["multiplied", "divided"])
def test_a_kept_loss_whose_backward_starts_from_a_scaled_one_is_reported_in_time(scale: str) -> None:
    # An AMP scaler's (loss * scale).backward(), gradient accumulation's (loss / n).backward(): the kept loss
    # is the node right below the backward's root, which was stamped only when the rationed stamps below the
    # roots were due (a GradScaler's leak was reported 16 to 20 steps after it started).
    found = _kept_from_30(lambda loss: (loss * 1024.0 if scale == "multiplied" else loss / 4).backward())
    assert found is not None and found <= 32


def test_an_autograd_engine_bound_before_the_watch_is_named_in_the_summary() -> None:
    run = _script(
        """
        import torch, gradguard
        from torch.autograd.variable import Variable
        ENGINE = Variable._execution_engine  # bound before the watch: its backwards go round the watch
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradguard.watch(mode="raise") as scope:
            for _ in range(10):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                ENGINE.run_backward((loss,), (torch.ones_like(loss),), False, False, (), True, True)
                opt.step()
                opt.zero_grad()
        print(scope.watcher.summary())
        """
    )
    assert run.returncode == 0, run.stderr
    assert "not covered: 9 step boundaries of 10 saw no backward (an autograd engine bound" in run.stdout
    assert "no graph the watch followed outlived" in run.stdout  # true, and said with what it did not follow


def test_gradguard_run_follows_an_engine_bound_at_import(tmp_path: Any) -> None:
    """Under ``gradguard run`` the watch starts when torch is imported, before the program binds the engine."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from torch.autograd.variable import Variable
            ENGINE = Variable._execution_engine  # bound at import
            model = torch.nn.Linear(8, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            HIST = []
            for s in range(30):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                ENGINE.run_backward((loss,), (torch.ones_like(loss),), False, False, (), True, True)
                opt.step()
                opt.zero_grad()
                if s >= 10:
                    HIST.append(loss)
            """
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "gradguard", "run", "--mode", "raise", str(script)],
        capture_output=True, text=True, env=env(), timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode != 0 and "__main__:HIST[*]" in run.stdout + run.stderr


def test_a_listener_that_fails_is_counted_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a stamping that fails")

    with gradguard.watch(mode="raise", ignore=elsewhere) as scope:
        monkeypatch.setattr(gradguard.Watcher, "_on_backward", broken)
        for _ in range(4):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        monkeypatch.undo()
    assert "not covered: 4 backwards could not be followed" in scope.watcher.summary()
    assert _backwards.failures() >= 4


def test_a_multi_element_root_backwarded_again_with_grad_tensors_is_seen_and_in_use() -> None:
    """A feature map kept on purpose and backwarded again from its root with ``grad_tensors`` at every step:
    each backward is seen (no listener failure) and the graph is as young as its last backward."""
    torch.manual_seed(0)
    base = torch.randn(6, 4, requires_grad=True)
    head = nn.Linear(4, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    features = base.exp() * 2  # many elements, kept and reused
    before = _backwards.failures()
    with gradguard.watch(mode="raise", ignore=elsewhere) as scope:
        for _ in range(12):
            features.backward(torch.ones_like(features), retain_graph=True)
            head(features.detach()).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert _backwards.failures() == before
    assert scope.watcher.history() == []


@pytest.mark.parametrize("where", ["through", "from its root"])
def test_a_retain_graph_feature_reused_on_purpose_raises_nothing(where: str) -> None:
    def train(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        base = torch.randn(16, 8, requires_grad=True)  # a leaf no optimizer updates
        cached = base.exp() * 2  # computed once, reused at every step
        head = nn.Linear(8, 1)
        opt = torch.optim.SGD(head.parameters(), lr=0.01)
        with gradguard.watch(mode="raise", ignore=elsewhere) if watched else contextlib.nullcontext():
            for _ in range(6 if where == "from its root" else 30):
                loss = head(cached).pow(2).mean()
                if where == "from its root":
                    cached.sum().backward(retain_graph=True)
                loss.backward(retain_graph=True)
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in head.parameters()] + [base.grad.clone()]  # type: ignore[union-attr]

    plain, watched = train(False), train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))


def test_a_growing_chain_every_loss_runs_through_is_still_a_leak() -> None:
    """In use, but built over several steps: each step extends it, so it grows."""
    w = nn.Parameter(torch.full((4,), 0.5))
    opt = torch.optim.SGD([w], lr=0.01)
    running = [torch.zeros(())]
    with gradguard.watch(mode="raise", ignore=elsewhere):

        def step(i: int) -> None:
            running[0] = torch.lerp(running[0], w.sum(), 0.1)  # kept with its graph, in every loss
            ((torch.randn(4) * w).sum().pow(2) + running[0]).backward()
            opt.step()
            opt.zero_grad()

        found = _raised_at(20, step)
    running.clear()
    assert found is not None and found <= 5


# --------------------------------------------------------------------------------------------------
# Boundaries: shared, first steps, entries
# --------------------------------------------------------------------------------------------------


def test_every_optimizer_of_a_shared_boundary_ages_the_graphs_that_reach_its_parameters() -> None:
    """Two optimizers step over one backward; the graph kept each step reaches the second one's only."""
    body, head = nn.Linear(8, 8), nn.Linear(8, 1)
    opt_head = torch.optim.SGD(head.parameters(), lr=0.01)
    opt_body = torch.optim.SGD(body.parameters(), lr=0.01)
    with gradguard.watch(mode="raise", ignore=elsewhere):

        def step(i: int) -> None:
            x = torch.randn(4, 8)
            head(body(x)).pow(2).mean().backward()
            aux = body(torch.randn(4, 8)).pow(2).mean()  # an auxiliary loss of the body alone
            aux.backward()
            if i >= 10:
                KEPT.append(aux)
            opt_head.step()
            opt_body.step()  # the same boundary: no node was made in between
            opt_head.zero_grad()
            opt_body.zero_grad()

        found = _raised_at(40, step)
    assert found is not None and found <= 14


def test_a_first_step_record_kept_after_the_optimizer_step_is_judged() -> None:
    """Kept after ``opt.step()``: the first boundary's check ran before it existed; the second's sees it."""
    run = _script(
        """
        import torch, gradguard
        m = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(m.parameters(), 0.1)
        norms = []
        with gradguard.watch(mode="raise"):
            for s in range(6):
                m(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                norms.append(m.weight.sum())  # no parameter saved, never backwarded: no signal sees it
        """
    )
    assert run.returncode != 0 and "GraphRetentionError" in run.stderr and "norms[*]" in run.stderr


def test_each_call_of_a_decorated_function_gets_its_start_up_check() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @gradguard.watch(mode="raise", ignore=elsewhere)
    def train(steps: int, leak: bool) -> None:
        for _ in range(steps):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if leak:
                KEPT.append(model[0].weight.sum())  # seen by the start-up check only
            opt.step()
            opt.zero_grad()

    train(40, False)
    with pytest.raises(gradguard.GraphRetentionError, match=r"KEPT\[\*\]"):
        train(6, True)


def test_a_list_of_kept_losses_is_one_holder_counted_in_full() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradguard.watch(mode="raise", ignore=elsewhere):
        with pytest.raises(gradguard.GraphRetentionError) as caught:
            for i in range(200):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                loss.backward()
                if i >= 100:
                    KEPT.append(loss)
                opt.step()
                opt.zero_grad()
    held = len(KEPT)
    assert f"KEPT[*]: {held} tensors" in str(caught.value)


# --------------------------------------------------------------------------------------------------
# detach reaches what a function holds
# --------------------------------------------------------------------------------------------------


class _Trainer:
    def __init__(self, fixed: bool) -> None:
        self.model = _mlp(3)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.history: list[torch.Tensor] = []
        self.fixed = fixed

    def fit(self, steps: int, x: torch.Tensor) -> list[torch.Tensor]:
        grads = []
        for _ in range(steps):
            loss = self.model(x).pow(2).mean()
            loss.backward()
            grads.extend(p.grad.clone() for p in self.model.parameters())  # type: ignore[union-attr]
            self.opt.step()
            self.opt.zero_grad()
            self.history.append(loss.detach() if self.fixed else loss)  # the leak, from a function's local
        return grads


def test_detach_bounds_a_leak_held_by_a_trainer_made_in_main() -> None:
    def main(fixed: bool, watched: bool) -> tuple[int, list[torch.Tensor], list[float]]:
        trainer = _Trainer(fixed)  # reached from this frame's local only
        x = torch.randn(16, 8)
        if watched:
            with gradguard.watch(ignore=elsewhere):  # the defaults: detach
                grads = trainer.fit(1000, x)
        else:
            grads = trainer.fit(1000, x)
        left = sum(t.grad_fn is not None for t in trainer.history)
        return left, grads, [t.item() for t in trainer.history]

    _, fixed_grads, fixed_values = main(fixed=True, watched=False)
    left, grads, values = main(fixed=False, watched=True)
    assert left <= 5  # bounded: the last steps' records at most
    assert all(torch.equal(a, b) for a, b in zip(grads, fixed_grads))  # bitwise the hand-fixed program's
    assert values == fixed_values


def test_a_frame_local_running_sum_is_reported_with_its_growing_figures() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train() -> Any:
        tr_loss = torch.tensor(0.0)
        with gradguard.watch(mode="detach", ignore=elsewhere) as scope:
            for _ in range(40):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                tr_loss += loss  # rebinds a local: nothing can write it
        return scope.watcher

    with pytest.warns(gradguard.GraphRetentionWarning, match="cannot be repaired in place"):
        watcher = train()
    [row] = [h for h in watcher.history() if h.holder.endswith("tr_loss")]
    assert row.outcome == "not repairable" and "frame local" in row.why
    assert row.survived >= 3 and row.nodes > 3  # figures of its last read, not of its first


# --------------------------------------------------------------------------------------------------
# What the summary says it did not cover
# --------------------------------------------------------------------------------------------------


def test_a_summary_says_when_the_signals_requests_waited() -> None:
    run = _script(
        """
        import gc, torch, gradguard
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        def step():
            out = model(torch.randn(4, 8))
            try:
                raise ValueError("a batch skipped")
            except ValueError as e:
                last = e  # a traceback cycle keeps the step's output until the collector runs
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

        gc.disable()  # collected by hand every 50 steps, as some training stacks do
        with gradguard.watch(mode="warn") as scope:
            for i in range(300):
                step()
                if i % 50 == 49:
                    gc.collect()
        print(scope.watcher.audits, scope.watcher.summary())
        """
    )
    assert run.returncode == 0, run.stderr
    audits = int(run.stdout.split()[0])
    assert audits == 2  # the start-up check's: old graphs that only the program's collection frees cost no audit
    assert "waited for the program's own collection" in flat(run.stdout)
    assert "the old ones were cyclic garbage, freed by the collector" in flat(run.stdout)
    assert "no graph the watch followed outlived" not in run.stdout or "NOT EXPLAINED" in run.stdout
