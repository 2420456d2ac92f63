"""A loss-spike detector records an exception per step to raise or log later:
``ANOMALIES.append(FloatingPointError("loss spike", loss))``. The loss is in the exception's ``args``
tuple: reported, not repairable."""

import torch
from torch import nn

EXPECT_HOLDER = "ANOMALIES[*]"
EXPECT_OUTCOME_DETACH = "not repairable"

torch.set_num_threads(1)

ANOMALIES: list[Exception] = []


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() > 0.0:  # every step, so that the shape is deterministic
            ANOMALIES.append(FloatingPointError(f"loss spike at step {step}", loss))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
