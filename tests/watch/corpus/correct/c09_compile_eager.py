"""``torch.compile`` with the ``eager`` backend (dynamo only): the compiled model trains as usual.

Dynamo's FX graphs keep FakeTensors (and example values) in their nodes' metadata; they are
torch.compile's own, never a user's holder.
"""

import torch
from torch import nn

torch.set_num_threads(1)


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        x, y = torch.randn(8, 8), torch.randn(8, 1)
        loss = nn.functional.mse_loss(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
