"""megatron-core adapter, proven on the real package (0.19.x) on CPU.

The tests drive Megatron's own ``schedules.forward_step``, ``schedules.forward_step_calc_loss`` and
``schedules.backward_step``: the full schedules hard-code CUDA, but with ``cp_group_size=1`` and
``is_last_stage=True`` these three run without ``torch.distributed`` or ``parallel_state``; the loop
below is what ``forward_backward_no_pipelining`` does per micro-batch.
"""

from __future__ import annotations

import ast
import collections
import gc
import inspect
import os
import subprocess
import sys
import textwrap
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import wrapt
from conftest import require_engine

import gradguard
from gradguard import _policy
from gradguard.engines import megatron as megatron_adapter

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
N_MICRO = 4
TIMEOUT_S = 120


# --------------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schedules() -> Iterator[ModuleType]:
    module = require_engine(SCHEDULES)
    # megatron's import leaves ~400k objects for every gc.collect() to scan (0.3-0.5 s each): park
    # them in the permanent generation so the collections below only see what the tests create.
    gc.collect()
    gc.freeze()
    try:
        yield module
    finally:
        gc.unfreeze()


@pytest.fixture(autouse=True)
def _pristine(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[None]:
    """No GRADGUARD, no enforce scope, default loss check; megatron unpatched before and after."""
    monkeypatch.delenv("GRADGUARD", raising=False)
    _policy._reload_env()
    assert _policy._enforced.get() is None
    mod = sys.modules.get(SCHEDULES)
    original = None if mod is None else mod.forward_step_calc_loss
    assert not isinstance(original, wrapt.FunctionWrapper), "a previous test left megatron patched"
    try:
        yield
    finally:
        megatron_adapter.configure()  # back to the default loss_check="warn"
        _policy._reload_env()
    if mod is not None:
        assert mod.forward_step_calc_loss is original, "enforce exit did not restore the original"


class TinyModel(torch.nn.Module):
    """``forward_step`` calls ``get_attr_wrapped_model(model, "set_input_tensor")``: it must exist."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.input_tensor = input_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def ns_config() -> SimpleNamespace:
    """Exactly the attributes forward_step / forward_step_calc_loss / backward_step read on CPU."""
    return SimpleNamespace(
        timers=None,
        enable_autocast=False,
        autocast_dtype=torch.float32,
        calculate_per_token_loss=False,
        grad_scale_func=None,
        deallocate_pipeline_outputs=False,
    )


def transformer_config() -> Any:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)


# loss_func(target, output) shapes -----------------------------------------------------------------


def loss_2tuple(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The common user bug: ``output.mean()`` published undetached."""
    loss = torch.nn.functional.mse_loss(output, target)
    return loss, {"lm loss": loss.detach().clone(), "logits": output.mean()}


def loss_2tuple_heavy(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """Plus a branch backward never traverses: ``PowBackward0`` saves the activation itself."""
    loss, report = loss_2tuple(target, output)
    report["logits_sq"] = (output**2).mean()
    return loss, report


def loss_3tuple(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    loss_sum = ((output - target) ** 2).sum()
    num_tokens = torch.tensor(output.numel(), dtype=torch.int)
    report = {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()]), "logits": output.mean()}
    return loss_sum, num_tokens, report


def loss_clean(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = torch.nn.functional.mse_loss(output, target)
    return loss, {"lm loss": loss.detach().clone()}


def loss_detached(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The loss-contract trap: a detach placed before the loss."""
    loss = torch.nn.functional.mse_loss(output.detach(), target)
    return loss, {"lm loss": loss.detach().clone()}


def loss_non_loss_data(target: torch.Tensor, output: torch.Tensor, non_loss_data: bool = False) -> Any:
    assert non_loss_data, "collect_non_loss_data=True calls loss_func(output, non_loss_data=True)"
    return {"out": output * 2, "mean": output.mean()}


@dataclass
class Run:
    store: list[Any]
    model: TinyModel
    activations: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)  # what forward_step returned (kept only on request)

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in self.model.named_parameters()}

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.activations)


def run_forward_step(
    schedules: ModuleType,
    loss_fn: Callable[..., Any] | None,
    *,
    n: int = N_MICRO,
    seed: int = 0,
    config: Any = None,
    store: list[Any] | None = None,
    backward: bool = True,
    collect_non_loss_data: bool = False,
    keep_outputs: bool = False,
) -> Run:
    """Megatron's no-pipelining loop on the last (and only) stage, one micro-batch at a time."""
    torch.manual_seed(seed)
    model = TinyModel()
    data = iter([(torch.randn(2, 8), torch.randn(2, 4)) for _ in range(n)])
    config = ns_config() if config is None else config
    run = Run(store=[] if store is None else store, model=model)

    def forward_step_func(data_iterator: Iterator[Any], model: TinyModel) -> tuple[torch.Tensor, Any]:
        x, y = next(data_iterator)
        out = model(x)
        run.activations.append(weakref.ref(out))
        return out, (None if loss_fn is None else partial(loss_fn, y))

    for i in range(n):
        output_tensor, _num_tokens = schedules.forward_step(
            forward_step_func,
            data,
            model,
            n,
            None,  # input_tensor: first stage
            run.store,  # forward_data_store (positional index 5)
            config,
            1,  # cp_group_size (positional index 7, required)
            collect_non_loss_data=collect_non_loss_data,
            is_first_microbatch=(i == 0),
            current_microbatch=i,
            is_last_stage=True,
        )
        if backward:
            grad = None if loss_fn is not None else torch.ones_like(output_tensor)
            schedules.backward_step(None, output_tensor, grad, config)
        if keep_outputs:
            run.outputs.append(output_tensor)
        del output_tensor
    return run


def append_line(schedules: ModuleType, statement: str) -> int:
    """The line number of ``statement`` in the installed schedules.py (exactly one occurrence)."""
    path = inspect.getsourcefile(schedules)
    assert path is not None
    with open(path, encoding="utf-8") as f:
        lines = [i for i, text in enumerate(f, start=1) if text.strip() == statement]
    assert len(lines) == 1, f"{statement!r} found at lines {lines} of {path}"
    return lines[0]


CALC_LOSS_CALL = "output_tensor, num_tokens = forward_step_calc_loss("  # in forward_step


def graph_paths(store: list[Any]) -> list[tuple[str, str]]:
    return [(g.path, g.grad_fn) for g in gradguard.find_graphs(store)]


def assert_detached_records(store: list[Any], keys: set[str]) -> None:
    assert type(store) is list  # the caller's own list, never a proxy
    assert gradguard.find_graphs(store) == []
    for record in store:
        assert type(record) is dict and set(record) == keys
        for value in record.values():
            assert not value.requires_grad and value.grad_fn is None


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
            model, out, partial(loss_2tuple, y), config, None, False, N_MICRO, store, cp_group_size=1, is_last_stage=True
        )
        expected = torch.nn.functional.mse_loss(out, y) / N_MICRO
        assert torch.allclose(loss, expected) and loss.requires_grad  # scaled in place, still live
        assert int(num_tokens) == 0
        # not the last stage: loss_func not called, nothing appended, the output returned as is
        same, _ = schedules.forward_step_calc_loss(
            model, out, partial(loss_detached, y), config, None, False, N_MICRO, store, cp_group_size=1, is_last_stage=False
        )
        assert same is out
        # every argument by keyword, as a user's own schedule might call it
        schedules.forward_step_calc_loss(
            model=model, output_tensor=model(x), loss_func=partial(loss_2tuple, y), config=config, vp_stage=None,
            collect_non_loss_data=False, num_microbatches=N_MICRO, forward_data_store=store,
            cp_group_size=1, is_last_stage=True,
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
        schedules.forward_step_calc_loss(model, model(torch.randn(2, 8)), partial(loss_2tuple, y), config, None, False,
                                         1, store, 1, True)
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
        schedules.forward_step_calc_loss(model, model(x), partial(loss_2tuple, y), config, None, False, 1, store, 1, True)
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


# --------------------------------------------------------------------------------------------------
# 5. The loss contract at the last stage
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_detached_loss_warns_by_default(schedules: ModuleType) -> None:
    with gradguard.enforce(), pytest.warns(gradguard.LossContractWarning, match="does not require grad") as record:
        run = run_forward_step(schedules, loss_detached, n=2)
    contract = [w for w in record if issubclass(w.category, gradguard.LossContractWarning)]
    assert len(contract) == 2  # one per micro-batch: each is a loss that cannot train
    # checked on what forward_step_calc_loss returned: attributed to the schedule's call, not to gradguard
    line = append_line(schedules, CALC_LOSS_CALL)
    assert {(os.path.basename(w.filename), w.lineno) for w in contract} == {("schedules.py", line)}
    # Megatron itself skipped backward (the output needs no grad) and kept going
    assert all(p.grad is None for p in run.model.parameters())
    assert len(run.store) == 2


@pytest.mark.integration
def test_detached_loss_raises_when_configured(schedules: ModuleType) -> None:
    megatron_adapter.configure(loss_check="raise")
    store: list[Any] = []
    with gradguard.enforce(), pytest.raises(gradguard.LossContractError, match="does not require grad"):
        run_forward_step(schedules, loss_detached, n=1, store=store)
    assert len(store) == 1 and gradguard.find_graphs(store) == []  # raised as the call returned
    # a healthy loss passes the same check
    with gradguard.enforce():
        run_forward_step(schedules, loss_clean, n=1, store=store)
    assert len(store) == 2


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["detach", "raise"])
def test_without_is_last_stage_the_loss_func_is_checked(
    schedules: ModuleType, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """combined 1F1B calls forward_step_calc_loss with eight arguments: megatron asks parallel_state
    for the stage, and the adapter checks what loss_func returns, at the loss_func call."""
    monkeypatch.setattr(schedules.parallel_state, "get_context_parallel_world_size", lambda: 1)
    monkeypatch.setattr(schedules.parallel_state, "is_pipeline_last_stage", lambda **_: True)
    model, config, store = TinyModel(), ns_config(), []
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    line = append_line(schedules, "outputs = loss_func(output_tensor)")
    with gradguard.enforce(mode=mode):
        with pytest.warns(gradguard.LossContractWarning, match="does not require grad") as record:
            schedules.forward_step_calc_loss(model, model(x), partial(loss_detached, y), config, None, False, 1, store)
        contract = [w for w in record if issubclass(w.category, gradguard.LossContractWarning)]
        assert [(os.path.basename(w.filename), w.lineno) for w in contract] == [("schedules.py", line)]
        loss, _ = schedules.forward_step_calc_loss(model, model(x), partial(loss_clean, y), config, None, False, 1, store)
    assert loss.requires_grad  # a healthy loss passes, silently
    assert_detached_records(store, {"lm loss"})
    assert len(store) == 2


@pytest.mark.integration
def test_detached_loss_check_off(schedules: ModuleType) -> None:
    megatron_adapter.configure(loss_check="off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gradguard.enforce():
            run = run_forward_step(schedules, loss_detached, n=2)
    assert len(run.store) == 2


@pytest.mark.integration
def test_no_loss_check_under_no_grad(schedules: ModuleType) -> None:
    megatron_adapter.configure(loss_check="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with gradguard.enforce(), torch.no_grad():
            run = run_forward_step(schedules, loss_2tuple, n=2, backward=False)
    assert len(run.store) == 2 and gradguard.find_graphs(run.store) == []


@pytest.mark.integration
def test_configure_rejects_unknown_value() -> None:
    """d17: the message names the parameter the user passed, and what it accepts."""
    for bad in ("loud", "strict"):
        with pytest.raises(gradguard.GradGuardError, match=rf"loss_check='{bad}' is not accepted; accepted: 'raise'"):
            megatron_adapter.configure(loss_check=bad)


# --------------------------------------------------------------------------------------------------
# 6. Install / uninstall: identity restored, nesting, the combined-1F1B function-local import
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_exit_restores_the_identical_original(schedules: ModuleType) -> None:
    original = schedules.forward_step_calc_loss
    forward_step, backward_step = schedules.forward_step, schedules.backward_step
    with gradguard.enforce():
        patched = schedules.forward_step_calc_loss
        assert patched is not original and isinstance(patched, wrapt.FunctionWrapper)
        assert patched.__wrapped__ is original
        # nothing else is touched
        assert schedules.forward_step is forward_step and schedules.backward_step is backward_step
    assert schedules.forward_step_calc_loss is original


@pytest.mark.integration
def test_nested_enforce_keeps_the_patch_until_outer_exit(schedules: ModuleType) -> None:
    original = schedules.forward_step_calc_loss
    with gradguard.enforce():
        patched = schedules.forward_step_calc_loss
        with gradguard.enforce(engines=["megatron"]):
            assert schedules.forward_step_calc_loss is patched  # not wrapped twice
        assert schedules.forward_step_calc_loss is patched
        with pytest.raises(KeyError), gradguard.enforce(mode="raise"):
            raise KeyError("inside")
        assert schedules.forward_step_calc_loss is patched
        run = run_forward_step(schedules, loss_2tuple, n=2)  # the outer (detach) mode is back
        assert gradguard.find_graphs(run.store) == []
    assert schedules.forward_step_calc_loss is original


@pytest.mark.integration
def test_combined_1f1b_function_local_import_sees_the_patch(schedules: ModuleType) -> None:
    combined = require_engine("megatron.core.pipeline_parallel.combined_1f1b")
    tree = ast.parse(inspect.getsource(combined))
    local_imports = [
        (func.name, node)
        for func in ast.walk(tree)
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(func)
        if isinstance(node, ast.ImportFrom)
        and node.module == SCHEDULES
        and any(alias.name == "forward_step_calc_loss" for alias in node.names)
    ]
    assert local_imports, "combined_1f1b no longer imports forward_step_calc_loss inside a function"
    top_level = [n for n in tree.body if isinstance(n, ast.ImportFrom) and any(a.name == "forward_step_calc_loss" for a in n.names)]
    assert top_level == [] and "forward_step_calc_loss" not in vars(combined)

    original = schedules.forward_step_calc_loss
    with gradguard.enforce():
        from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss as inside

        assert inside is schedules.forward_step_calc_loss and inside is not original
        assert isinstance(inside, wrapt.FunctionWrapper)
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss as after

    assert after is original


# --------------------------------------------------------------------------------------------------
# 7. enforce() entered before megatron is imported (fresh interpreter)
# --------------------------------------------------------------------------------------------------

BEFORE_IMPORT = textwrap.dedent(
    """
    import gc, sys, warnings, weakref
    warnings.filterwarnings("ignore")
    import torch, wrapt
    import gradguard

    NAME = "megatron.core.pipeline_parallel.schedules"
    assert not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules), "megatron already imported"

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)
        def set_input_tensor(self, t):
            pass
        def forward(self, x):
            return self.lin(x)

    def run(schedules):
        from types import SimpleNamespace
        config = SimpleNamespace(timers=None, enable_autocast=False, autocast_dtype=torch.float32,
                                 calculate_per_token_loss=False, grad_scale_func=None,
                                 deallocate_pipeline_outputs=False)
        torch.manual_seed(0)
        model, store, acts = Tiny(), [], []
        data = iter([(torch.randn(2, 8), torch.randn(2, 4)) for _ in range(2)])
        def loss_func(y, out):
            loss = torch.nn.functional.mse_loss(out, y)
            return loss, {"lm loss": loss.detach(), "logits": out.mean(), "sq": (out ** 2).mean()}
        def fsf(it, model):
            x, y = next(it)
            out = model(x)
            acts.append(weakref.ref(out))
            return out, lambda o: loss_func(y, o)
        for i in range(2):
            out, _ = schedules.forward_step(fsf, data, model, 2, None, store, config, 1,
                                            current_microbatch=i, is_last_stage=True)
            schedules.backward_step(None, out, None, config)
            del out
        gc.collect()
        return store, sum(r() is not None for r in acts)

    with gradguard.enforce(engines=["megatron"]):
        from megatron.core.pipeline_parallel import schedules
        gc.collect(); gc.freeze()  # keep the collections in run() cheap
        patched = schedules.forward_step_calc_loss
        assert isinstance(patched, wrapt.FunctionWrapper), type(patched)
        original = patched.__wrapped__
        store, alive = run(schedules)
        assert type(store) is list and len(store) == 2, store
        assert gradguard.find_graphs(store) == [], gradguard.find_graphs(store)
        assert alive == 0, alive
    assert schedules.forward_step_calc_loss is original, "not restored"
    assert sys.modules[NAME].forward_step_calc_loss is original
    leaked, alive = run(schedules)  # control: unguarded after exit, the leak is back
    assert len(gradguard.find_graphs(leaked)) == 4 and alive == 2, (gradguard.find_graphs(leaked), alive)
    gc.unfreeze()  # let interpreter shutdown free them (else triton's nanobind reports leaks)
    print("GRADGUARD-BEFORE-IMPORT-OK")
    """
)


@pytest.mark.integration
def test_enforce_entered_before_megatron_import(schedules: ModuleType) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRADGUARD"}
    proc = subprocess.run(
        [sys.executable, "-c", BEFORE_IMPORT], capture_output=True, text=True, env=env, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GRADGUARD-BEFORE-IMPORT-OK" in proc.stdout


# --------------------------------------------------------------------------------------------------
# 8. mode "off" inside enforce: pass-through
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_off_mode_inside_enforce_passes_through(schedules: ModuleType) -> None:
    megatron_adapter.configure(loss_check="raise")  # off also skips the loss check
    with gradguard.enforce(mode="off"):
        assert isinstance(schedules.forward_step_calc_loss, wrapt.FunctionWrapper)
        run = run_forward_step(schedules, loss_2tuple_heavy, n=3)
        detached = run_forward_step(schedules, loss_detached, n=1)
    assert [p for p, _ in graph_paths(run.store)] == [
        f"[{i}]['{k}']" for i in range(3) for k in ("logits", "logits_sq")
    ]
    assert run.alive() == 3
    assert len(detached.store) == 1
    assert gradguard.stats() == {}
