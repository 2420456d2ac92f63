"""Tied weights through a cached view of a parameter: ``self.dec_w = self.emb.weight.t()`` is made
once at construction and used by every forward (its ``grad_fn`` lives as long as the model).

The embedding is frozen for a three-step warm-up (its optimizer starts stepping at step 3), so the
decoder path's gradient into ``emb.weight`` matters once it trains. A view of a parameter is the
model, not a leak.
"""

import torch
from torch import nn

torch.set_num_threads(1)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)
        self.dec_w = self.emb.weight.t()  # a view of the parameter: shares its storage and its updates

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(ids)) @ self.dec_w


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.SGD(model.proj.parameters(), lr=0.5)
    opt_emb = torch.optim.SGD(model.emb.parameters(), lr=0.5)
    for step in range(5):
        ids = torch.randint(0, 16, (6,))
        loss = nn.functional.cross_entropy(model(ids), ids)
        opt.zero_grad()
        opt_emb.zero_grad()
        loss.backward()
        opt.step()
        if step >= 3:
            opt_emb.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
