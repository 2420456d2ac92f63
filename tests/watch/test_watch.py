"""The step-boundary watch: the leak criterion (both sides), the modes, the repair, the scope, threads.

Every audit scans the whole heap of this process, so each test runs few steps of a tiny model.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _helpers import script_module
from _tables import flat
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks

import gradguard
from gradguard._scope import enforce as _enforce

KEPT: list[Any] = []  # a module global some tests leak into


def elsewhere(entry: gradguard.Retention) -> bool:
    """Graphs that other tests of this process left behind: not this file's business (every audit sees the
    whole process)."""
    return "test_watch" not in entry.path


@pytest.fixture(autouse=True)
def _empty_kept() -> Iterator[None]:
    KEPT.clear()
    yield
    KEPT.clear()


class Trainer:
    """A tiny model, its optimizer, and the places a training loop keeps things."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.data = torch.Generator().manual_seed(seed)
        self.history: list[Any] = []
        self.metrics: dict[str, Any] = {}

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(torch.randn(4, 8, generator=self.data))
        return out.pow(2).mean(), out

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


def _nodes(root: Any) -> list[Any]:
    seen, stack = [], [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.append(node)
        stack.extend(child for child, _ in node.next_functions)
    return seen


def _loss_only(trainer: Trainer, steps: int, keep: Callable[[torch.Tensor], object]) -> None:
    for _ in range(steps):
        loss, _ = trainer.forward()
        loss.backward()
        keep(loss)
        trainer.step()


# --------------------------------------------------------------------------------------------------
# The criterion
# --------------------------------------------------------------------------------------------------


def test_a_clean_loop_is_never_a_leak_though_the_audit_sees_its_graphs() -> None:
    trainer, watcher = Trainer(), gradguard.Watcher(every=1, mode="raise", ignore=elsewhere)
    store: list[Any] = []
    for _ in range(4):
        store.clear()  # emptied every step: one record per micro-batch, of graphs no backward ran through
        for _ in range(2):
            loss, _ = trainer.forward()
            _, out = trainer.forward()  # an evaluation forward of the same step, kept for its metric
            outputs = {"out": out}  # the current step's own outputs, frame locals
            store.append(outputs)
            loss.backward()
        trainer.model.last_out = out  # a module attribute overwritten by every forward
        trainer.step()
        seen = {entry.holder for entry in gradguard.audit()}
        assert any(holder.endswith("store[*]['out']") for holder in seen), seen  # the audit lists them...
        report = watcher.boundary()
        assert report is None or len(report) == 0  # ...the watch finds no leak among them
    assert watcher.audits >= 1 and watcher.history() == []


def test_a_watcher_registered_as_torchs_step_hook_makes_each_step_a_boundary() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    trainer, watcher = Trainer(), gradguard.Watcher(every=1, mode="raise", ignore=elsewhere)
    kept: list[Any] = []
    handle = register_optimizer_step_post_hook(watcher.stepped)
    try:
        with pytest.raises(gradguard.GraphRetentionError):
            for _ in range(6):
                loss, _out = trainer.forward()
                loss.backward()
                kept.append(loss)  # the leak
                trainer.step()
    finally:
        handle.remove()
        watcher.close()
    assert watcher.boundaries == 3 and len(kept) == 3


def test_the_previous_result_a_caller_still_holds_is_not_a_leak() -> None:
    trainer, watcher = Trainer(), gradguard.Watcher(every=1, mode="raise", ignore=elsewhere)
    seen: list[str] = []

    def train_step(check: bool) -> tuple[torch.Tensor, torch.Tensor]:
        loss, out = trainer.forward()
        loss.backward()
        trainer.step()
        if check:
            seen.extend(entry.path for entry in gradguard.audit())
        report = watcher.boundary()
        assert report is None or len(report) == 0
        return loss, out

    result = None
    for i in range(6):
        result = train_step(i == 2)  # until it returns, `result` is the previous step's loss and output
    assert result is not None and watcher.history() == []
    assert any(": result[" in path for path in seen), seen  # the audit lists it; the watch leaves it alone


def test_a_graph_kept_in_a_list_is_bounded_for_one_boundary_and_a_leak_at_the_second() -> None:
    trainer, watcher = Trainer(), gradguard.Watcher(every=1, mode="raise", ignore=elsewhere)
    KEPT.append(None)
    loss, _ = trainer.forward()
    loss.backward()
    KEPT[0] = loss
    trainer.step()
    report = watcher.boundary()
    assert report is not None and len(report) == 0  # first boundary: nothing was alive before it
    loss, _ = trainer.forward()
    loss.backward()
    trainer.step()  # KEPT[0] is the previous step's loss, `loss` this step's
    report = watcher.boundary()
    assert report is not None and len(report) == 0  # one step's graph, kept one boundary: bounded
    assert watcher.history() == [] and [(e.holder, e.outcome) for e in watcher.bounded()] == [
        (f"{__name__}:KEPT[*]", "bounded")
    ]
    loss, _ = trainer.forward()
    loss.backward()
    trainer.step()  # KEPT[0] has now lived through two boundaries: it does not go away
    with pytest.raises(gradguard.GraphRetentionError) as caught:
        watcher.boundary()
    report = caught.value.report  # type: ignore[attr-defined]
    assert [entry.path for entry in report] == [f"{__name__}:KEPT[0]"]
    assert "2 step boundaries" in flat(str(caught.value)) and "fix: " in str(caught.value)
    assert [(e.holder, e.outcome) for e in watcher.history()] == [(f"{__name__}:KEPT[*]", "raised")]


def test_a_list_that_keeps_every_steps_loss_is_a_leak_at_the_second_boundary() -> None:
    """Two steps' graphs in one list: it grows, whatever the age of its oldest."""
    trainer, watcher = Trainer(), gradguard.Watcher(every=1, mode="raise", ignore=elsewhere)

    def step() -> None:
        loss, _ = trainer.forward()
        loss.backward()
        trainer.history.append(loss)
        trainer.step()

    step()
    assert watcher.boundary() is not None
    step()
    with pytest.raises(gradguard.GraphRetentionError, match=r"trainer.history\[\*\]:\s+2 tensors"):
        watcher.boundary()


@pytest.mark.parametrize("how", ["out of place", "in place on a leaf"])
def test_an_accumulated_sum_is_a_leak_and_counts_the_boundaries_it_survived(how: str) -> None:
    trainer, watcher = Trainer(), gradguard.Watcher(every=1, mode="warn", ignore=elsewhere)
    trainer.metrics["loss_sum"] = torch.tensor(0.0)

    def keep(loss: torch.Tensor) -> None:
        if how == "out of place":
            trainer.metrics["loss_sum"] = trainer.metrics["loss_sum"] + loss  # a new tensor, the old node inside
        else:
            trainer.metrics["loss_sum"] += loss  # HF's tr_loss: the same tensor, its grad_fn replaced

    survived = []
    with pytest.warns(gradguard.GraphRetentionWarning) as caught:
        for _ in range(4):
            _loss_only(trainer, 1, keep)
            report = watcher.boundary()
            assert report is not None
            survived.append([e.survived for e in watcher.history()])
    assert survived == [[], [], [2], [3]]  # one step's sum is bounded; a sum that lived through two grows
    messages = [str(w.message) for w in caught if issubclass(w.category, gradguard.GraphRetentionWarning)]
    assert len(messages) == 1  # one warning per holder path, not one per boundary
    assert "trainer.metrics['loss_sum']" in messages[0] and "pinned" in messages[0] and "fix: " in messages[0]


def test_every_n_acts_on_the_signals_of_every_nth_boundary_and_survival_is_counted_in_boundaries() -> None:
    trainer, watcher = Trainer(), gradguard.Watcher(every=2, mode="raise", ignore=elsewhere)
    results = []
    for step in range(1, 9):
        _loss_only(trainer, 1, KEPT.append if step >= 6 else lambda loss: None)
        if step < 8:
            results.append(watcher.boundary())
    assert results[0] is not None and len(results[0]) == 0  # the start-up check
    # From step 6 each loss is kept: the first has lived through a boundary at 7, which is not checked
    # (an odd boundary is not even looked at; an even one may audit graphs other tests left behind).
    assert all(r is None or len(r) == 0 for r in results[1:]) and results[6] is None
    with pytest.raises(gradguard.GraphRetentionError, match=r"(?s)KEPT\[\*\]: 3 tensors.*alive for 2\s+step"):
        watcher.boundary()


def test_ignore_leaves_a_graph_kept_on_purpose_alone() -> None:
    on_purpose = f"{__name__}:KEPT"
    watcher = gradguard.Watcher(every=1, mode="raise", ignore=lambda r: elsewhere(r) or r.path.startswith(on_purpose))
    trainer = Trainer()
    _loss_only(trainer, 3, lambda loss: (KEPT.append(loss), watcher.boundary()))
    # the step clock's three audits; the micro-batch clock's searches (what KEPT keeps is ignored) besides
    assert watcher.audits - watcher.figures().micro_searches == 3 and watcher.history() == []
    with pytest.raises(gradguard.GradGuardError, match="ignore=42 is not accepted"):
        gradguard.Watcher(ignore=42)


# --------------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------------


def test_raise_comes_out_of_optimizer_step_after_the_step_and_keeps_nothing_alive() -> None:
    trainer = Trainer()
    refs: list[weakref.ref[torch.Tensor]] = []
    with gradguard.watch(every=1, mode="raise", ignore=elsewhere) as scope:
        _loss_only(trainer, 1, lambda loss: (KEPT.append(loss), refs.append(weakref.ref(loss))))
        _loss_only(trainer, 1, lambda loss: None)
        loss, _ = trainer.forward()
        loss.backward()
        before = [p.detach().clone() for p in trainer.model.parameters()]
        with pytest.raises(gradguard.GraphRetentionError) as caught:
            trainer.opt.step()
        after = list(trainer.model.parameters())
        assert all(not torch.equal(b, a) for b, a in zip(before, after))  # the step itself completed
    assert scope.watcher.history()[0].outcome == "raised"
    del loss, caught
    KEPT.clear()
    gc.collect()
    assert refs[0]() is None  # neither the error nor the watcher keeps the leaked tensor


def test_detach_repairs_in_place_with_the_gradients_of_the_hand_fixed_loop() -> None:
    def run(fixed: bool) -> tuple[list[list[torch.Tensor]], list[torch.Tensor], list[float], Trainer]:
        trainer, watcher = Trainer(seed=3), gradguard.Watcher(every=1, mode="detach", ignore=elsewhere)
        cut = (lambda t: t.detach()) if fixed else (lambda t: t)
        grads, values = [], []
        trainer.metrics["loss_sum"] = 0.0
        for i in range(5):
            loss, out = trainer.forward()
            loss.backward()
            grads.append([p.grad.clone() for p in trainer.model.parameters()])  # type: ignore[union-attr]
            trainer.history.append({"loss": cut(loss), "out": (cut(out),)})  # a tuple inside a record
            trainer.metrics["loss_sum"] = trainer.metrics["loss_sum"] + cut(loss)
            KEPT.append(cut(out * 2))
            if i == 0:
                trainer.model.first_out = cut(out)  # a module attribute set once and kept
            trainer.step()
            report = watcher.boundary()
            if fixed or i == 0:
                assert report is None or len(report) == 0
            elif i < 3:  # the start-up check: the records kept since the first step are found at once
                assert report is not None and len(report) > 0
            values.append(trainer.metrics["loss_sum"].detach().item())
        return grads, [p.detach().clone() for p in trainer.model.parameters()], values, trainer

    fixed_grads, fixed_params, fixed_values, _ = run(fixed=True)  # first: it leaves no graph behind
    KEPT.clear()
    grads, params, values, leaky = run(fixed=False)
    for step, fixed_step in zip(grads, fixed_grads):
        assert all(torch.equal(a, b) for a, b in zip(step, fixed_step))  # bitwise
    assert all(torch.equal(a, b) for a, b in zip(params, fixed_params)) and values == fixed_values
    # Bounded: what had lived through a boundary at the last audit was replaced by its detached self;
    # only the last two steps' values still carry their graphs.
    assert all(t.grad_fn is None for t in KEPT[:-2]) and KEPT[-1].grad_fn is not None
    assert all(r["loss"].grad_fn is None and r["out"][0].grad_fn is None for r in leaky.history[:-2])
    assert leaky.model.first_out.grad_fn is None
    adds = [n for n in _nodes(leaky.metrics["loss_sum"].grad_fn) if type(n).__name__ == "AddBackward0"]
    assert len(adds) < 5  # cut: the uncut sum of five steps has five
    holders = {row.site: row for row in gradguard.stats().values() if row.store == "audit"}
    assert holders[f"{__name__}:KEPT[*]"].tensors_detached >= 3


class _Keeper:
    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def keep(self, loss: torch.Tensor) -> None:
        self.kept.append(loss)


BOUND: Any = None  # a bound method: its object is reached only through ``__self__``, which no code can assign


def test_detach_repairs_through_a_reference_it_cannot_read_back() -> None:
    """A path through a bound method's ``__self__``: the edge cannot be read back, which must not make
    the repair skip the write while reporting the holder repaired."""
    global BOUND
    BOUND = _Keeper().keep
    try:
        trainer, watcher = Trainer(), gradguard.Watcher(every=1, mode="detach", ignore=elsewhere)
        for _ in range(3):
            _loss_only(trainer, 1, BOUND)
            watcher.boundary()
        kept = BOUND.__self__.kept
        history = {entry.holder: entry for entry in watcher.history()}
        assert any("__self__" in holder for holder in history), history
        assert all(t.grad_fn is None for t in kept[:-1]) and kept[-1].grad_fn is not None
        assert [entry.outcome for entry in history.values()] == ["repaired"]
    finally:
        BOUND = None


def test_the_watch_keeps_no_tensor_and_no_node_alive() -> None:
    watcher = gradguard.Watcher(every=1, mode="warn", ignore=elsewhere)
    x = torch.ones(1000, requires_grad=True)
    leaf = weakref.ref(x)
    KEPT.append(x.sin())  # SinBackward0 saves x: x lives exactly as long as that node
    del x
    with pytest.warns(gradguard.GraphRetentionWarning):  # usable for backward: followed a step for a use first
        _loss_only(Trainer(), 4, lambda loss: watcher.boundary())
    assert watcher.history()[0].holder == f"{__name__}:KEPT[*]" and leaf() is not None
    KEPT.clear()
    gc.collect()
    assert leaf() is None


def test_detach_warns_once_for_what_it_cannot_repair() -> None:
    trainer, watcher = Trainer(), gradguard.Watcher(every=1, mode="detach", ignore=elsewhere)
    loss_sum: Any = 0.0
    warned_at = []
    with pytest.warns(gradguard.GraphRetentionWarning) as caught:
        for boundary in range(1, 5):
            loss, _ = trainer.forward()
            loss.backward()
            loss_sum = loss_sum + loss  # a frame local: nothing outside this frame can assign it
            trainer.step()
            before = len(caught)
            watcher.boundary()
            warned_at += [boundary] * (len(caught) - before)
    assert loss_sum.grad_fn is not None  # not touched
    assert warned_at == [3]  # a frame's variable: a leak once its graph survived two boundaries
    messages = [str(w.message) for w in caught]
    assert "loss_sum" in messages[0] and "cannot be repaired in place" in messages[0]
    assert "a frame local" in messages[0] and "fix: " in messages[0]
    assert watcher.history()[0].outcome == "not repairable"


def test_warn_names_the_line_that_stepped_and_off_audits_nothing() -> None:
    trainer = Trainer()
    with gradguard.watch(every=1, mode="warn", ignore=elsewhere):
        with pytest.warns(gradguard.GraphRetentionWarning) as caught:
            for _ in range(2):
                loss, _ = trainer.forward()
                loss.backward()
                KEPT.append(loss)
                trainer.opt.step()  # the warning's line
    assert [w.filename for w in caught] == [__file__]
    assert str(caught[0].message).startswith(f"gradguard: {__name__}:KEPT[*]\n  keeps an autograd graph")

    watcher = gradguard.Watcher(every=1, mode="off")
    _loss_only(trainer, 3, lambda loss: (KEPT.append(loss), watcher.boundary()))
    assert watcher.boundaries == 3 and watcher.audits == 0
    assert all(t.grad_fn is not None for t in KEPT[2:])  # nothing mutated


def test_mode_none_follows_the_mode_in_force_at_each_boundary() -> None:
    trainer, watcher = Trainer(), gradguard.Watcher(every=1, ignore=elsewhere)
    _loss_only(trainer, 1, KEPT.append)
    watcher.boundary()
    _loss_only(trainer, 1, KEPT.append)
    with gradguard.enforce(mode="raise", engines="none"), pytest.raises(gradguard.GraphRetentionError):
        watcher.boundary()


# --------------------------------------------------------------------------------------------------
# One step, several optimizers; threads
# --------------------------------------------------------------------------------------------------


def test_two_optimizers_in_one_step_are_one_boundary() -> None:
    trainer = Trainer()
    head = nn.Linear(1, 1)
    other = torch.optim.SGD(head.parameters(), lr=0.1)
    with gradguard.watch(every=1, mode="raise", ignore=elsewhere) as scope:
        for _ in range(3):
            loss, _ = trainer.forward()
            head(loss.reshape(1, 1)).sum().backward()
            trainer.opt.step()
            other.step()  # the same step: `loss` is still this step's
            trainer.opt.zero_grad()
            other.zero_grad()
    assert scope.watcher.boundaries == 3 and scope.watcher.history() == []


def test_a_gans_losses_are_judged_at_their_own_optimizers_boundaries() -> None:
    torch.manual_seed(0)
    disc, gen = nn.Linear(4, 1), nn.Linear(2, 4)
    opt_d, opt_g = torch.optim.SGD(disc.parameters(), lr=0.1), torch.optim.SGD(gen.parameters(), lr=0.1)

    def d_step() -> torch.Tensor:
        d_loss = disc(gen(torch.randn(2, 2)).detach()).mean()
        d_loss.backward()
        opt_d.step()
        opt_d.zero_grad()
        return d_loss

    with gradguard.watch(every=1, mode="raise", ignore=elsewhere) as scope:
        for _ in range(3):
            # d_loss is still a frame local at opt_g.step(), made before opt_d.step(): not a leak
            d_loss = d_step()
            g_loss = -disc(gen(torch.randn(2, 2))).mean()
            g_loss.backward()
            opt_g.step()
            opt_g.zero_grad()
        assert scope.watcher.boundaries == 6 and scope.watcher.history() == []
        KEPT.append(d_loss)
        d_step()  # the kept loss has lived through one discriminator boundary: bounded so far
        with pytest.raises(gradguard.GraphRetentionError, match=r"KEPT\[0\]: 1 tensor"):
            d_step()  # and through two: it does not go away


def test_another_threads_graph_is_judged_by_its_own_boundaries() -> None:
    watcher = gradguard.Watcher(every=1, mode="raise", ignore=elsewhere)
    started, release = threading.Event(), threading.Event()
    errors: list[str] = []

    def mid_forward() -> None:
        x = torch.ones(3, requires_grad=True)
        activations = [x.sin()]  # held in this thread's frame while the main thread steps, twice
        started.set()
        release.wait(30)
        activations[0].sum().backward()

    def leaky_thread() -> None:
        trainer, kept = Trainer(seed=1), []
        try:
            _loss_only(trainer, 3, lambda loss: (kept.append(loss), watcher.boundary()))
        except gradguard.GraphRetentionError as exc:
            errors.append(str(exc))  # not the error: its traceback would keep this thread's frames

    worker = threading.Thread(target=mid_forward)
    worker.start()
    try:
        assert started.wait(30)
        trainer = Trainer()
        for _ in range(3):
            _loss_only(trainer, 1, lambda loss: None)
            report = watcher.boundary()
            assert report is None or len(report) == 0  # not audited at all once the start-up check is over
    finally:
        release.set()
        worker.join(30)
    leaky = threading.Thread(target=leaky_thread)
    leaky.start()
    leaky.join(60)
    assert len(errors) == 1 and "leaky_thread" in errors[0] and "kept[*]:" in errors[0], errors
    assert "alive for 2 step boundaries" in flat(errors[0])  # a frame's list: found at its third boundary


def _audits_while(holding: bool) -> int:
    """The audits of ten plain steps, while another thread (``holding``) waits in the middle of its own
    step with its loss in a local and its outputs in a local list."""
    started, release = threading.Event(), threading.Event()

    def mid_step() -> None:
        model = nn.Linear(8, 1)
        outputs = [model(torch.randn(4, 8)) for _ in range(2)]
        loss = outputs[0].sum()
        started.set()
        release.wait(30)
        del loss, outputs

    worker = threading.Thread(target=mid_step)
    if holding:
        worker.start()
        assert started.wait(30)
    try:
        trainer = Trainer()
        with gradguard.watch(mode="raise", ignore=elsewhere) as scope:
            _loss_only(trainer, 10, lambda loss: None)
        return scope.watcher.audits
    finally:
        release.set()
        if holding:
            worker.join(30)


def test_an_audit_leaves_what_another_threads_step_holds_to_that_thread() -> None:
    # Stamped by this thread's start-up check, the other thread's graphs grew old on this thread's boundaries
    # and asked for searches that could only find them in that thread's frame, each one charged to the watch.
    assert _audits_while(holding=True) == _audits_while(holding=False) >= 1


# --------------------------------------------------------------------------------------------------
# The scope
# --------------------------------------------------------------------------------------------------


def test_scopes_nest_and_remove_exactly_their_own_hook() -> None:
    hooks = len(_global_optimizer_post_hooks)
    outer, inner = gradguard.watch(every=1, mode="off"), gradguard.watch(every=1, mode="off")
    with outer:
        assert len(_global_optimizer_post_hooks) == hooks + 1
        with inner:
            assert len(_global_optimizer_post_hooks) == hooks + 2
            with outer:  # re-entering the same scope shares its hook
                assert len(_global_optimizer_post_hooks) == hooks + 2
            assert len(_global_optimizer_post_hooks) == hooks + 2
        assert len(_global_optimizer_post_hooks) == hooks + 1
        with pytest.raises(KeyError), gradguard.watch(every=1):
            raise KeyError("boom")
        assert len(_global_optimizer_post_hooks) == hooks + 1
    assert len(_global_optimizer_post_hooks) == hooks and _enforce.installed() == {}
    Trainer().step()  # no hook left to call


def test_as_a_decorator_of_functions_generators_and_coroutines() -> None:
    hooks = len(_global_optimizer_post_hooks)
    scope = gradguard.watch(every=1, mode="raise", ignore=elsewhere)

    @scope
    def train() -> int:
        return len(_global_optimizer_post_hooks)

    @scope
    def batches() -> Iterator[int]:
        yield len(_global_optimizer_post_hooks)
        yield len(_global_optimizer_post_hooks)

    @scope
    async def train_async() -> int:
        await asyncio.sleep(0)
        return len(_global_optimizer_post_hooks)

    assert train() == hooks + 1 and len(_global_optimizer_post_hooks) == hooks
    gen = batches()
    assert len(_global_optimizer_post_hooks) == hooks  # nothing until the body starts
    assert list(gen) == [hooks + 1, hooks + 1] and len(_global_optimizer_post_hooks) == hooks
    assert asyncio.run(train_async()) == hooks + 1 and len(_global_optimizer_post_hooks) == hooks

    @scope
    def leaky() -> None:
        _loss_only(Trainer(), 2, KEPT.append)

    with pytest.raises(gradguard.GraphRetentionError):
        leaky()
    assert len(_global_optimizer_post_hooks) == hooks


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "often", "", None, "²", "٣"])
def test_a_bad_every_names_the_value_and_what_is_accepted(bad: Any) -> None:
    with pytest.raises(gradguard.GradGuardError, match=r"every=.* is not accepted; accepted: a positive whole number"):
        gradguard.watch(every=bad)
    with pytest.raises(gradguard.GradGuardError, match="not a gradguard mode"):
        gradguard.Watcher(mode="loud")


