"""LBFGS with a closure, as a script: ``loss = opt.step(closure)`` at module level.

LBFGS calls the closure several times inside one ``step()`` and returns the first closure's loss
(backwarded, carrying its graph). The module global ``loss`` keeps it while the next step runs:
the ``loss = train_step(batch)`` shape, one boundary and replaced.
"""

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)
x, y = torch.randn(16, 8), torch.randn(16, 1)


def closure() -> torch.Tensor:
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


for _ in range(3):
    loss = opt.step(closure)

RESULT = {name: p.detach().clone() for name, p in model.named_parameters()}
