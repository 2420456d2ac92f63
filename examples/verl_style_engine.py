"""A verl-style training engine, with and without ``@gradguard.forward_step``.

The scenario: an engine in the shape of verl's (``verl/workers/engine``) trains a tiny policy with a
value head on 8 micro-batches. ``forward_step(micro_batch, loss_function, forward_only)`` returns
``(loss, {"model_output": {"log_probs", "entropy"}, "loss": float, "metrics": {...}})`` and
``train_mini_batch`` runs ``loss.backward()`` and keeps every second element in ``output_lst`` until
the mini-batch ends, as verl does. The policy's embedding is frozen and its output made a leaf that
requires grad (what PEFT's ``enable_input_require_grads`` does).

Without a guard every record pins its micro-batch's graph after backward: ``log_probs`` keeps the
nodes and the embedding-output leaf with its ``.grad``; ``entropy`` (a metric, not in the loss, so
backward never frees its branch) also keeps the softmax over the vocabulary it saved. With
``@gradguard.forward_step`` on the method, everything but the loss is detached *after* the loss is
computed: nothing is pinned and the gradients are bitwise the same.

Then the trap that an early ``.detach()`` sets: a variant that detaches the policy's logits *before*
the loss still returns a loss that requires grad (through the value head and the shared body), so
training "runs" and the LM head silently gets zero gradient. ``gradguard.forward_step(
check="reaches_params", params=policy)`` (applied in ``__init__``, where the policy exists) refuses
it with a :class:`gradguard.LossContractError` naming the parameters the loss never reaches.

Run: ``python examples/verl_style_engine.py`` (a couple of seconds, CPU only).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradguard

MICRO_BATCHES = 8
BATCH, SEQ, VOCAB, HIDDEN = 4, 64, 1024, 64


class Policy(nn.Module):
    """A tiny causal-LM stand-in: frozen embedding (its output made a leaf), an MLP body, an LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU())
        self.lm_head = nn.Linear(HIDDEN, VOCAB)
        self.leaves: list[weakref.ref[torch.Tensor]] = []  # one per forward, to see what stays alive

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids).requires_grad_(True)  # PEFT's enable_input_require_grads
        self.leaves.append(weakref.ref(x))
        hidden = self.body(x)
        return self.lm_head(hidden), hidden


class Engine:
    """The parts of a verl engine that matter here: ``forward_step`` and the mini-batch loop."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.policy = Policy()
        self.value_head = nn.Linear(HIDDEN, 1)

    def forward_step(self, micro_batch: dict[str, torch.Tensor], loss_function: Callable[..., Any], forward_only: bool):
        logits, hidden = self.policy(micro_batch["input_ids"])
        model_output = self.model_output(logits, micro_batch)
        model_output["values"] = self.value_head(hidden).squeeze(-1)
        loss, metrics = loss_function(model_output, micro_batch)
        output = {
            "model_output": {"log_probs": model_output["log_probs"], "entropy": model_output["entropy"]},
            "loss": loss.detach().item(),
            "metrics": metrics,
        }
        return loss, output

    @staticmethod
    def model_output(logits: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        logp = torch.log_softmax(logits.float(), dim=-1)
        log_probs = logp.gather(-1, micro_batch["labels"].unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)  # reported, not in the loss (entropy_coeff = 0)
        return {"log_probs": log_probs, "entropy": entropy}

    def train_mini_batch(
        self, micro_batches: list[dict[str, torch.Tensor]], loss_function: Callable[..., Any]
    ) -> list[Any]:
        output_lst = []
        for micro_batch in micro_batches:
            loss, output = self.forward_step(micro_batch, loss_function=loss_function, forward_only=False)
            loss.backward()
            output_lst.append(output)  # kept until the mini-batch ends, as verl does
        return output_lst

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in (self.policy, self.value_head) for p in m.parameters() if p.requires_grad]


class GuardedEngine(Engine):
    @gradguard.forward_step
    def forward_step(self, micro_batch, loss_function, forward_only):
        return super().forward_step(micro_batch, loss_function, forward_only)


class BuggyEngine(Engine):
    """Someone "saves memory" by detaching the policy output *before* the loss."""

    def forward_step(self, micro_batch, loss_function, forward_only):
        logits, hidden = self.policy(micro_batch["input_ids"])
        model_output = self.model_output(logits.detach(), micro_batch)  # the bug
        model_output["values"] = self.value_head(hidden).squeeze(-1)
        loss, metrics = loss_function(model_output, micro_batch)
        return loss, {"model_output": model_output, "loss": loss.detach().item(), "metrics": metrics}


class CheckedBuggyEngine(BuggyEngine):
    """The same bug, with the loss check on: params are known only once the model exists, so wrap in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.forward_step = gradguard.forward_step(self.forward_step, check="reaches_params", params=self.policy)


