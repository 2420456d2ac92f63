"""pytorch-pfn-extras: a manual loop under ``ExtensionsManager`` with ``LogReport``, the model reporting its errors.

The pattern ``reporting.report``'s documentation gives as the typical one: the module reports
``{"abs_error": ..., "squared_error": ...}`` from its forward with itself as the observer; the manager
(models and optimizers registered, ``LogReport`` extended) runs each iteration in ``run_iteration()``.
On 0.2.1 ``report`` copies the tensors with ``clone()`` (graph kept) and ``LogReport``'s summary sums
them until its trigger (one epoch by default); 0.3.0 copies them with ``detach()``. The remedy gradguard
names (``_probe.REMEDY``): report the values detached.
"""

from __future__ import annotations

import os

import _probe
import pytorch_pfn_extras as ppe
import torch
from pytorch_pfn_extras.training import extensions

STEPS = int(os.environ.get("GRADGUARD_FIELD_STEPS", "24"))
BATCH = 256


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.predictor = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pred = self.predictor(x)
        abs_error = (pred - y).abs().sum() / len(x)
        loss = torch.nn.functional.mse_loss(pred, y)
        reported = {"abs_error": abs_error, "squared_error": loss}
        if _probe.REMEDY:
            reported = {name: value.detach() for name, value in reported.items()}
        ppe.reporting.report(reported, self)
        return loss


def main() -> None:
    _probe.install()
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    manager = ppe.training.ExtensionsManager(
        {"main": model}, {"main": opt}, 1, extensions=[extensions.LogReport()], iters_per_epoch=STEPS
    )
    data = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 64, generator=data), torch.randn(BATCH, 1, generator=data)
        with manager.run_iteration():
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            opt.step()
    _probe.finish(model)


if __name__ == "__main__":
    main()
