"""Megatron-LM's ``current_max_attn_logits``: an attention module keeps the running per-head maximum
of its attention logits as a module attribute, ``torch.max(previous, this step's amax)``, never
detached.

``amax`` saves its input for a backward that never comes: every step's attention scores
(``BATCH * HEADS * SEQ * SEQ`` float32) stay alive through the chain of maxima. The loss's backward
freed the scores' own graph, so the chain is dead: repaired in ``detach``, and memory stays flat.
"""

import math

import torch
from torch import nn

BATCH, HEADS, SEQ, HEAD_DIM = 2, 2, 32, 4
DIM = HEADS * HEAD_DIM

EXPECT_HOLDER = "current_max_attn_logits"
EXPECT_OUTCOME_DETACH = "repaired"
PINNED_PER_STEP = BATCH * HEADS * SEQ * SEQ * 4  # the scores amax saved

torch.set_num_threads(1)


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.current_max_attn_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(BATCH, SEQ, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
        step_max = scores.amax(dim=(0, 2, 3))  # per head; the leak: Megatron detaches this statistic
        if self.current_max_attn_logits is None:
            self.current_max_attn_logits = step_max
        else:
            self.current_max_attn_logits = torch.max(self.current_max_attn_logits, step_max)
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(BATCH, SEQ, DIM))


def main() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, DIM), SelfAttention(), nn.Linear(DIM, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(6):
        x, y = torch.randn(BATCH, SEQ, DIM), torch.randn(BATCH, SEQ, 1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
