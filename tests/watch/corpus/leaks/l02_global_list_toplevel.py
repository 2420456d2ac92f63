"""A script keeps every step's loss in a module-level list: ``LOSSES.append(loss)`` at top level.

``LOSSES`` is a ``__main__`` global reached through items, so it gets one boundary of grace (found
once a loss has survived two); it is user state, repaired in ``detach``.
"""

import torch
from torch import nn

EXPECT_HOLDER = "LOSSES[*]"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
LOSSES = []
for _ in range(4):
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    LOSSES.append(loss)

RESULT = {name: p.detach().clone() for name, p in model.named_parameters()}
