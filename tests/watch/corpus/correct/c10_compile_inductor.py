"""``torch.compile`` with its default backend (inductor, C++ on the CPU), the forward and the
backward compiled.

Inductor compiles C++ on every run (several seconds each; the first of a process about ten): the
program runs with the integration programs (``REQUIRES``).
"""

import torch
from torch import nn

REQUIRES = ("torch._inductor",)

torch.set_num_threads(1)


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        x, y = torch.randn(8, 8), torch.randn(8, 1)
        loss = (compiled(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
