"""``loss = train_step(batch)`` at module level: ``train_step`` runs backward and the optimizer step
and returns the loss, which the script's global ``loss`` keeps while the next step runs."""

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)


def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


LOSSES = []
for _ in range(4):
    loss = train_step(torch.randn(8, 8), torch.randn(8, 1))
    LOSSES.append(loss.item())

RESULT = {name: p.detach().clone() for name, p in model.named_parameters()}
RESULT["losses"] = torch.tensor(LOSSES)
