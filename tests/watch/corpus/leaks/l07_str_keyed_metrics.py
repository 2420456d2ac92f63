"""A per-step metrics dict with string keys: ``METRICS[f"loss/step_{step}"] = loss``.

One container keeps them all: the report has one entry for ``METRICS`` (one row, one warning), not
one per key.
"""

import torch
from torch import nn

EXPECT_HOLDER = "METRICS["
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)

METRICS: dict[str, torch.Tensor] = {}


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        METRICS[f"loss/step_{step}"] = loss
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
