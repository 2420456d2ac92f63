"""A bounded deque of recent losses (``maxlen=32``) for a smoothed log line: it keeps up to 32 steps of
graphs, never more, so it is bounded by construction: listed with what it pins, never raised or repaired."""

import collections

import torch
from torch import nn

torch.set_num_threads(1)

RECENT: collections.deque[torch.Tensor] = collections.deque(maxlen=32)


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(4):
        loss = nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        RECENT.append(loss)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
