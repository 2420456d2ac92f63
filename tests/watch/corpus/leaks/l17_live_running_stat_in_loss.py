"""A kept graph that feeds later losses (live): a running statistic of the weights,
``self.running = torch.lerp(self.running, self.w.sum(), 0.1)``, kept with its graph and added to
every loss.

Neither ``lerp`` (with a number weight) nor ``sum`` saves a tensor, so every later backward runs
through all earlier steps' nodes and succeeds: the chain is live, it changes the gradients, and
detaching it would change the training. It is reported (``live``) and never repaired: the weights
equal the unwatched run bitwise in every mode.
"""

import torch
from torch import nn

EXPECT_HOLDER = ".running"
EXPECT_OUTCOME_DETACH = "live"
ALSO_REPORTED = ("loss",)  # the step's own loss reaches the same live chain

torch.set_num_threads(1)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 0.5))
        self.running = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.running = torch.lerp(self.running, self.w.sum(), 0.1)  # the leak: kept with its graph
        return (x * self.w).sum().pow(2) + self.running


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        loss = model(torch.randn(4))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
