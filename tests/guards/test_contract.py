"""``gradguard.check_loss``: the loss that will be back-propagated can train what it should.

Includes the silent-zero-gradient trap: a ``.detach()`` placed before the loss function on the policy
path, while the loss still requires grad through a value head. ``requires_grad`` cannot see it; only
the ``reaches_params`` graph walk (each node visited once) does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _models import ActorCritic
from torch import nn

import gradguard
from gradguard import GradGuardError, LossContractError
from gradguard._graph import reach as _graph
from gradguard._guards import contract as _contract


def ppo_like_loss(logits: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Policy term plus value term: requires grad as long as either path is live."""
    return -torch.log_softmax(logits, -1)[:, 0].mean() + (value.squeeze(-1) - 1.0).pow(2).mean()


@pytest.fixture
def model() -> ActorCritic:
    return ActorCritic()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(5, 4)


# --------------------------------------------------------------------------------------------------
# requires_grad
# --------------------------------------------------------------------------------------------------


def test_returns_the_same_object(model: ActorCritic, x: torch.Tensor) -> None:
    loss = ppo_like_loss(*model(x))
    assert gradguard.check_loss(loss) is loss
    assert gradguard.check_loss(loss, params=model) is loss
    assert loss.grad_fn is not None  # untouched: still live


def test_error_types() -> None:
    assert issubclass(LossContractError, GradGuardError)
    assert issubclass(LossContractError, RuntimeError)


def test_detached_loss_with_grad_enabled_raises_and_explains(model: ActorCritic, x: torch.Tensor) -> None:
    loss = ppo_like_loss(*model(x)).detach()
    with pytest.raises(LossContractError) as info:
        gradguard.check_loss(loss)
    msg = str(info.value).replace("*", "")
    assert "scaled_loss" in msg  # the default name
    assert "does not require grad" in msg
    assert "detach" in msg and "after the loss" in msg  # the trap and its fix


def test_name_appears_in_message() -> None:
    with pytest.raises(LossContractError, match="my_loss"):
        gradguard.check_loss(torch.tensor(1.0), name="my_loss")


def test_no_grad_is_not_checked(model: ActorCritic, x: torch.Tensor) -> None:
    with torch.no_grad():
        loss = ppo_like_loss(*model(x))
        assert not loss.requires_grad
        assert gradguard.check_loss(loss) is loss
        assert gradguard.check_loss(loss, params=model) is loss
    with torch.inference_mode():
        loss = ppo_like_loss(*model(x))
        assert gradguard.check_loss(loss, params=model) is loss


@pytest.mark.parametrize("value", [1.5, 3, None, "loss", {"loss": 1.0}, [torch.tensor(1.0)]])
def test_non_tensor_loss_passes(value: Any, model: ActorCritic) -> None:
    assert gradguard.check_loss(value) is value
    assert gradguard.check_loss(value, params=model) is value


# --------------------------------------------------------------------------------------------------
# params forms
# --------------------------------------------------------------------------------------------------


def test_params_as_module_iterable_and_pairs_all_pass_on_a_healthy_loss(model: ActorCritic, x: torch.Tensor) -> None:
    loss = ppo_like_loss(*model(x))
    for params in (
        model,
        model.parameters(),  # a generator
        list(model.parameters()),
        model.named_parameters(),  # a generator of pairs
        list(model.named_parameters()),
        model.policy.weight,  # a single tensor
    ):
        assert gradguard.check_loss(loss, params=params) is loss


def test_params_forms_name_the_missing_parameter(model: ActorCritic, x: torch.Tensor) -> None:
    loss = ppo_like_loss(*model(x, detach_policy=True))
    assert loss.requires_grad
    with pytest.raises(LossContractError, match=r"policy\.weight"):
        gradguard.check_loss(loss, params=model)
    with pytest.raises(LossContractError, match=r"policy\.bias"):
        gradguard.check_loss(loss, params=list(model.named_parameters()))
    with pytest.raises(LossContractError, match=r"param\[1\]") as info:  # unnamed: positional labels
        gradguard.check_loss(loss, params=[model.trunk.weight, model.policy.weight])
    assert "param[0]" not in str(info.value)  # the trunk is reached through the value head


def test_frozen_parameters_are_not_required(model: ActorCritic, x: torch.Tensor) -> None:
    model.policy.requires_grad_(False)
    loss = ppo_like_loss(*model(x, detach_policy=True))
    assert gradguard.check_loss(loss, params=model) is loss


@pytest.mark.parametrize("bad", [5, 1.0, object()])
def test_bad_params_type_error_names_what_is_accepted(bad: Any, model: ActorCritic, x: torch.Tensor) -> None:
    loss = ppo_like_loss(*model(x))
    with pytest.raises(TypeError) as info:
        gradguard.check_loss(loss, params=bad)
    msg = str(info.value)
    assert "nn.Module" in msg and "iterable of parameters" in msg and "(name, parameter)" in msg


