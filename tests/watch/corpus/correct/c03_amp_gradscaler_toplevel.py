"""Mixed precision as a script: ``torch.autocast`` in bfloat16 on the CPU and a ``GradScaler``.

``scaler.step(opt)`` calls ``opt.step()`` (the step boundary) unless the gradients overflowed; the
scaled loss and the bfloat16 activations are module globals replaced every step.
"""

import torch
from torch import nn

torch.set_num_threads(1)
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
for _ in range(3):
    x, target = torch.randn(8, 8), torch.randint(0, 4, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.float(), target)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()

RESULT = {name: p.detach().clone() for name, p in model.named_parameters()}
