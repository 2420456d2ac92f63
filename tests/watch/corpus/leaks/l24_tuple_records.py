"""Step records as tuples in a list: ``self.records.append((step, loss, lr))``. A tuple cannot be
written, but the list item holding it can: the record is replaced by its detached copy."""

import torch
from torch import nn

EXPECT_HOLDER = "records[*]"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)


class Run:
    def __init__(self) -> None:
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.records: list[tuple[int, torch.Tensor, float]] = []

    def fit(self, steps: int) -> None:
        for step in range(steps):
            loss = nn.functional.mse_loss(self.model(torch.randn(8, 8)), torch.randn(8, 1))
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.records.append((step, loss, self.opt.param_groups[0]["lr"]))


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    run = Run()
    run.fit(4)
    return {name: p.detach().clone() for name, p in run.model.named_parameters()}


RESULT = main()
