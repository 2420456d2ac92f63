"""The right way to keep metrics, as a script: ``HISTORY`` keeps ``loss.detach()`` and floats;
BatchNorm's running statistics and a learning-rate scheduler change state every step without a
graph."""

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
HISTORY = []
for step in range(3):
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    out = model(x)
    loss = nn.functional.mse_loss(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    HISTORY.append({"step": step, "loss": loss.detach(), "lr": sched.get_last_lr()[0], "mean_out": out.mean().item()})

RESULT = {name: t.detach().clone() for name, t in model.state_dict().items()}
RESULT["history"] = torch.stack([rec["loss"] for rec in HISTORY])