def ppo_like_loss(model_output: dict[str, torch.Tensor], micro_batch: dict[str, torch.Tensor]):
    pg_loss = -(micro_batch["advantages"] * model_output["log_probs"]).mean()
    vf_loss = (model_output["values"] - micro_batch["returns"]).pow(2).mean()
    metrics = {"pg_loss": pg_loss.detach().item(), "entropy": model_output["entropy"].mean()}  # a tensor: leaks too
    return pg_loss + 0.5 * vf_loss, metrics


def make_micro_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        {
            "input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            "advantages": torch.randn(BATCH, SEQ, generator=g),
            "returns": torch.randn(BATCH, SEQ, generator=g),
        }
        for _ in range(MICRO_BATCHES)
    ]


def run(engine_cls: type[Engine]) -> dict[str, Any]:
    engine = engine_cls()
    output_lst = engine.train_mini_batch(make_micro_batches(), ppo_like_loss)
    gc.collect()
    return {
        "graphs": gradguard.find_graphs(output_lst),
        "pinned": gradguard.pinned_bytes(output_lst),
        "alive": sum(ref() is not None for ref in engine.policy.leaves),
        "losses": [out["loss"] for out in output_lst],
        "grads": [p.grad.clone() for p in engine.parameters()],
    }


def main() -> int:
    print(f"verl-style engine: {MICRO_BATCHES} micro-batches of {BATCH}x{SEQ} tokens, vocab {VOCAB}, output_lst kept\n")
    results = {}
    for label, cls in (("plain forward_step", Engine), ("@gradguard.forward_step", GuardedEngine)):
        results[label] = r = run(cls)
        paths = sorted({g.path.split("]", 1)[1] for g in r["graphs"]})
        print(f"{label}:")
        print(f"  output_lst: {len(r['graphs'])} tensors carry a graph {paths if paths else ''}")
        print(f"  graph-held memory (gradguard.pinned_bytes): {r['pinned']} bytes ({r['pinned'] / 2**20:.2f} MiB)")
        print(f"  embedding-output leaves still alive: {r['alive']}/{MICRO_BATCHES}")
    plain, guarded = results.values()
    same_losses = plain["losses"] == guarded["losses"]
    same_grads = all(torch.equal(a, b) for a, b in zip(plain["grads"], guarded["grads"]))
    print(f"\nlosses equal: {same_losses}; parameter grads bitwise equal (torch.equal): {same_grads}")
    print("what the guard did (gradguard.stats()):")
    print("  " + str(gradguard.stats()).replace("\n", "\n  "))

    print("\nThe silent-zero-gradient trap: the policy output detached before the loss")
    buggy = BuggyEngine()
    loss, _ = buggy.forward_step(make_micro_batches()[0], ppo_like_loss, forward_only=False)
    loss.backward()
    head = buggy.policy.lm_head
    zero = all(p.grad is None or not p.grad.any() for p in head.parameters())
    print(
        f"  unchecked: loss={loss.detach().item():.4f}, requires_grad={loss.requires_grad} (through the value head "
        f"and the shared body); lm_head gets no gradient: {zero}"
    )

    checked = CheckedBuggyEngine()
    caught = None
    try:
        checked.forward_step(make_micro_batches()[0], ppo_like_loss, forward_only=False)
    except gradguard.LossContractError as exc:
        caught = exc
    print(f'  @gradguard.forward_step(check="reaches_params", params=policy) raised LossContractError:\n    {caught}')

    ok = bool(plain["graphs"]) and plain["alive"] == MICRO_BATCHES and not guarded["graphs"]
    ok = ok and guarded["pinned"] == 0 and guarded["alive"] == 0 and same_losses and same_grads
    ok = ok and zero and caught is not None
    verdict = "OK: the guard released every graph, changed no gradient, and caught the early detach"
    print(f"\n{verdict}" if ok else "\nUNEXPECTED RESULT")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
