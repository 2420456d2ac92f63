"""A gradient penalty (double backward, ``create_graph=True``) as a script.

The input gradient is taken with ``create_graph=True`` and penalised in the loss; the loss's
backward runs through the gradient's graph. Everything is a module global replaced every step.
"""

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(4, 16), nn.Softplus(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for _ in range(3):
    x = torch.randn(8, 4).requires_grad_()
    y = torch.randn(8, 1)
    out = model(x)
    (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = (grad_x.norm(dim=1) - 1).pow(2).mean()
    loss = nn.functional.mse_loss(out, y) + 0.1 * penalty
    opt.zero_grad()
    loss.backward()
    opt.step()

RESULT = {name: p.detach().clone() for name, p in model.named_parameters()}
