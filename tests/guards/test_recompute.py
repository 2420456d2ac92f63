"""``reaches_params`` through reentrant activation checkpointing, and checks that change nothing.

A reentrant checkpoint (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``; Megatron's
``CheckpointFunction``, see ``integration/test_recompute_megatron.py``) runs its forward under
``no_grad``: the graph reaches the checkpointed parameters only when backward recomputes. The walk
looks at what the recompute will call; where it cannot tell, it says so and never raises.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.functional import gelu
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import gradguard
from gradguard import LossContractError, LossContractWarning
from gradguard._guards.contract import LossCheck


class Model(nn.Module):
    """A policy, a checkpointed block and a value head; ``named_parameters`` gives ``block.weight``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.policy = nn.Linear(8, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)


GLOBAL_BLOCK = nn.Linear(8, 8)  # named by a module-level lambda below


def reentrant(fn: Callable[..., Any], *args: Any) -> torch.Tensor:
    return checkpoint(fn, *args, use_reentrant=True)


def run_block(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
    return m(t)


class Holder:
    """Not a module: the walk cannot know what its method reaches."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def run(self, t: torch.Tensor) -> torch.Tensor:
        return self.block(t)


def loss_through(model: Model, through: Callable[[torch.Tensor], torch.Tensor], *, trap: bool = False) -> torch.Tensor:
    x = torch.randn(4, 8, requires_grad=True)  # e.g. a pipeline receive buffer
    h = model.policy(x)
    if trap:
        h = h.detach()  # the trap, before the checkpointed part (whose input still requires grad, via x)
    return model.head(through(h + x)).pow(2).mean()


def _closure_over(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(t: torch.Tensor) -> torch.Tensor:
        return torch.relu(block(t))

    return forward


FORMS: dict[str, Callable[[Model], Callable[[torch.Tensor], torch.Tensor]]] = {
    "module": lambda m: lambda h: reentrant(m.block, h),
    "bound method": lambda m: lambda h: reentrant(m.block.forward, h),
    "partial": lambda m: lambda h: reentrant(functools.partial(run_block, m.block), h),
    "closure": lambda m: lambda h: reentrant(_closure_over(m.block), h),
    "module as a non-tensor input": lambda m: lambda h: reentrant(run_block, m.block, h),
    "default argument": lambda m: lambda h: reentrant(lambda t, blk=m.block: blk(t), h),
    "checkpoint_sequential": lambda m: (
        lambda h: checkpoint_sequential(nn.Sequential(m.block, nn.ReLU()), 2, h, use_reentrant=True)
    ),
}


def test_the_premise_reentrant_forward_does_not_reach_the_block() -> None:
    model = Model()
    loss = loss_through(model, FORMS["module"](model))
    # the graph's own leaves: no block parameter (they are reached by the recompute only)
    leaves = {id(n.variable) for n in gradguard._graph.nodes.nodes([loss.grad_fn]) if hasattr(n, "variable")}
    assert id(model.block.weight) not in leaves and id(model.policy.weight) in leaves
    loss.backward()
    assert model.block.weight.grad is not None and model.block.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("form", list(FORMS))
def test_reentrant_checkpoint_passes_a_correct_model(form: str) -> None:
    model = Model()
    loss = loss_through(model, FORMS[form](model))
    assert "CheckpointFunctionBackward" in {type(n).__name__ for n in gradguard._graph.nodes.nodes([loss.grad_fn])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot decide" either: the walk sees through
        assert gradguard.check_loss(loss, params=model) is loss


@pytest.mark.parametrize("form", list(FORMS))
def test_the_trap_before_a_reentrant_checkpoint_is_still_caught(form: str) -> None:
    model = Model()
    loss = loss_through(model, FORMS[form](model), trap=True)
    with pytest.raises(LossContractError) as info:
        gradguard.check_loss(loss, params=model)
    msg = str(info.value)
    assert "policy.weight, policy.bias." in msg
    assert "block." not in msg and "head." not in msg


def test_the_policy_detached_before_a_reentrant_checkpointed_value_head_is_caught() -> None:
    """PPO-like: policy logits (detached: the trap) and a reentrant-checkpointed value head on a trunk."""
    model = Model()  # block: the trunk; policy; head: the value head
    features = model.block(torch.randn(4, 8))
    logits = model.policy(features).detach()
    value = reentrant(model.head, features)
    loss = -torch.log_softmax(logits, -1)[:, 0].mean() + value.pow(2).mean()
    assert loss.requires_grad  # through the value head: requires_grad alone misses the trap
    gradguard.check_loss(loss)
    with pytest.raises(LossContractError, match=r"parameters: policy\.weight, policy\.bias\. They"):
        gradguard.check_loss(loss, params=model)


def test_a_reentrant_checkpoint_without_an_input_requiring_grad_trains_nothing_and_is_named() -> None:
    """torch's reentrant checkpoint builds no node when no input requires grad: its block gets no
    gradient at all, and the walk says so (the same trap one step further)."""
    model = Model()
    h = model.policy(torch.randn(4, 8)).detach()
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):  # torch's own
        loss = model.head(reentrant(model.block, h)).pow(2).mean()
    with pytest.raises(
        LossContractError, match=r"parameters: policy\.weight, policy\.bias, block\.weight, block\.bias\."
    ):
        gradguard.check_loss(loss, params=model)
    loss.backward()
    assert model.block.weight.grad is None and model.head.weight.grad is not None


def gelu_block(t: torch.Tensor) -> torch.Tensor:
    return gelu(GLOBAL_BLOCK(t))  # a global function of torch's, and a global module


@pytest.mark.parametrize("fn", [lambda t: torch.tanh(GLOBAL_BLOCK(t)), gelu_block], ids=["lambda", "function"])
def test_a_module_level_function_naming_a_global_module(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    x = torch.randn(2, 8, requires_grad=True)
    loss = reentrant(fn, x).sum()
    other = nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradguard.check_loss(loss, params=GLOBAL_BLOCK)
    with pytest.raises(LossContractError, match=r"parameters: other\.weight, other\.bias\. They"):
        gradguard.check_loss(loss, params=[*GLOBAL_BLOCK.named_parameters(), *other.named_parameters("other")])


def test_a_parameter_captured_by_a_closure_counts_as_reached() -> None:
    w = nn.Parameter(torch.randn(8, 8))
    unused = nn.Parameter(torch.randn(8))
    x = torch.randn(2, 8, requires_grad=True)
    loss = reentrant(lambda t: t @ w, x).sum()
    gradguard.check_loss(loss, params=[("w", w)])
    with pytest.raises(LossContractError, match=r"parameters: unused\."):
        gradguard.check_loss(loss, params=[("w", w), ("unused", unused)])


def test_a_function_it_cannot_look_into_cannot_decide_and_says_so() -> None:
    model = Model()
    holder = Holder(model.block)  # the block is reached through an object that is not a module
    loss = loss_through(model, lambda h: reentrant(holder.run, h))
    with pytest.warns(LossContractWarning) as record:
        assert gradguard.check_loss(loss, params=model) is loss  # passes: never a false error
    (w,) = record
    msg = str(w.message)
    assert msg.startswith("scaled_loss: gradguard cannot decide whether its graph reaches these trainable parameters")
    assert "block.weight, block.bias" in msg and "policy." not in msg
    assert "CheckpointFunctionBackward of Holder.run" in msg
    assert w.filename == __file__  # attributed to the caller

    # a trap elsewhere cannot be told from what the opaque recompute may reach: a warning too
    trap = loss_through(model, lambda h: reentrant(holder.run, h), trap=True)
    with pytest.warns(LossContractWarning, match=r"policy\.weight, policy\.bias, block\.weight, block\.bias"):
        gradguard.check_loss(trap, params=model)


def test_loss_check_says_cannot_decide_once_whatever_on_violation() -> None:
    model = Model()
    holder = Holder(model.block)
    check = LossCheck("reaches_params", model, on_violation="raise")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            check(loss_through(model, lambda h: reentrant(holder.run, h)))
    assert [w.category for w in record] == [LossContractWarning]
    with pytest.raises(LossContractError, match="does not require grad"):
        check(loss_through(model, lambda h: reentrant(holder.run, h)).detach())  # still checked


def test_non_reentrant_checkpoint_needs_no_seeing_through() -> None:
    model = Model()
    loss = loss_through(model, lambda h: checkpoint(model.block, h, use_reentrant=False))
    gradguard.check_loss(loss, params=model)
    with pytest.raises(LossContractError, match=r"policy\.weight"):
        gradguard.check_loss(
            loss_through(model, lambda h: checkpoint(model.block, h, use_reentrant=False), trap=True), params=model
        )


# --------------------------------------------------------------------------------------------------
# The checks change nothing: no backward, no recompute, no unpacked saved tensor, same gradients
# --------------------------------------------------------------------------------------------------


def _train_step(inspect: bool) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """One step through every kind of graph the walks meet; ``inspect`` runs every check on it."""
    model = Model()
    calls = {"recompute": 0, "unpack": 0}

    def counted_block(t: torch.Tensor) -> torch.Tensor:
        calls["recompute"] += 1
        return model.block(t)

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        calls["unpack"] += 1
        return t

    torch.manual_seed(1)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        h = model.policy(x).tanh()
    h = reentrant(counted_block, h) + checkpoint(counted_block, h, use_reentrant=False)
    loss = model.head(h).pow(2).mean()
    forward_calls = dict(calls)
    if inspect:
        gradguard.check_loss(loss, params=model)
        LossCheck("reaches_params", model)(loss)
        assert gradguard.pinned_bytes({"h": h, "loss": loss}) > 0
        gradguard.find_graphs({"h": h})
        assert calls == forward_calls, "a check recomputed or unpacked something"
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return {**grads, "x": x.grad}, forward_calls


def test_gradients_are_bitwise_identical_with_and_without_the_checks() -> None:
    plain, plain_calls = _train_step(inspect=False)
    checked, checked_calls = _train_step(inspect=True)
    assert plain_calls == checked_calls == {"recompute": 2, "unpack": 0}
    assert plain.keys() == checked.keys() and len(plain) == 7  # 6 parameters and the input
    for name in plain:
        assert torch.equal(plain[name], checked[name]), name
