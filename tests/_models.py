"""Small models shared by the tests."""

from __future__ import annotations

import torch
from torch import nn


class ActorCritic(nn.Module):
    """A policy head and a value head over a shared trunk; ``named_parameters`` gives ``policy.weight``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 4)
        self.policy = nn.Linear(4, 3)
        self.value = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, *, detach_policy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        logits = self.policy(h)
        if detach_policy:
            logits = logits.detach()  # the bug: detached *before* the loss function
        return logits, self.value(h)
