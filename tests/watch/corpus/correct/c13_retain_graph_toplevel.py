"""Two losses over one shared trunk, the first backwarded with ``retain_graph=True``, as a script.

The second backward frees what the first kept; both losses are module globals replaced every step.
"""

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)

trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
head_a, head_b = nn.Linear(16, 1), nn.Linear(16, 3)
params = [*trunk.parameters(), *head_a.parameters(), *head_b.parameters()]
opt = torch.optim.SGD(params, lr=0.05)
for _ in range(3):
    x, y, label = torch.randn(8, 8), torch.randn(8, 1), torch.randint(0, 3, (8,))
    feats = trunk(x)
    loss_a = nn.functional.mse_loss(head_a(feats), y)
    loss_b = nn.functional.cross_entropy(head_b(feats), label)
    opt.zero_grad()
    loss_a.backward(retain_graph=True)
    loss_b.backward()
    opt.step()

RESULT = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
