"""A WGAN: five critic steps per generator step, the generator's output kept as object state.

``self.fake`` is made once per generator step and lives across the five critic steps (the critic
trains on its detached copy); then the generator's loss backwards through it. It reaches only the
generator's parameters, which the critic's optimizer never touches: the critic's steps do not age it,
and at the generator's own step it was made since that optimizer's previous step.
"""

import torch
from torch import nn

torch.set_num_threads(1)

CRITIC_STEPS = 5
CLIP = 0.1


class WGAN:
    def __init__(self) -> None:
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.D = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
        self.opt_g = torch.optim.RMSprop(self.G.parameters(), lr=5e-3)
        self.opt_d = torch.optim.RMSprop(self.D.parameters(), lr=5e-3)
        self.fake: torch.Tensor | None = None

    def generator_step(self, z: torch.Tensor, reals: list[torch.Tensor]) -> float:
        self.fake = self.G(z)  # kept as state across the critic's steps
        for real in reals:
            critic_loss = self.D(self.fake.detach()).mean() - self.D(real).mean()
            self.opt_d.zero_grad()
            critic_loss.backward()
            self.opt_d.step()
            with torch.no_grad():
                for p in self.D.parameters():
                    p.clamp_(-CLIP, CLIP)
        gen_loss = -self.D(self.fake).mean()
        self.opt_g.zero_grad()
        gen_loss.backward()
        self.opt_g.step()
        return gen_loss.item()


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    gan = WGAN()
    for _ in range(2):
        reals = [torch.randn(8, 2) * 0.5 + 1.0 for _ in range(CRITIC_STEPS)]
        gan.generator_step(torch.randn(8, 4), reals)
    result = {f"G.{n}": p.detach().clone() for n, p in gan.G.named_parameters()}
    result.update({f"D.{n}": p.detach().clone() for n, p in gan.D.named_parameters()})
    return result


RESULT = main()
