"""A script builds a record and appends it: ``rec = {...}; HISTORY.append(rec)`` at top level.

At each boundary the newest record is also the global ``rec``, a transient alias; the container
that accumulates, and that the user must fix, is ``HISTORY``.
"""

import torch
from torch import nn

EXPECT_HOLDER = "HISTORY[*]"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
HISTORY = []
for step in range(4):
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    rec = {"step": step, "loss": loss}
    HISTORY.append(rec)

RESULT = {name: p.detach().clone() for name, p in model.named_parameters()}
