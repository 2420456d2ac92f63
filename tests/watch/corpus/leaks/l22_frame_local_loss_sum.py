"""A long training function keeps a local running sum for its end-of-run report:
``loss_sum = loss_sum + loss``. A frame's variable gets one boundary of grace, then it is found; a
frame local is not a place gradguard may write: not repairable, reported."""

import torch
from torch import nn

EXPECT_HOLDER = "loss_sum"
EXPECT_OUTCOME_DETACH = "not repairable"

torch.set_num_threads(1)


def train() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_sum = torch.zeros(())
    for _ in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_sum = loss_sum + loss  # the leak: loss.detach()
    print_mean = loss_sum.item() / 4
    assert print_mean > 0
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = train()
