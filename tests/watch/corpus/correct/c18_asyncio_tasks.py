"""Two asyncio tasks training their own models in one thread, awaiting between the forward and the
backward (as a data or logging ``await`` would): each task's loss waits, suspended in its coroutine,
while the other task steps its optimizer."""

import asyncio

import torch
from torch import nn

torch.set_num_threads(1)

STEPS = 3


async def train(seed: int, out: dict[str, torch.Tensor]) -> None:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        await asyncio.sleep(0)  # the other task runs here
        opt.zero_grad()
        loss.backward()
        opt.step()
        await asyncio.sleep(0)
    for name, p in model.named_parameters():
        out[f"task{seed}.{name}"] = p.detach().clone()


async def run_all() -> dict[str, torch.Tensor]:
    result: dict[str, torch.Tensor] = {}
    await asyncio.gather(train(0, result), train(1, result))
    return dict(sorted(result.items()))


RESULT = asyncio.run(run_all())
