"""The micro-batch clock: stores filled once per micro-batch inside one optimizer step, with no adapter.

Each leak here is cleared (or overwritten) before the step boundary, so only the micro-batch clock can see it;
each correct program keeps graphs alive across micro-batches on purpose. Every audit scans the whole heap
of this process, so each test runs a few micro-batches of a tiny model.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _tables import flat
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradguard


def elsewhere(entry: gradguard.Retention) -> bool:
    """Graphs other tests of this process left behind: not this file's business."""
    return "test_microbatch" not in entry.path


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(g: torch.Generator) -> torch.Tensor:
    return torch.randn(4, 8, generator=g)


class Engine:
    """The seed's shape: each micro-batch's output published into ``output_lst``, cleared before the step."""

    def __init__(self, model: nn.Module, fixed: bool = False) -> None:
        self.model = model
        self.fixed = fixed
        self.output_lst: list[dict[str, Any]] = []
        self.at: tuple[int, int] | None = None

    def run(self, step: int, batches: list[torch.Tensor]) -> float:
        for i, x in enumerate(batches):
            self.at = (step, i)
            logp = torch.log_softmax(self.model(x), -1)
            loss = -logp.mean()
            loss.backward()
            self.output_lst.append(
                {"loss": loss.item(), "model_output": {"log_probs": logp.detach() if self.fixed else logp}}
            )
        mean = sum(r["loss"] for r in self.output_lst) / len(self.output_lst)
        self.output_lst.clear()
        return mean


def _train(engine: Engine, steps: int, micro: int, scope: Any = None) -> nn.Module:
    opt = torch.optim.SGD(engine.model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with scope if scope is not None else contextlib.nullcontext():
        for step in range(steps):
            engine.run(step, [_batch(g) for _ in range(micro)])
            opt.step()
            opt.zero_grad()
    return engine.model


def test_the_seed_shape_is_raised_within_its_first_step_naming_the_store() -> None:
    engine = Engine(_model())
    with pytest.raises(gradguard.GraphRetentionError) as raised:
        _train(engine, 2, 12, gradguard.watch(mode="raise", ignore=elsewhere))
    assert engine.at is not None and engine.at[0] == 0 and engine.at[1] <= 3
    text = flat(str(raised.value))
    assert "self.output_lst[*]['model_output']['log_probs']" in text
    assert "across the micro-batches of one step" in text and "the backward itself completed" in text
    assert "fix: detach before storing into self.output_lst[0]['model_output']['log_probs']" in text


def test_the_raise_comes_after_the_backward_with_its_gradients_intact() -> None:
    def grads(watched: bool) -> list[torch.Tensor]:
        engine = Engine(_model())
        g = torch.Generator().manual_seed(1)
        scope = gradguard.watch(mode="raise", ignore=elsewhere) if watched else contextlib.nullcontext()
        with contextlib.suppress(gradguard.GraphRetentionError), scope:
            engine.run(0, [_batch(g) for _ in range(3)])
        assert engine.at == (0, 2)
        return [p.grad.clone() for p in engine.model.parameters()]

    for a, b in zip(grads(False), grads(True)):
        assert torch.equal(a, b)


def test_two_micro_batches_a_step_are_found_by_reading_the_store_again() -> None:
    engine = Engine(_model())
    with pytest.raises(gradguard.GraphRetentionError, match=r"self\.output_lst\["):
        _train(engine, 4, 2, gradguard.watch(mode="raise", ignore=elsewhere))
    assert engine.at == (1, 1)


def test_the_fixed_seed_is_silent_and_trains_bitwise_as_unwatched() -> None:
    plain = _train(Engine(_model(), fixed=True), 3, 8)
    with gradguard.watch(mode="raise", ignore=elsewhere) as scope:
        watched = _train(Engine(_model(), fixed=True), 3, 8)
    assert scope.watcher.history() == []
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)


def test_detach_keeps_the_seed_at_a_few_micro_batches_and_the_weights_equal() -> None:
    kept: list[int] = []

    class Counting(Engine):
        def run(self, step: int, batches: list[torch.Tensor]) -> float:
            for x in batches:
                logp = torch.log_softmax(self.model(x), -1)
                (-logp.mean()).backward()
                self.output_lst.append({"model_output": {"log_probs": logp}})
            kept.append(sum(r["model_output"]["log_probs"].grad_fn is not None for r in self.output_lst))
            self.output_lst.clear()
            return 0.0

    plain = _train(Counting(_model()), 3, 24)
    kept.clear()
    with gradguard.watch(mode="detach", ignore=elsewhere) as scope:
        watched = _train(Counting(_model()), 3, 24)
    assert max(kept) <= 4, kept  # graphs still attached at the end of each step, of 24 published
    (row,) = scope.watcher.history()
    assert row.clock == "micro" and row.outcome == "repaired"
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)


