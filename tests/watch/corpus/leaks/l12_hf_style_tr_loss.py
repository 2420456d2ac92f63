"""HF Trainer's accumulator written without its ``.detach()``: the trainer object keeps
``self.tr_loss``, a tensor added to in place every step (``self.tr_loss += loss``), and logs it
every ``logging_steps``."""

import torch
from torch import nn

EXPECT_HOLDER = "tr_loss"
EXPECT_OUTCOME_DETACH = "repaired"

torch.set_num_threads(1)


class MiniTrainer:
    def __init__(self, model: nn.Module, logging_steps: int = 4) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.tr_loss = torch.tensor(0.0)
        self.logging_steps = logging_steps
        self.log_history: list[dict[str, float]] = []

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss

    def train(self, steps: int) -> None:
        for step in range(1, steps + 1):
            tr_loss_step = self.training_step(torch.randn(8, 8), torch.randn(8, 1))
            self.tr_loss += tr_loss_step  # the leak: HF adds tr_loss_step.detach()
            self.optimizer.step()
            self.optimizer.zero_grad()
            if step % self.logging_steps == 0:
                self.log_history.append({"loss": self.tr_loss.item() / self.logging_steps, "step": step})


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    MiniTrainer(model).train(4)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
