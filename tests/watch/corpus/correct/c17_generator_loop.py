"""The training loop is a generator: it yields each step's loss (after ``optimizer.step()``) to a
consumer that logs it.

The consumer's loop variable keeps the previous step's loss while the generator runs the next step:
the ``loss = train_step(batch)`` shape, one boundary and replaced.
"""

from collections.abc import Iterator

import torch
from torch import nn

torch.set_num_threads(1)


def training(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> Iterator[torch.Tensor]:
    for _ in range(steps):
        x, y = torch.randn(8, 8), torch.randn(8, 1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield loss


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    logged = []
    for loss in training(model, opt, steps=4):
        logged.append(loss.item())
    result = {name: p.detach().clone() for name, p in model.named_parameters()}
    result["logged"] = torch.tensor(logged)
    return result


RESULT = main()
