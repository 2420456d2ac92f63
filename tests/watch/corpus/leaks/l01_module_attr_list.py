"""An ``nn.Module`` keeps every step's loss in its own list: ``self.losses.append(loss)``.

Each loss was backwarded (its saved tensors freed): the graphs are dead and the module's list is
user state, so ``detach`` repairs it.
"""

import torch
from torch import nn

EXPECT_HOLDER = "losses[*]"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.losses: list[torch.Tensor] = []

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.body(x), y)
        self.losses.append(loss)  # the leak: should be loss.detach() or loss.item()
        return loss


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(4):
        loss = model.loss(torch.randn(8, 8), torch.randn(8, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
