"""torchmetrics: a regression model trained by hand, its error tracked with ``MeanSquaredError``.

The documented pattern: ``metric.update(preds, target)`` for each batch, ``metric.compute()`` at the
end. On 0.7.2 ``update`` accumulates the state with the graph of ``preds``; 0.7.3 runs it without grad.
The remedy gradguard names (``_probe.REMEDY``): ``update(preds.detach(), target)``.
"""

from __future__ import annotations

import os

import _probe
import torch
import torchmetrics

STEPS = int(os.environ.get("GRADGUARD_FIELD_STEPS", "24"))


def main() -> None:
    _probe.install()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mse = torchmetrics.MeanSquaredError()
    data = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(256, 64, generator=data), torch.randn(256, 1, generator=data)
        preds = model(x)
        loss = torch.nn.functional.mse_loss(preds, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mse.update(preds.detach() if _probe.REMEDY else preds, y)
    print(f"train mse {mse.compute().item():.4f}")
    _probe.finish(model)


if __name__ == "__main__":
    main()
