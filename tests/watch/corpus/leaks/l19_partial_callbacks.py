"""Deferred logging: each step queues ``functools.partial(report, step, loss)`` to run at the end of
the epoch. The loss sits in the partial's argument tuple: not a place gradguard may write, so the
dead graphs are reported, not repaired."""

import functools

import torch
from torch import nn

EXPECT_HOLDER = "PENDING[*]"
EXPECT_OUTCOME_DETACH = "not repairable"

torch.set_num_threads(1)

PENDING: list[functools.partial[None]] = []
REPORTED: list[str] = []


def report(step: int, loss: torch.Tensor) -> None:
    REPORTED.append(f"step {step}: {loss.item():.4f}")


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        PENDING.append(functools.partial(report, step, loss))
    for callback in PENDING:
        callback()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
