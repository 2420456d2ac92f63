"""Lightning's most common leak, without Lightning: ``training_step`` appends its loss to
``self.training_step_outputs`` for ``on_train_epoch_end``, which clears the list only once an epoch.
A small loop drives the hooks the way Lightning's does."""

import torch
from torch import nn

EXPECT_HOLDER = "training_step_outputs[*]"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)


class LitRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.training_step_outputs: list[torch.Tensor] = []
        self.epoch_means: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.training_step_outputs.append(loss)  # the leak: should be loss.detach()
        return loss

    def on_train_epoch_end(self) -> None:
        self.epoch_means.append(torch.stack(self.training_step_outputs).mean().item())
        self.training_step_outputs.clear()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(module: LitRegressor, batches: list[tuple[torch.Tensor, torch.Tensor]], epochs: int) -> None:
    opt = module.configure_optimizers()
    for _ in range(epochs):
        for batch_idx, batch in enumerate(batches):
            loss = module.training_step(batch, batch_idx)
            opt.zero_grad()
            loss.backward()
            opt.step()
        module.on_train_epoch_end()


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = LitRegressor()
    batches = [(torch.randn(8, 8), torch.randn(8, 1)) for _ in range(4)]
    fit(module, batches, epochs=1)
    return {name: p.detach().clone() for name, p in module.named_parameters()}


RESULT = main()
