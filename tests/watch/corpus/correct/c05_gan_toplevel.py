"""A GAN as a script: two optimizers, the discriminator's step then the generator's.

``fake`` (a module global) is the generator's output of this iteration: its detached copy trains
the discriminator, then it feeds the generator's loss. ``d_loss`` is still a global at the
generator's step and ``g_loss`` at the next discriminator step; each is replaced every iteration.
"""

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)

G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3, betas=(0.5, 0.999))
bce = nn.BCEWithLogitsLoss()
ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
for _ in range(3):
    real = torch.randn(8, 2) * 0.5 + 1.0
    z = torch.randn(8, 4)
    fake = G(z)
    d_loss = bce(D(real), ones) + bce(D(fake.detach()), zeros)
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = bce(D(fake), ones)
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()

RESULT = {f"G.{n}": p.detach().clone() for n, p in G.named_parameters()}
RESULT.update({f"D.{n}": p.detach().clone() for n, p in D.named_parameters()})
