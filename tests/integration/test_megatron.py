"""megatron-core adapter on the real package (0.19.x) on CPU: the leak and its fix, every loss_func
shape and append site, raise and warn modes. The loop and helpers are in ``_megatron.py``."""

from __future__ import annotations

import collections
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import pytest
import torch
import wrapt
from _megatron import (
    CALC_LOSS_CALL,
    N_MICRO,
    TinyModel,
    append_line,
    assert_detached_records,
    graph_paths,
    loss_2tuple,
    loss_2tuple_heavy,
    loss_3tuple,
    loss_clean,
    loss_detached,
    loss_non_loss_data,
    ns_config,
    run_forward_step,
    transformer_config,
)

import gradguard
from gradguard.engines import megatron as megatron_adapter

# --------------------------------------------------------------------------------------------------
# 1. The leak, reproduced; and fixed by enforce() with identical gradients
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_leak_reproduced_without_gradguard(schedules: ModuleType) -> None:
    assert not isinstance(schedules.forward_step_calc_loss, wrapt.FunctionWrapper)
    run = run_forward_step(schedules, loss_2tuple_heavy)
    assert len(run.store) == N_MICRO
    for i, record in enumerate(run.store):
        assert type(record["logits"].grad_fn).__name__ == "MeanBackward0"
        assert graph_paths(record) == [("['logits']", "MeanBackward0"), ("['logits_sq']", "MeanBackward0")], i
    del record  # the loop variable would pin the last one
    # backward ran, and still every micro-batch's activation is pinned by the store
    assert all(p.grad is not None for p in run.model.parameters())
    assert run.alive() == N_MICRO
    run.store.clear()
    assert run.alive() == 0  # the store was the only thing keeping them


@pytest.mark.integration
@pytest.mark.parametrize("engines", ["auto", ["megatron"]])
def test_enforce_detaches_records_releases_activations_same_grads(schedules: ModuleType, engines: Any) -> None:
    reference = run_forward_step(schedules, loss_2tuple_heavy, seed=1)
    assert reference.alive() == N_MICRO

    with gradguard.enforce(engines=engines):
        assert isinstance(schedules.forward_step_calc_loss, wrapt.FunctionWrapper)
        guarded = run_forward_step(schedules, loss_2tuple_heavy, seed=1)
        assert guarded.alive() == 0  # released while still inside, after gc.collect()

    assert len(guarded.store) == N_MICRO
    assert_detached_records(guarded.store, {"lm loss", "logits", "logits_sq"})
    # the values are the ones Megatron stored, just without the graph
    for ref, got in zip(reference.store, guarded.store):
        for key in ref:
            assert torch.equal(ref[key].detach(), got[key])
    # gradients bitwise equal to the unguarded run
    ref_grads, got_grads = reference.grads(), guarded.grads()
    assert ref_grads.keys() == got_grads.keys() and ref_grads
    for name in ref_grads:
        assert torch.equal(ref_grads[name], got_grads[name]), name
    # detach mode detaches what the call appended as it returns: accounted at the schedule's call
    line = append_line(schedules, CALC_LOSS_CALL)
    (site,) = [s for s in gradguard.stats().values() if s.store == megatron_adapter.STORE_NAME]
    assert site.site.endswith(f"schedules.py:{line}") and site.records == N_MICRO


@pytest.mark.integration
def test_engines_none_leaves_megatron_alone(schedules: ModuleType) -> None:
    original = schedules.forward_step_calc_loss
    with gradguard.enforce(engines="none"):
        assert schedules.forward_step_calc_loss is original
        run = run_forward_step(schedules, loss_2tuple, n=2)
    assert len(graph_paths(run.store)) == 2


# --------------------------------------------------------------------------------------------------
# 2. Every loss_func shape and every append site
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("make_config", [ns_config, transformer_config], ids=["namespace", "TransformerConfig"])
def test_three_tuple_loss_func(schedules: ModuleType, make_config: Callable[[], Any]) -> None:
    config = make_config()
    assert config.calculate_per_token_loss is False
    reference = run_forward_step(schedules, loss_3tuple, seed=2, config=config)
    assert [p for p, _ in graph_paths(reference.store)] == [f"[{i}]['logits']" for i in range(N_MICRO)]

    with gradguard.enforce():
        guarded = run_forward_step(schedules, loss_3tuple, seed=2, config=config)
    assert_detached_records(guarded.store, {"lm loss", "logits"})
    for name, grad in reference.grads().items():
        assert torch.equal(grad, guarded.grads()[name]), name


