"""Inner adaptation as a script: the outer forward ``feats`` is a module global that lives across
three steps of the auxiliary optimizer before the outer loss uses it."""

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)

encoder, head, aux = nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(8, 1)
opt = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1)
aux_opt = torch.optim.SGD(aux.parameters(), lr=0.1)
for _ in range(2):
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    feats = encoder(x).tanh()
    for _ in range(3):
        aux_loss = (aux(feats.detach()) - y).pow(2).mean()
        aux_opt.zero_grad()
        aux_loss.backward()
        aux_opt.step()
    loss = (head(feats) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

RESULT = {
    f"{name}.{n}": p.detach().clone()
    for name, m in [("encoder", encoder), ("head", head), ("aux", aux)]
    for n, p in m.named_parameters()
}
