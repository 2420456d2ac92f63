"""An evaluation forward after every training step without ``torch.no_grad()``, its outputs kept.

No backward ever runs through those graphs: each keeps its saved activations (the evaluation input
and the hidden ReLU output, ``BATCH * (IN + HIDDEN)`` float32). The next ``optimizer.step()``
updates the weights they saved in place, so no backward could succeed: dead, repaired in ``detach``
(the kept outputs themselves, ``BATCH`` floats, stay).
"""

import torch
from torch import nn

BATCH, IN, HIDDEN = 16, 32, 64

EXPECT_HOLDER = "EVAL_OUTPUTS[*]"
EXPECT_OUTCOME_DETACH = "repaired"
PINNED_PER_STEP = BATCH * (IN + HIDDEN) * 4

torch.set_num_threads(1)

EVAL_OUTPUTS: list[torch.Tensor] = []


def evaluate(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)  # the leak: no torch.no_grad()


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(6):
        loss = nn.functional.mse_loss(model(torch.randn(BATCH, IN)), torch.randn(BATCH, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        EVAL_OUTPUTS.append(evaluate(model, torch.randn(BATCH, IN)))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
