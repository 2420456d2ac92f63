"""Activation checkpointing, non-reentrant (``use_reentrant=False``, saved-tensor hooks), as a
script: the checkpointed activations are recomputed at backward and the recompute's frames end
with it."""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

torch.set_num_threads(1)
torch.manual_seed(0)

inp = nn.Linear(8, 16)
blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2)])
head = nn.Linear(16, 1)
params = [*inp.parameters(), *blocks.parameters(), *head.parameters()]
opt = torch.optim.Adam(params, lr=1e-2)
for _ in range(3):
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    h = inp(x)
    for block in blocks:
        h = checkpoint(block, h, use_reentrant=False)
    loss = nn.functional.mse_loss(head(h), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

RESULT = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
