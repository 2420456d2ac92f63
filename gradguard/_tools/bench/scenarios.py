"""The benchmark's scenarios: the field's two leak mechanisms, small enough for a 2-core CPU.

Each scenario runs ``micro_batches`` steps of forward + loss + backward and keeps one record per
micro-batch (``{"loss": float, "model_output": {"log_probs", "entropy"}}``) to the end, as the engines
do. The unguarded run keeps the records as they come; the guarded run goes through the public API.
Everything derives from a seed, so the two runs compute bitwise the same gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradguard

from .base import Scenario, Size

__all__ = ["PRESETS", "SCENARIOS", "Scenario", "Size", "build"]


PRESETS: dict[str, tuple[Size, int]] = {
    # pinned per micro-batch = leaf + grad = 2 * seq * hidden * 2 B = 47,611,904 B = 45.41 MiB
    "seed-pp4": (Size(seq=2906, batch=1, hidden=4096, vocab=32000, dtype=torch.bfloat16), 1024),
}


class _Block(nn.Module):
    """A transformer-like MLP block with a residual (what a checkpointed layer looks like)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class _LoRABlock(nn.Module):
    """A frozen linear with a trainable low-rank adapter (PEFT's LoRA), residual."""

    def __init__(self, hidden: int, rank: int = 8) -> None:
        super().__init__()
        self.base = nn.Linear(hidden, hidden).requires_grad_(False)
        self.lora_a = nn.Linear(hidden, rank, bias=False)
        self.lora_b = nn.Linear(rank, hidden, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.base(x) + self.lora_b(self.lora_a(x)))


def _record(logits: torch.Tensor, target: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
    """The record, and a PPO-style loss with an entropy bonus.

    The entropy is part of the loss, so backward traverses its branch and frees its saved tensors:
    what the record then pins is exactly the leaf and its grad. (An entropy kept in the record but
    left out of the loss would also pin its own saved activations, two logits-sized tensors.)
    """
    logp = logits.float().log_softmax(-1)
    log_probs = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    loss = -(log_probs.mean() + 1e-3 * entropy.mean())
    return {"model_output": {"log_probs": log_probs, "entropy": entropy}, "loss": loss.item()}, loss


class _TEBlock(nn.Module):
    """The same block from Transformer Engine layers, checkpointed with TE's checkpoint."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        import transformer_engine.pytorch as te

        self._te = te
        self.mlp = te.LayerNormMLP(hidden, 4 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._te.distributed.checkpoint(self.mlp, x)


def _pp_last_stage(device: torch.device, size: Size, te: bool = False) -> Scenario:
    torch.manual_seed(0)
    block = _TEBlock(size.hidden) if te else _Block(size.hidden)
    model = nn.ModuleDict({"block": block, "head": nn.Linear(size.hidden, size.vocab)})
    model.to(device=device, dtype=size.dtype)
    run_block = model["block"] if te else (lambda x: checkpoint(model["block"], x, use_reentrant=False))
    shape = (size.seq, size.batch, size.hidden)

    def step(i: int, store: Any, guarded: bool) -> None:
        g = torch.Generator(device=device).manual_seed(i)
        # Megatron's create_tensor_recv_prev: a fresh leaf that requires grad, filled by the P2P recv.
        recv = torch.empty(shape, device=device, dtype=size.dtype, requires_grad=True)
        with torch.no_grad():
            recv.copy_(torch.randn(shape, device=device, generator=g, dtype=size.dtype))
        out = run_block(recv)
        target = torch.randint(size.vocab, (size.seq, size.batch), device=device, generator=g)
        record, loss = _record(model["head"](out), target)
        store.append(record)  # forward_step_calc_loss appends before the backward of this micro-batch
        loss.backward()

    def new_store(guarded: bool) -> Any:
        return gradguard.guard([], name="forward_data_store") if guarded else []

    leaf = size.seq * size.batch * size.hidden * size.dtype.itemsize
    record = 2 * size.seq * size.batch * 4  # log_probs and entropy, float32
    return Scenario("pp-last-stage-te" if te else "pp-last-stage", model, 2 * leaf, record, step, new_store)


def _lora_checkpoint(device: torch.device, size: Size) -> Scenario:
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "embed": nn.Embedding(size.vocab, size.hidden).requires_grad_(False),
            "block": _LoRABlock(size.hidden),
            "head": nn.Linear(size.hidden, size.vocab).requires_grad_(False),
        }
    )
    model.to(device=device, dtype=size.dtype)

    def forward_step(ids: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        x = model["embed"](ids)
        x.requires_grad_(True)  # PEFT's enable_input_require_grads: the embedding output becomes a leaf
        out = checkpoint(model["block"], x, use_reentrant=False)
        output, loss = _record(model["head"](out), target)
        return loss, output

    guarded_forward_step = gradguard.forward_step(forward_step, forward_only=None)

    def step(i: int, output_lst: Any, guarded: bool) -> None:
        g = torch.Generator(device=device).manual_seed(i)
        ids = torch.randint(size.vocab, (size.batch, size.seq), device=device, generator=g)
        target = torch.randint(size.vocab, (size.batch, size.seq), device=device, generator=g)
        loss, output = (guarded_forward_step if guarded else forward_step)(ids, target)
        loss.backward()
        output_lst.append(output)  # verl keeps every micro-batch's output until the mini-batch ends

    leaf = size.seq * size.batch * size.hidden * size.dtype.itemsize
    record = 2 * size.seq * size.batch * 4
    return Scenario("lora-checkpoint", model, 2 * leaf, record, step, lambda guarded: [])


SCENARIOS: dict[str, Callable[[torch.device, Size], Scenario]] = {
    "pp-last-stage": _pp_last_stage,
    "lora-checkpoint": _lora_checkpoint,
    "pp-last-stage-te": lambda device, size: _pp_last_stage(device, size, te=True),
    "megatron-gpt": lambda device, size: _megatron_gpt(device, size),
}


def _megatron_gpt(device: torch.device, size: Size) -> Scenario:
    from .megatron_gpt import scenario  # imports megatron-core: only when asked for

    return scenario(device, size)


def build(name: str, device: torch.device, size: Size) -> Scenario:
    """Build scenario ``name``; a ``ValueError`` lists the known ones."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return SCENARIOS[name](device, size)
