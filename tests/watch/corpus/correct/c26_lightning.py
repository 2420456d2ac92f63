"""Lightning: a ``LightningModule`` trained by ``lightning.Trainer`` with ``accumulate_grad_batches=2``
and logging; ``training_step`` returns the loss and the module keeps only detached values."""

import logging
import tempfile

import torch
from torch import nn

REQUIRES = ("lightning",)

torch.set_num_threads(1)


def main() -> dict[str, torch.Tensor]:
    import lightning as L

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    class Regressor(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            self.epoch_losses: list[torch.Tensor] = []

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            self.epoch_losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)
    model = Regressor()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(
            default_root_dir=root,
            max_steps=3,
            accumulate_grad_batches=2,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, loader)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
