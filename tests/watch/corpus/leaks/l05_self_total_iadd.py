"""A trainer object's running sum: ``self.total += loss`` (a float at first, then a tensor added to
in place). Each step's in-place add keeps the previous sum's node in its graph."""

import torch
from torch import nn

EXPECT_HOLDER = "total"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)


class Trainer:
    def __init__(self) -> None:
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.total: torch.Tensor | float = 0.0

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.total += loss  # the leak: should be loss.item()

    def fit(self, steps: int) -> None:
        for _ in range(steps):
            self.step(torch.randn(8, 8), torch.randn(8, 1))


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    trainer = Trainer()
    trainer.fit(4)
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


RESULT = main()
