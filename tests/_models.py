"""Small models shared by the tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ActorCritic(nn.Module):
    """A policy head and a value head over a shared trunk; ``named_parameters`` gives ``policy.weight``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 4)
        self.policy = nn.Linear(4, 3)
        self.value = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, *, detach_policy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        logits = self.policy(h)
        if detach_policy:
            logits = logits.detach()  # the bug: detached *before* the loss function
        return logits, self.value(h)


MODEL = ActorCritic()


def outputs(detach_policy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities and values of ``MODEL`` on a random batch (the policy detached on request)."""
    h = MODEL.trunk(torch.randn(2, 4))
    logits = MODEL.policy(h)
    if detach_policy:
        logits = logits.detach()
    return torch.log_softmax(logits, -1), MODEL.value(h)


def verl_result(*, detach_loss: bool = False, detach_policy: bool = False) -> tuple[torch.Tensor, dict[str, Any]]:
    """A verl engine's ``(loss, output)`` from ``MODEL``: graphs in ``model_output``, a float loss, metrics."""
    log_probs, value = outputs(detach_policy)
    loss = -log_probs[:, 0].mean() + value.pow(2).mean()
    if detach_loss:
        loss = loss.detach()
    output = {
        "model_output": {"log_probs": log_probs, "entropy": log_probs.exp().sum(-1)},
        "loss": float(loss.detach()),
        "metrics": {"kl": torch.tensor(0.1), "n": 3},
    }
    return loss, output


def assert_published(output: dict[str, Any], original: dict[str, Any]) -> None:
    """``output`` is ``original`` published: detached in place of its graphs, the rest shared."""
    mo, orig_mo = output["model_output"], original["model_output"]
    for key in ("log_probs", "entropy"):
        assert orig_mo[key].grad_fn is not None  # the caller's object is never mutated
        assert mo[key].grad_fn is None and not mo[key].requires_grad
        assert mo[key].data_ptr() == orig_mo[key].data_ptr()  # detached, not copied
    assert output["metrics"] is original["metrics"]  # unchanged branches are shared
    assert output["loss"] == original["loss"]


def megatron_forward_step(*, detach_loss: bool = False, with_num_tokens: bool = False) -> Any:
    """A Megatron ``forward_step_func`` over ``MODEL``: ``(output_tensor, loss_func)``."""

    def forward_step(data_iterator: Any, model: Any) -> Any:
        output_tensor, value = outputs()

        def loss_func(output: torch.Tensor, non_loss_data: bool = False) -> Any:
            if non_loss_data:
                return {"log_probs": output, "value": value}
            loss = -output[:, 0].sum() + value.pow(2).sum()
            if detach_loss:
                loss = loss.detach()
            report = {"lm loss": torch.stack([loss.clone(), torch.tensor(2.0)]), "entropy": output.exp().sum()}
            if with_num_tokens:
                return loss, torch.tensor(2, dtype=torch.int), report
            return loss, report

        return output_tensor, loss_func

    return forward_step
