"""A frozen dataclass record holding the loss, used as a dict key: its hash is computed from its
fields (the tensor's identity among them), so replacing the tensor would corrupt the dict. Dead,
but not a place gradguard may write: not repairable, reported."""

import dataclasses

import torch
from torch import nn

EXPECT_HOLDER = "SEEN"
EXPECT_OUTCOME_DETACH = "not repairable"

torch.set_num_threads(1)


@dataclasses.dataclass(frozen=True)
class StepRecord:
    step: int
    loss: torch.Tensor


SEEN: dict[StepRecord, float] = {}


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        SEEN[StepRecord(step, loss)] = loss.item()
    assert all(SEEN[key] == value for key, value in list(SEEN.items()))  # every key still hashes to itself
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
