"""A class attribute shared by all instances keeps the losses: ``Tracker.history`` (a list made in
the class body) appended through an instance."""

import torch
from torch import nn

EXPECT_HOLDER = "Tracker.history[*]"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)


class Tracker:
    history: list[torch.Tensor] = []  # one list for the class: every instance appends to it

    def record(self, loss: torch.Tensor) -> None:
        self.history.append(loss)


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        Tracker().record(loss)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
