"""A gradient that keeps a graph: ``backward(create_graph=True)`` without clearing the gradients chains every
step's graph onto ``p.grad``, which torch holds for its tensor (no Python object refers to it)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import gradguard


def elsewhere(entry: gradguard.Retention) -> bool:
    """Graphs other tests of this process left behind: not this file's business (a gradient is named through
    whatever holds its tensor: the optimizer stepping, or the model)."""
    return ".grad" not in entry.path and "test_grad_holder" not in entry.path


def _train(steps: int, clear: bool, scope: object = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*create_graph=True.*")
        with scope if scope is not None else warnings.catch_warnings():
            for _ in range(steps):
                loss = model(x).pow(2).mean()
                loss.backward(create_graph=True)
                opt.step()
                if clear:
                    opt.zero_grad()
    return model


def test_gradients_chaining_every_steps_graph_are_named_with_their_fix() -> None:
    with pytest.raises(gradguard.GraphRetentionError) as raised:
        _train(6, clear=False, scope=gradguard.watch(every=1, mode="raise", ignore=elsewhere))
    text = str(raised.value)
    assert "['params'][*].grad:" in text or "weight.grad:" in text, text
    assert "optimizer.zero_grad()" in text and "torch.autograd.grad(" in text


def test_gradients_cleared_every_step_are_silent_and_train_bitwise_as_unwatched() -> None:
    plain = _train(20, clear=True)
    scope = gradguard.watch(every=1, ignore=elsewhere)  # detach, and every boundary audited
    watched = _train(20, clear=True, scope=scope)
    assert scope.watcher.history() == []
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), watched.state_dict().values()))


def test_the_audit_names_a_gradient_that_keeps_a_graph() -> None:
    p = nn.Parameter(torch.randn(4))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*create_graph=True.*")
        (p * p).sum().backward(create_graph=True)
    assert p.grad is not None and p.grad.grad_fn is not None
    found = [e for e in gradguard.audit() if e.path.endswith(" p.grad") or e.path.endswith(":p.grad")]
    assert found and "optimizer.zero_grad()" in found[0].fix, [e.path for e in gradguard.audit()]