def test_gradguard_audit_and_enforce_audit_turn_the_watch_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADGUARD_AUDIT", "bogus")
    with pytest.raises(gradguard.GradGuardError, match=r"GRADGUARD_AUDIT='bogus' is not accepted; .*0/off"):
        gradguard.enforce()
    monkeypatch.setenv("GRADGUARD_AUDIT", "1")
    trainer = Trainer()
    with gradguard.enforce(mode="raise", engines="none"):
        assert _enforce.installed() == {("watch", "audit=1"): 1}
        with gradguard.enforce(audit=1, engines="none"):  # the same every: the same watch
            assert _enforce.installed() == {("watch", "audit=1"): 2}
        with pytest.raises(gradguard.GraphRetentionError):
            _loss_only(trainer, 2, KEPT.append)
    monkeypatch.setenv("GRADGUARD_AUDIT", "off")
    with gradguard.enforce(engines="none"), gradguard.enforce(audit="auto", engines="none"):
        assert _enforce.installed() == {("watch", "audit=auto"): 1}
    monkeypatch.delenv("GRADGUARD_AUDIT")
    with gradguard.enforce(engines="none", audit=0):
        assert _enforce.installed() == {}
    with pytest.raises(gradguard.GradGuardError, match=r"audit=-2 is not accepted"):
        gradguard.enforce(audit=-2)


