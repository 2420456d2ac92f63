"""A metrics coroutine (a generator fed with ``send``) keeps every loss in its local list ``seen``
while it is suspended between steps. The list is user state: repaired in ``detach``."""

from collections.abc import Generator

import torch
from torch import nn

EXPECT_HOLDER = "seen[*]"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)


def running_mean() -> Generator[float, torch.Tensor, None]:
    seen: list[torch.Tensor] = []
    mean = 0.0
    while True:
        loss = yield mean
        seen.append(loss)  # the leak: should be loss.item()
        mean = sum(t.item() for t in seen) / len(seen)


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    meter = running_mean()
    next(meter)
    for _ in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        meter.send(loss)
    meter.close()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