@pytest.mark.integration
def test_collect_non_loss_data(schedules: ModuleType) -> None:
    reference = run_forward_step(schedules, loss_non_loss_data, n=2, backward=False, collect_non_loss_data=True)
    assert graph_paths(reference.store) == [
        ("[0]['out']", "MulBackward0"),
        ("[0]['mean']", "MeanBackward0"),
        ("[1]['out']", "MulBackward0"),
        ("[1]['mean']", "MeanBackward0"),
    ]
    with gradguard.enforce():
        guarded = run_forward_step(schedules, loss_non_loss_data, n=2, backward=False, collect_non_loss_data=True)
        assert guarded.alive() == 0
    assert_detached_records(guarded.store, {"out", "mean"})
    for ref, got in zip(reference.store, guarded.store):
        assert torch.equal(ref["out"].detach(), got["out"])


def non_loss_tuple(target: torch.Tensor, output: torch.Tensor, non_loss_data: bool = False) -> Any:
    assert non_loss_data
    return output.detach().sum(), output.mean()  # data, not a loss: element 0 is no loss to check


@pytest.mark.integration
def test_collect_non_loss_data_is_not_loss_checked(schedules: ModuleType) -> None:
    megatron_adapter.configure(loss_check="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gradguard.enforce():
            run = run_forward_step(schedules, non_loss_tuple, n=2, backward=False, collect_non_loss_data=True)
    assert len(run.store) == 2 and all(type(r) is tuple for r in run.store)
    assert gradguard.find_graphs(run.store) == []


@pytest.mark.integration
def test_loss_func_none_output_appended_detached_but_returned_live(schedules: ModuleType) -> None:
    reference = run_forward_step(schedules, None, n=2, seed=3, keep_outputs=True)
    assert graph_paths(reference.store) == [("[0]", "AddmmBackward0"), ("[1]", "AddmmBackward0")]

    with gradguard.enforce():
        guarded = run_forward_step(schedules, None, n=2, seed=3, keep_outputs=True)
    assert type(guarded.store) is list and len(guarded.store) == 2
    assert gradguard.find_graphs(guarded.store) == []
    for stored, returned, ref in zip(guarded.store, guarded.outputs, reference.store):
        assert not stored.requires_grad and torch.equal(stored, returned.detach())
        assert torch.equal(stored, ref.detach())
        # what forward_step hands back to the schedule keeps its graph: Megatron backprops it
        assert type(returned.grad_fn).__name__ == "AddmmBackward0"
    for name, grad in reference.grads().items():  # backward_step(…, ones) ran through it
        assert grad.abs().sum() > 0 and torch.equal(grad, guarded.grads()[name]), name


@pytest.mark.integration
def test_forward_step_calc_loss_called_directly(schedules: ModuleType) -> None:
    """The combined-1F1B path calls forward_step_calc_loss itself, not through forward_step."""
    torch.manual_seed(4)
    model, config, store = TinyModel(), ns_config(), []
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    with gradguard.enforce():
        out = model(x)
        loss, num_tokens = schedules.forward_step_calc_loss(
            model,
            out,
            partial(loss_2tuple, y),
            config,
            None,
            False,
            N_MICRO,
            store,
            cp_group_size=1,
            is_last_stage=True,
        )
        expected = torch.nn.functional.mse_loss(out, y) / N_MICRO
        assert torch.allclose(loss, expected) and loss.requires_grad  # scaled in place, still live
        assert int(num_tokens) == 0
        # not the last stage: loss_func not called, nothing appended, the output returned as is
        same, _ = schedules.forward_step_calc_loss(
            model,
            out,
            partial(loss_detached, y),
            config,
            None,
            False,
            N_MICRO,
            store,
            cp_group_size=1,
            is_last_stage=False,
        )
        assert same is out
        # every argument by keyword, as a user's own schedule might call it
        schedules.forward_step_calc_loss(
            model=model,
            output_tensor=model(x),
            loss_func=partial(loss_2tuple, y),
            config=config,
            vp_stage=None,
            collect_non_loss_data=False,
            num_microbatches=N_MICRO,
            forward_data_store=store,
            cp_group_size=1,
            is_last_stage=True,
        )
    assert_detached_records(store, {"lm loss", "logits"})
    assert len(store) == 2


@pytest.mark.integration
def test_direct_calls_are_accounted_to_their_own_line(schedules: ModuleType) -> None:
    """Called directly, the patched plain function reaches the adapter through one gradguard frame
    more than a patched wrapt-decorated one does: either way stats name the calling line, never
    the line above it."""
    here = os.path.abspath(__file__)
    model, config, store = TinyModel(), ns_config(), []
    y = torch.randn(2, 4)

    def call() -> int:
        line = sys._getframe().f_lineno + 1
        schedules.forward_step_calc_loss(
            model, model(torch.randn(2, 8)), partial(loss_2tuple, y), config, None, False, 1, store, 1, True
        )
        return line

    def passthrough(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        return wrapped(*args, **kwargs)

    original = schedules.forward_step_calc_loss
    with gradguard.enforce():
        direct = call()
    schedules.forward_step_calc_loss = wrapt.FunctionWrapper(original, passthrough)  # someone else's, first
    try:
        with gradguard.enforce():
            assert type(schedules.forward_step_calc_loss) is wrapt.FunctionWrapper  # wrapt's own C call
            assert call() == direct
    finally:
        schedules.forward_step_calc_loss = original
    sites = {s.site: s.records for s in gradguard.stats().values() if s.store == megatron_adapter.STORE_NAME}
    assert sites == {f"{here}:{direct}": 2}
    assert gradguard.find_graphs(store) == []


@pytest.mark.integration
@pytest.mark.parametrize("store_type", [list, collections.deque])
def test_detach_mode_when_the_call_raises_after_the_append(schedules: ModuleType, store_type: type) -> None:
    """A list store is detached as forward_step_calc_loss returns, even by an exception; another
    store type is guarded during the call. Either way nothing kept carries a graph."""

    class FailingTimers:
        def __call__(self, name: str) -> FailingTimers:
            return self

        def stop(self) -> None:  # megatron stops the forward timer after the append
            raise RuntimeError("timer broke")

    model, config, store = TinyModel(), ns_config(), store_type()
    config.timers = FailingTimers()
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    with gradguard.enforce(), pytest.raises(RuntimeError, match="timer broke"):
        schedules.forward_step_calc_loss(
            model, model(x), partial(loss_2tuple, y), config, None, False, 1, store, 1, True
        )
    assert type(store) is store_type and len(store) == 1
    assert gradguard.find_graphs(list(store)) == []


# --------------------------------------------------------------------------------------------------
# 3. Strict mode raises at the append, naming path, grad_fn and the schedule's line
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_raise_mode_refuses_at_megatron_append(schedules: ModuleType) -> None:
    line = append_line(schedules, "forward_data_store.append(loss_reduced)")
    store: list[Any] = []
    with gradguard.enforce(mode="raise"):
        run_forward_step(schedules, loss_clean, n=1, store=store)  # clean records pass
        assert len(store) == 1
        previous = list(store)
        with pytest.raises(gradguard.GraphRetentionError) as excinfo:
            run_forward_step(schedules, loss_2tuple, n=1, store=store)
    message = str(excinfo.value)
    assert "['logits']" in message
    assert "MeanBackward0" in message
    assert f"schedules.py:{line}" in message
    assert megatron_adapter.STORE_NAME in message
    assert store == previous and len(store) == 1  # nothing stored
    # raised from the append itself
    frames = [(os.path.basename(f.filename), f.lineno) for f in traceback.extract_tb(excinfo.tb)]
    assert ("schedules.py", line) in frames


@pytest.mark.integration
def test_raise_mode_empty_store_unchanged(schedules: ModuleType) -> None:
    store: list[Any] = []
    with gradguard.enforce(mode="raise"), pytest.raises(gradguard.GraphRetentionError, match=r"\['logits'\]"):
        run_forward_step(schedules, loss_3tuple, n=1, store=store)
    assert store == []


# --------------------------------------------------------------------------------------------------
# 4. warn mode: one warning per site, however many micro-batches
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_warn_mode_warns_once_for_many_micro_batches(schedules: ModuleType) -> None:
    line = append_line(schedules, "forward_data_store.append(loss_reduced)")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # gradguard's own once-per-site, not the warnings registry
        with gradguard.enforce(mode="warn"):
            run = run_forward_step(schedules, loss_2tuple_heavy, n=8)
    retention = [w for w in caught if issubclass(w.category, gradguard.GraphRetentionWarning)]
    assert len(retention) == 1, [str(w.message) for w in retention]
    (w,) = retention
    assert os.path.basename(w.filename) == "schedules.py" and w.lineno == line
    assert "['logits']" in str(w.message) and "['logits_sq']" in str(w.message)
    assert len(run.store) == 8
    assert_detached_records(run.store, {"lm loss", "logits", "logits_sq"})
    assert run.alive() == 0