_RECORDS_PROGRAM = """
import dataclasses
import torch
from torch import nn


@dataclasses.dataclass(frozen=True)
class Record:
    step: int
    loss: torch.Tensor


model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(0)
RECORDS = []
for step in range(1, 7):
    REPORTED = step
    loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    r = Record(step, loss * 1)
    RECORDS.append(r)
"""


def _run(program: types.ModuleType, source: str) -> None:
    exec(compile(source, f"{program.__name__}.py", "exec"), vars(program))


def test_records_kept_in_a_list_with_the_newest_also_in_a_global_are_raised() -> None:
    """A script's ``r = Record(step, loss * 1); RECORDS.append(r)`` each step: a list that grows, whose newest
    record a module global also holds. Raised by the fourth boundary, naming the list (the search met the
    list from the newest record first, never climbed it for the older ones, whose attributes had a
    ``__dict__`` of their own by then: they went unexplained, the list was called bounded)."""
    with script_module("test_watch_records_program") as program:
        with gradguard.watch(mode="raise", every=1, ignore=elsewhere):
            with pytest.raises(gradguard.GraphRetentionError) as raised:
                _run(program, _RECORDS_PROGRAM)
        assert program.REPORTED <= 4
        assert f"{program.__name__}:RECORDS[*].loss" in flat(str(raised.value))


_TUPLE_PROGRAM = """
import torch
from torch import nn

model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(0)
KEPT = ()
for step in range(5):
    loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    KEPT = KEPT + (loss * 1,)
"""


def test_a_tuple_a_global_holds_is_rebuilt_by_the_repair() -> None:
    """``KEPT = KEPT + (loss * 1,)`` each step: the repair rebuilds the tuple and writes the global (it was
    refused as "a tuple also held elsewhere": the module's globals dict, which holds it for the module, was
    taken for another holder)."""
    with script_module("test_watch_tuple_program") as program:
        with gradguard.watch(mode="detach", every=1, ignore=elsewhere) as scope:
            _run(program, _TUPLE_PROGRAM)
        outcomes = {row.holder.rsplit(":", 1)[-1]: row.outcome for row in scope.watcher.history()}
        assert outcomes == {"KEPT[*]": "repaired"}
        assert [t.grad_fn is None for t in program.KEPT] == [True, True, True, True, False]
