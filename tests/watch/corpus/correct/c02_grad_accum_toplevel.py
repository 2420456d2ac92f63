"""Gradient accumulation written as a script: every variable is a ``__main__`` global.

``loss`` (a module global) holds the last micro-batch's backwarded loss across the optimizer step
and is replaced by the next micro-batch's.
"""

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)

ACCUMULATE = 3
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(3):
    for _ in range(ACCUMULATE):
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        out = model(x)
        loss = nn.functional.mse_loss(out, y) / ACCUMULATE
        loss.backward()
    opt.step()
    opt.zero_grad()

RESULT = {name: p.detach().clone() for name, p in model.named_parameters()}