def test_warn_mode_warns_once_per_holder() -> None:
    engine = Engine(_model())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(engine, 2, 10, gradguard.watch(mode="warn", ignore=elsewhere))
    said = [w for w in caught if issubclass(w.category, gradguard.GraphRetentionWarning)]
    assert len(said) == 1 and "output_lst[*]" in str(said[0].message)


class Stage(torch.autograd.Function):
    """A stage keeping its tensors on ``ctx`` (not ``save_for_backward``): a backward does not free them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w
        ctx.x, ctx.h, ctx.w = x, h, w
        return torch.relu(h)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gh = g * (ctx.h > 0)
        return gh @ ctx.w.t(), ctx.x.t() @ gh


def _custom_function_context(w: nn.Parameter, g: torch.Generator, steps: int, micro: int) -> None:
    class Context:
        def __init__(self) -> None:
            self.losses: list[torch.Tensor] = []

    context = Context()
    opt = torch.optim.SGD([w], lr=0.01)
    for _ in range(steps):
        for _ in range(micro):
            total_loss = Stage.apply(torch.randn(16, 8, generator=g), w).pow(2).mean()
            total_loss.backward()
            context.losses.append(total_loss)
        context.losses.clear()
        opt.step()
        opt.zero_grad()


def _local_list_stacked(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        losses = []
        for _ in range(micro):
            loss = model(_batch(g)).pow(2).mean() / micro
            loss.backward()
            losses.append(loss)
        reporting = torch.stack(losses).sum()
        opt.step()
        opt.zero_grad()
        del reporting


def _metric_buffer(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    buf: dict[str, list[torch.Tensor]] = {"preds": [], "labels": []}
    for _ in range(steps):
        for _ in range(micro):
            logits = model(_batch(g))
            y = torch.randint(0, 4, (4,), generator=g)
            nn.functional.cross_entropy(logits, y).backward()
            buf["preds"].append(logits)
            buf["labels"].append(y)
        buf = {"preds": [], "labels": []}
        opt.step()
        opt.zero_grad()


def _side_branch(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    output_lst = []
    for _ in range(steps):
        for _ in range(micro):
            logits = model(_batch(g))
            logits.pow(2).mean().backward()
            output_lst.append({"log_probs": torch.log_softmax(logits / 0.7, -1)[:, 0]})  # after the backward
        output_lst.clear()
        opt.step()
        opt.zero_grad()


def _some_micro_batches(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    output_lst = []
    for _ in range(steps):
        for i in range(micro * 4):
            out = model(_batch(g))
            out.pow(2).mean().backward()
            output_lst.append({"out": out if i % 8 == 7 else out.detach()})
        output_lst.clear()
        opt.step()
        opt.zero_grad()


def _cleared_after_step(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    output_lst = []
    for _ in range(steps):
        for _ in range(micro):
            logp = torch.log_softmax(model(_batch(g)), -1)
            (-logp.mean()).backward()
            output_lst.append({"model_output": {"log_probs": logp}})
        opt.step()
        opt.zero_grad()
        output_lst.clear()


def _no_optimizer(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    kept = []
    for _ in range(steps * micro):
        out = model(_batch(g))
        out.pow(2).mean().backward()
        kept.append(out)


LEAKS: dict[str, tuple[Callable[..., None], str]] = {
    "a custom Function keeping its tensors on ctx": (_custom_function_context, "context.losses[*]"),
    "a local list stacked into a reporting loss": (_local_list_stacked, "losses[*]"),
    "a metric buffer of predictions": (_metric_buffer, "buf['preds'][*]"),
    "a side branch computed after the backward": (_side_branch, "output_lst[*]['log_probs']"),
    "a leak on one micro-batch in eight": (_some_micro_batches, "output_lst[*]['out']"),
    "records cleared just after the step": (_cleared_after_step, "output_lst[*]['model_output']['log_probs']"),
    "backwards and no optimizer": (_no_optimizer, "kept[*]"),
}


@pytest.mark.parametrize("case", sorted(LEAKS))
def test_within_step_leaks_are_raised_in_their_first_step_naming_the_holder(case: str) -> None:
    run, holder = LEAKS[case]
    g = torch.Generator().manual_seed(1)
    first = _model() if run is not _custom_function_context else nn.Parameter(torch.randn(8, 8) * 0.1)
    with pytest.raises(gradguard.GraphRetentionError) as raised:
        with gradguard.watch(mode="raise", ignore=elsewhere):
            run(first, g, 3, 8)
    text = flat(str(raised.value))
    assert holder in text and "across the micro-batches of one step" in text, text


def _gpipe(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fwd_outputs = []
    for _ in range(steps):
        for _ in range(micro):
            fwd_outputs.append(model(_batch(g)).pow(2).mean() / micro)
        for loss in reversed(fwd_outputs):
            loss.backward()
        fwd_outputs.clear()
        opt.step()
        opt.zero_grad()


def _one_f_one_b(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        pending: collections.deque[torch.Tensor] = collections.deque()
        for _ in range(micro):
            pending.append(model(_batch(g)).pow(2).mean() / micro)
            if len(pending) == 4:
                pending.popleft().backward()
        while pending:
            pending.popleft().backward()
        opt.step()
        opt.zero_grad()


class Slot:
    last: Any = None


def _last_in_a_local_and_a_slot(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    slot = Slot()
    for _ in range(steps):
        for _ in range(micro):
            out = model(_batch(g))
            loss = out.pow(2).mean() / micro
            loss.backward()
        slot.last = {"loss": loss, "out": out}
        opt.step()
        opt.zero_grad()


def _retain_graph_two_losses(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    head = nn.Linear(4, 1)
    opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.01)
    for _ in range(steps):
        for _ in range(micro):
            h = model(_batch(g))
            first = h.pow(2).mean()
            first.backward(retain_graph=True)
            second = head(h).abs().mean()
            second.backward()
        opt.step()
        opt.zero_grad()


def _gradient_penalty(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro):
            x = _batch(g).requires_grad_()
            out = model(x)
            (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = out.mean() + 10 * (gx.norm(dim=1) - 1).pow(2).mean()
            (loss / micro).backward()
        opt.step()


def _sum_then_backward(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        total: Any = 0
        for _ in range(micro):
            total = total + model(_batch(g)).pow(2).mean() / micro
        total.backward()
        opt.step()
        opt.zero_grad()


def _checkpointed(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        for _ in range(micro):
            for reentrant in (False, True):
                x = _batch(g).requires_grad_(reentrant)
                checkpoint(model, x, use_reentrant=reentrant).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _deque_of_four(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    last4: collections.deque[torch.Tensor] = collections.deque(maxlen=4)
    for _ in range(steps):
        for _ in range(micro):
            loss = model(_batch(g)).pow(2).mean()
            loss.backward()
            last4.append(loss)
        opt.step()
        opt.zero_grad()


def _detached_store(model: nn.Module, g: torch.Generator, steps: int, micro: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    output_lst = []
    for _ in range(steps):
        for _ in range(micro):
            out = model(_batch(g))
            loss = out.pow(2).mean() / micro
            loss.backward()
            output_lst.append({"loss": loss.detach(), "loss_f": loss.item(), "out": out.detach()})
        output_lst.clear()
        opt.step()
        opt.zero_grad()


CORRECT: dict[str, Callable[..., None]] = {
    "GPipe: every forward kept, then every backward": _gpipe,
    "1F1B: four outputs in flight": _one_f_one_b,
    "the last micro-batch in a local and a slot": _last_in_a_local_and_a_slot,
    "retain_graph with two losses over a shared trunk": _retain_graph_two_losses,
    "a create_graph gradient penalty": _gradient_penalty,
    "one backward over the summed losses": _sum_then_backward,
    "checkpointed blocks, reentrant and not": _checkpointed,
    "a deque(maxlen=4) of losses": _deque_of_four,
    "a store of detached values": _detached_store,
}


@pytest.mark.parametrize("case", sorted(CORRECT))
def test_graphs_kept_across_micro_batches_on_purpose_are_silent_and_unchanged(case: str) -> None:
    run = CORRECT[case]

    def weights(scope: Any) -> list[torch.Tensor]:
        model = _model()
        with scope:
            run(model, torch.Generator().manual_seed(1), 3, 8)
        return [p.detach().clone() for p in model.parameters()]

    plain = weights(contextlib.nullcontext())
    with gradguard.watch(mode="raise", ignore=elsewhere) as scope:
        raised = weights(contextlib.nullcontext())
    assert scope.watcher.history() == []
    repaired = weights(gradguard.watch(mode="detach", ignore=elsewhere))
    for a, b, c in zip(plain, raised, repaired):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.fixture(autouse=True)
def _no_listener_left() -> Iterator[None]:
    from gradguard._watch import backwards

    before = backwards.listening()
    yield
    assert backwards.listening() == before


def test_a_deque_with_maxlen_is_bounded_on_the_step_clock_too() -> None:
    """One loss a step kept in a ``deque(maxlen=4)``: never more than four graphs, so listed as bounded and
    never raised, however many step boundaries each lives through."""

    def train(scope: Any) -> nn.Module:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        last4: collections.deque[torch.Tensor] = collections.deque(maxlen=4)
        with scope:
            for _ in range(24):
                loss = model(_batch(g)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                last4.append(loss)
        return model

    plain = train(contextlib.nullcontext())
    with gradguard.watch(every=1, mode="raise", ignore=elsewhere) as scope:
        watched = train(contextlib.nullcontext())
    assert scope.watcher.history() == []
    assert [row.holder.rsplit(": ", 1)[1] for row in scope.watcher.bounded()] == ["last4[*]"]
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)


def test_a_long_deque_of_graphs_is_a_store_that_grows_not_a_bounded_one() -> None:
    """A ``deque(maxlen=1000)`` of each step's loss keeps a thousand graphs before it stops growing: judged as
    any store under the defaults (reported by the third boundary, naming the deque), not listed as bounded."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    kept: collections.deque[torch.Tensor] = collections.deque(maxlen=1000)
    reported = None
    with gradguard.watch(mode="raise", ignore=elsewhere):
        with pytest.raises(gradguard.GraphRetentionError) as raised:
            for step in range(1, 31):
                reported = step
                loss = model(_batch(g)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                kept.append(loss)
    assert reported is not None and reported <= 3
    assert "kept[*]" in str(raised.value)


def test_a_costly_first_search_and_a_spent_collector_do_not_starve_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a large heap the micro-batch clock's first search can take longer than the program ran so far, and
    its collections their ration: those are the clock's start-up, and the store is still found in the first
    step (a search charged to the share, or a collection refused, had declined every later request)."""
    from gradguard._watch import auditing, garbage

    search = auditing.Auditor._search_micro
    work = auditing.work_clock
    late = [0.0]

    def slow_search(self: Any, *args: Any) -> bool:
        found = search(self, *args)
        late[0] = late[0] or 30.0  # the first search took 30 seconds, as a large heap can make it
        return found

    def spent(self: Any, oldest: Callable[[], int | None], boundary: int) -> bool | None:
        return None  # no collection affordable

    monkeypatch.setattr(auditing, "work_clock", lambda: work() + late[0])
    monkeypatch.setattr(auditing.Auditor, "_search_micro", slow_search)
    monkeypatch.setattr(garbage.Collector, "garbage", spent)
    engine = Engine(_model())
    with pytest.raises(gradguard.GraphRetentionError, match=r"self\.output_lst\[\*\]"):
        _train(engine, 2, 12, gradguard.watch(mode="raise", ignore=elsewhere))
    assert engine.at is not None and engine.at[0] == 0


def test_a_micro_batch_boundary_runs_only_when_an_earlier_backward_s_graph_is_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The backward's listener decides, before the backward runs, whether its boundary has anything to do: a
    graph of an earlier backward alive then (a dead one never comes back). A clean loop's boundaries do
    nothing after the backward; one that keeps the last loss gets its boundary after every backward."""
    from gradguard._watch.watcher import Watcher

    ran: list[int] = []
    boundary = Watcher._micro_boundary

    def counted(self: Watcher, state: Any) -> None:
        ran.append(state.micro)
        boundary(self, state)

    monkeypatch.setattr(Watcher, "_micro_boundary", counted)
    model = _model()
    x = torch.randn(4, 8)
    with gradguard.watch(mode="warn", memory=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            model(x).pow(2).mean().backward()
        clean = list(ran)
        kept = []
        for _ in range(3):
            loss = model(x).pow(2).mean()
            loss.backward()
            kept.append(loss)
    assert clean == []
    assert ran[-2:] == [6, 7]  # the 6th and 7th backwards: the 5th's graph, then the 6th's, kept
