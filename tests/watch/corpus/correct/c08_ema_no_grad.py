"""An exponential moving average of the weights, updated under ``no_grad`` after every step.

The EMA copy's tensors never carry a graph; the EMA model's forward for evaluation also runs
under ``no_grad``.
"""

import copy

import torch
from torch import nn

torch.set_num_threads(1)

DECAY = 0.9


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 1))
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    evals = []
    for _ in range(3):
        x, y = torch.randn(8, 8), torch.randn(8, 1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.mul_(DECAY).add_(p, alpha=1 - DECAY)
            evals.append(nn.functional.mse_loss(ema(x), y))
    result = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    result.update({f"ema.{n}": p.detach().clone() for n, p in ema.named_parameters()})
    result["evals"] = torch.stack(evals)
    return result


RESULT = main()
