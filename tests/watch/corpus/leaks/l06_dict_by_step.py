"""A dict keyed by the step number keeps each step's loss: ``self.by_step[step] = loss``."""

import torch
from torch import nn

EXPECT_HOLDER = "by_step["
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)


class Logger:
    def __init__(self) -> None:
        self.by_step: dict[int, torch.Tensor] = {}

    def log(self, step: int, loss: torch.Tensor) -> None:
        self.by_step[step] = loss


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    logger = Logger()
    for step in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        logger.log(step, loss)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
