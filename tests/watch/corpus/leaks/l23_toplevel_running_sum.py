"""A script's module-level running sum: ``running = running + loss`` at top level.

A ``__main__`` global gets one boundary of grace, then it is found; the program's own module
globals are user state: repaired in ``detach``.
"""

import torch
from torch import nn

EXPECT_HOLDER = "running"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
running = 0.0
for _ in range(4):
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    running = running + loss

RESULT = {name: p.detach().clone() for name, p in model.named_parameters()}