@pytest.mark.parametrize("bad", [["weight"], [(1, 2)], [("a", "b", "c")], "abc"])
def test_bad_params_items_type_error_names_what_is_accepted(bad: Any, model: ActorCritic, x: torch.Tensor) -> None:
    loss = ppo_like_loss(*model(x))
    with pytest.raises(TypeError, match=r"params\[0\].*accepted: a parameter tensor or a \(name, parameter\) pair"):
        gradguard.check_loss(loss, params=bad)


# --------------------------------------------------------------------------------------------------
# The silent-zero-gradient trap
# --------------------------------------------------------------------------------------------------


def test_silent_zero_gradient_trap_is_real(model: ActorCritic, x: torch.Tensor) -> None:
    """The premise: the loss trains, backward runs, and the policy gets no gradient at all."""
    loss = ppo_like_loss(*model(x, detach_policy=True))
    loss.backward()
    assert model.policy.weight.grad is None  # zero gradient, silently
    assert model.value.weight.grad is not None and model.value.weight.grad.abs().sum() > 0
    assert torch.isfinite(loss)


def test_silent_zero_gradient_trap_missed_by_requires_grad_caught_by_params(
    model: ActorCritic, x: torch.Tensor
) -> None:
    loss = ppo_like_loss(*model(x, detach_policy=True))
    assert gradguard.check_loss(loss) is loss  # requires_grad alone misses it
    with pytest.raises(LossContractError) as info:
        gradguard.check_loss(loss, params=model)
    msg = str(info.value).replace("*", "")
    assert "policy.weight" in msg and "policy.bias" in msg
    assert "value." not in msg and "trunk." not in msg  # only the unreached ones are named
    assert "zero gradient" in msg and "after the loss" in msg


def test_many_missing_parameters_are_abbreviated() -> None:
    heads = nn.ModuleList(nn.Linear(2, 2) for _ in range(8))  # 16 parameters
    live = nn.Linear(2, 1)
    x = torch.randn(3, 2)
    loss = sum(h(x).detach().sum() for h in heads) + live(x).sum()
    params = [*heads.named_parameters(), *live.named_parameters()]
    with pytest.raises(LossContractError, match=r"\(16 in all\)"):
        gradguard.check_loss(loss, params=params)


# --------------------------------------------------------------------------------------------------
# Each graph node visited once
# --------------------------------------------------------------------------------------------------


def _distinct_nodes(root: Any) -> set[Any]:
    seen: set[Any] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return seen


def spy_nodes(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every node the graph walk yields, in order."""
    yielded: list[Any] = []
    original = _graph._nodes

    def spy(roots: Any) -> Iterator[Any]:
        for node in original(roots):
            yielded.append(node)
            yield node

    monkeypatch.setattr(_graph, "_nodes", spy)
    return yielded


def test_reaches_params_walk_visits_each_node_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """x = x + x, 40 times: 2**40 paths through 41 distinct nodes; the walk must yield 41 nodes."""
    assert _contract.unreached_params is _graph.unreached_params  # _graph._nodes is the walk it uses
    leaf = nn.Parameter(torch.ones(2))
    unreached = nn.Parameter(torch.ones(2))  # never reached: forces the walk over the whole graph
    y = leaf * 1.0
    for _ in range(40):
        y = y + y
    loss = y.sum()
    expected = _distinct_nodes(loss.grad_fn)

    yielded = spy_nodes(monkeypatch)
    start = time.perf_counter()
    with pytest.raises(LossContractError, match="unreached"):
        gradguard.check_loss(loss, params=[("leaf", leaf), ("unreached", unreached)])
    elapsed = time.perf_counter() - start

    assert len(yielded) == len(expected) == 43  # SumBackward0, 40 x AddBackward0, MulBackward0, AccumulateGrad
    assert len({id(n) for n in yielded}) == len(yielded)
    assert set(yielded) == expected
    assert elapsed < 1.0  # a walk without dedup would never finish


def test_walk_stops_once_every_parameter_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    leaf = nn.Parameter(torch.ones(2))
    y = leaf * 1.0
    for _ in range(20):
        y = y + y
    loss = y.sum()
    yielded = spy_nodes(monkeypatch)
    assert gradguard.check_loss(loss, params=[("leaf", leaf)]) is loss
    assert len(yielded) <= len(_distinct_nodes(loss.grad_fn))


def test_params_without_grad_skip_the_walk(
    monkeypatch: pytest.MonkeyPatch, model: ActorCritic, x: torch.Tensor
) -> None:
    loss = ppo_like_loss(*model(x))
    model.requires_grad_(False)  # nothing trainable to reach
    calls: list[Any] = []
    monkeypatch.setattr(_graph, "_nodes", lambda roots: calls.append(roots) or iter(()))
    assert gradguard.check_loss(loss, params=model) is loss
    assert calls == []
