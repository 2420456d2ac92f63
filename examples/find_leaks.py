"""A training loop that leaks three ways at once: found by ``gradguard.audit()``, repaired by ``gradguard.watch()``.

Nobody told gradguard where to look. The loop keeps autograd graphs alive in three places the field
knows:

- a module global history, ``HISTORY.append({"step": step, "loss": loss})``;
- a module attribute, Megatron-LM's ``current_max_attn_logits`` (#4699): the attention keeps the running
  maximum of its logits with ``torch.maximum`` and never detaches it, so every step's attention scores,
  saved for a backward that never comes, stay alive;
- a trainer's metrics dict, ``self.metrics["loss_sum"] += loss`` (ray #40940, TRL #1526).

The frozen embedding's output is made a leaf that requires grad (PEFT's ``enable_input_require_grads``),
so each kept graph also pins that leaf and its ``.grad``. ``gradguard.testing.MemoryProbe`` measures
the growth per step (exact live tensor bytes); the first run prints ``gradguard.audit()``'s report, the
second runs under ``gradguard.watch(mode="detach", every=1)``, which detaches at each optimizer step
whatever still holds a graph from the previous step. The parameters come out bitwise equal.

Run: ``python examples/find_leaks.py`` (a few seconds, CPU only).
"""

from __future__ import annotations

import math

import torch
from torch import nn

import gradguard
from gradguard.testing import MemoryProbe

STEPS = 6
BATCH, SEQ, DIM, HEADS, VOCAB = 8, 64, 64, 4, 256

HISTORY: list[dict[str, object]] = []  # leak 1: a module global


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.current_max_attn_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS)
        max_logits = scores.amax(dim=(0, 2, 3))  # per head, for QK-clip and logging
        previous = self.current_max_attn_logits
        # leak 2: a module attribute, kept with its graph (the fix: max_logits.detach())
        self.current_max_attn_logits = max_logits if previous is None else torch.maximum(previous, max_logits)
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, DIM))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM).requires_grad_(False)
        self.attn = Attention()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids).requires_grad_(True)  # the leaf PEFT's enable_input_require_grads creates
        return self.head(hidden + self.attn(hidden))


class Trainer:
    def __init__(self, model: Model) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.metrics: dict[str, object] = {"loss_sum": 0.0}

    def step(self, step: int, ids: torch.Tensor) -> float:
        logits = self.model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        self.optimizer.step()  # the step boundary the watch audits after
        self.optimizer.zero_grad()
        self.metrics["loss_sum"] = self.metrics["loss_sum"] + loss  # leak 3: a trainer's metrics dict
        HISTORY.append({"step": step, "loss": loss})
        return loss.item()


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def train(trainer: Trainer) -> MemoryProbe:
    """Run ``STEPS`` steps, reading the live tensor bytes after each."""
    with MemoryProbe() as probe:
        for step, ids in enumerate(batches()):
            trainer.step(step, ids)
            probe.step()
    return probe


def memory(probe: MemoryProbe) -> str:
    readings = ", ".join(f"{r / 2**20:.2f}" for r in probe.readings[1:])
    growth = f"{probe.growth_per_step:+,.0f} bytes per step"
    return f"live tensor MiB after each step (MemoryProbe): {readings}; growth {growth}"


def new_trainer() -> Trainer:
    torch.manual_seed(0)
    HISTORY.clear()
    return Trainer(Model())


def main() -> None:
    leaky = new_trainer()
    probe = train(leaky)
    print(f"without the watch: {memory(probe)}")
    report = gradguard.audit()
    print(report)
    leaky_params = [p.detach().clone() for p in leaky.model.parameters()]
    del leaky, report

    repaired = new_trainer()
    with gradguard.watch(mode="detach", every=1) as scope:
        probe = train(repaired)
    print(f'\nunder gradguard.watch(mode="detach", every=1): {memory(probe)}')
    print(scope.watcher.summary())
    report = gradguard.audit()
    print(
        f"gradguard.audit() after it: {len(report)} holder(s) pinning {report.pinned_bytes:,} bytes: the last step's"
        " graphs, which no later step boundary has judged"
    )
    equal = all(torch.equal(a, b) for a, b in zip(leaky_params, repaired.model.parameters()))
    print(f"parameters bitwise equal with and without the watch (torch.equal): {equal}")


if __name__ == "__main__":
    main()
