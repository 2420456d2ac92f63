"""The classic training loop that keeps ``losses.append(loss)``, with and without gradguard.

A frozen embedding's output is made a leaf that requires grad (what PEFT's
``enable_input_require_grads`` does), a checkpointed block runs on it, and every micro-batch's loss
is kept until the end of the mini-batch. Each kept loss pins its micro-batch's graph and that leaf
with its ``.grad``; under ``gradguard.guard`` nothing is pinned. Runs on CPU in about a second.
"""

from __future__ import annotations

import gc
import weakref

import torch
from torch.utils.checkpoint import checkpoint

import gradguard


def run(guarded: bool, micro_batches: int = 8, tokens: int = 256, hidden: int = 256) -> tuple[int, int]:
    torch.manual_seed(0)
    embed = torch.nn.Embedding(1000, hidden).requires_grad_(False)
    block = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden))
    losses: list[torch.Tensor] = gradguard.guard([], name="losses") if guarded else []
    leaves = []
    for _ in range(micro_batches):
        ids = torch.randint(0, 1000, (tokens,))
        x = embed(ids).requires_grad_(True)  # the leaf PEFT creates
        leaves.append(weakref.ref(x))
        loss = checkpoint(block, x, use_reentrant=False).pow(2).mean()
        loss.backward()
        losses.append(loss)  # kept until the mini-batch ends
        del x, loss
    gc.collect()
    alive = sum(ref() is not None for ref in leaves)
    return alive, gradguard.pinned_bytes(list(losses))


def main() -> None:
    for guarded in (False, True):
        alive, pinned = run(guarded)
        label = "guarded  " if guarded else "unguarded"
        print(f"{label}: {alive}/8 micro-batch leaves still alive, graphs pin {pinned / 2**20:.2f} MiB")
    print(gradguard.stats())


if __name__ == "__main__":
    main()
