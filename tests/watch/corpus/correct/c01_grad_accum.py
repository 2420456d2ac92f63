"""Gradient accumulation: four micro-batches per optimizer step, in a function.

Each micro-batch's loss is backwarded at once; only the last one is still a frame local at
``optimizer.step()``, and it was made since the previous step.
"""

import torch
from torch import nn

torch.set_num_threads(1)

ACCUMULATE = 4


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        for _ in range(ACCUMULATE):
            x, y = torch.randn(4, 8), torch.randn(4, 1)
            loss = nn.functional.mse_loss(model(x), y) / ACCUMULATE
            loss.backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
