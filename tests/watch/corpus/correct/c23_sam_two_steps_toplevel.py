"""Two steps of the same optimizer per batch (an ascent-then-descent, sharpness-aware shape), as a
script: ``loss1`` is still a module global at the second step and ``loss2`` at the next batch's first."""

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for _ in range(3):
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    loss1 = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss1.backward()
    opt.step()
    loss2 = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss2.backward()
    opt.step()

RESULT = {name: p.detach().clone() for name, p in model.named_parameters()}
