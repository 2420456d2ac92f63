"""A running sum in a closure cell: ``nonlocal total; total = total + loss``.

Every step's sum contains the previous one's node: the chain of dead graphs grows. A closure cell is
not a place gradguard may write: not repairable, reported.
"""

from collections.abc import Callable

import torch
from torch import nn

EXPECT_HOLDER = "total"
EXPECT_OUTCOME_DETACH = "not repairable"

torch.set_num_threads(1)


def make_meter() -> Callable[[torch.Tensor], torch.Tensor]:
    total: torch.Tensor | float = 0.0

    def add(loss: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total = total + loss  # the leak: should be loss.detach()
        return total

    return add


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    meter = make_meter()
    for _ in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        meter(loss)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
