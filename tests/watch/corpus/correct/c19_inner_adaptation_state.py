"""Inner adaptation: an outer forward kept as object state while an auxiliary optimizer takes three
steps on its detached copy, then the outer loss backwards through it.

``self.feats`` outlives three step boundaries of the auxiliary optimizer, whose parameters it never
reaches; at the outer optimizer's step it was made since that optimizer's previous step.
"""

import torch
from torch import nn

torch.set_num_threads(1)


class Learner:
    def __init__(self) -> None:
        self.encoder = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.aux = nn.Linear(8, 1)
        self.opt = torch.optim.SGD([*self.encoder.parameters(), *self.head.parameters()], lr=0.1)
        self.aux_opt = torch.optim.SGD(self.aux.parameters(), lr=0.1)
        self.feats: torch.Tensor | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.feats = self.encoder(x).tanh()  # the outer forward, kept as state
        for _ in range(3):
            aux_loss = (self.aux(self.feats.detach()) - y).pow(2).mean()
            self.aux_opt.zero_grad()
            aux_loss.backward()
            self.aux_opt.step()
        loss = (self.head(self.feats) - y).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    learner = Learner()
    for _ in range(2):
        learner.step(torch.randn(4, 8), torch.randn(4, 1))
    return {
        f"{part}.{n}": p.detach().clone()
        for part in ("encoder", "head", "aux")
        for n, p in getattr(learner, part).named_parameters()
    }


RESULT = main()
