"""Training in a worker thread (a ``threading.Thread`` subclass) that keeps each step's loss in its
own ``self.losses``; the boundaries are the worker thread's. An error in the worker is re-raised by
the main thread after ``join()``."""

import threading

import torch
from torch import nn

EXPECT_HOLDER = "losses[*]"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)


class Worker(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="corpus-leak-worker")
        self.losses: list[torch.Tensor] = []
        self.error: BaseException | None = None
        self.result: dict[str, torch.Tensor] = {}

    def run(self) -> None:
        try:
            self.train()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
            self.error = exc

    def train(self) -> None:
        g = torch.Generator().manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(4):
            loss = nn.functional.mse_loss(model(torch.randn(8, 8, generator=g)), torch.randn(8, 1, generator=g))
            opt.zero_grad()
            loss.backward()
            opt.step()
            self.losses.append(loss)
        self.result = {name: p.detach().clone() for name, p in model.named_parameters()}


def main() -> dict[str, torch.Tensor]:
    worker = Worker()
    worker.start()
    worker.join()
    if worker.error is not None:
        raise worker.error
    return worker.result


RESULT = main()
