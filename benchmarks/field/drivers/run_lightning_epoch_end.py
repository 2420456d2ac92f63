"""PyTorch Lightning: a ``LightningModule`` whose ``training_step`` returns ``{"loss": ..., "preds": ...}``.

On the 1.x releases the docs pair that with ``training_epoch_end(outputs)``, which receives every
step's output at the end of the epoch: the loop keeps them until then (1.9.5 detaches ``loss`` and
keeps the other keys with their graphs). 2.0 removed the hook (its replacement,
``on_train_epoch_end``, receives no outputs) and the loop keeps nothing; this driver takes
``on_train_epoch_end`` there, the rest of the program unchanged. The remedy gradguard names
(``_probe.REMEDY``): ``training_step`` returns ``preds`` detached.
"""

from __future__ import annotations

import os

import _probe
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

STEPS = int(os.environ.get("GRADGUARD_FIELD_STEPS", "24"))
BATCH = 256
HAS_EPOCH_END_OUTPUTS = int(pl.__version__.split(".")[0]) < 2


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        preds = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(preds, y), "preds": preds.detach() if _probe.REMEDY else preds}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RegressorEpochEnd(Regressor):
    def training_epoch_end(self, outputs: list[dict[str, torch.Tensor]]) -> None:
        self.epoch_mean_pred = torch.cat([o["preds"] for o in outputs]).mean().item()


class RegressorOnTrainEpochEnd(Regressor):
    def on_train_epoch_end(self) -> None:
        self.epoch_mean_pred = None  # the 2.0 hook receives no outputs


def main() -> None:
    _probe.install()
    pl.seed_everything(0)
    model = RegressorEpochEnd() if HAS_EPOCH_END_OUTPUTS else RegressorOnTrainEpochEnd()
    data = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH * STEPS, 64, generator=data), torch.randn(BATCH * STEPS, 1, generator=data)
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    _probe.finish(model)


if __name__ == "__main__":
    main()
