"""End to end: the leak as verl's FSDP LoRA path produced it, and gone under ``guard()``.

A frozen embedding whose output is made a leaf that requires grad (PEFT's
``enable_input_require_grads``), a non-reentrant checkpointed block, a loss, ``backward()``, and a
record ``{"loss": float, "model_output": {"log_probs", "entropy"}}`` kept per micro-batch until the
mini-batch ends. Unguarded, each record's ``grad_fn`` keeps its micro-batch's leaf and the leaf's
``.grad`` alive; guarded, nothing is kept and the gradients are the same, bit for bit.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradguard

MICRO_BATCHES = 8
BATCH, SEQ, HIDDEN, VOCAB = 2, 16, 32, 64
LEAF_BYTES = BATCH * SEQ * HIDDEN * 4  # the embedding output, float32
PINNED_PER_MICRO_BATCH = LEAF_BYTES + LEAF_BYTES  # the leaf and its .grad


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.embed.weight.requires_grad_(False)  # frozen base, as under LoRA
        self.block = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.head = nn.Linear(HIDDEN, VOCAB)


@dataclass
class Run:
    store: list[Any]
    leaves: list[weakref.ref[torch.Tensor]]
    grads: dict[str, torch.Tensor]
    losses: list[float]


def train_mini_batch(guarded: bool) -> Run:
    """One mini-batch of ``MICRO_BATCHES`` micro-batches; the records stay in ``store`` to the end."""
    torch.manual_seed(0)
    model = Model()
    data = torch.Generator().manual_seed(1)
    output_lst: list[Any] = gradguard.guard([], name="output_lst") if guarded else []
    leaves = []
    for _ in range(MICRO_BATCHES):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data)
        hidden = model.embed(ids)
        assert not hidden.requires_grad
        hidden.requires_grad_(True)  # enable_input_require_grads: the output becomes a leaf
        leaves.append(weakref.ref(hidden))
        out = checkpoint(model.block, hidden, use_reentrant=False)
        log_probs_all = model.head(out).log_softmax(-1)
        log_probs = log_probs_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs_all.exp() * log_probs_all).sum(-1)
        loss = -log_probs.mean() - 0.01 * entropy.mean()
        loss.backward()  # the loss is computed and used first; only then is the record published
        output_lst.append({"loss": loss.item(), "model_output": {"log_probs": log_probs, "entropy": entropy}})
        del hidden, out, log_probs_all, log_probs, entropy, loss
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    losses = [r["loss"] for r in output_lst]
    del model
    gc.collect()
    return Run(output_lst, leaves, grads, losses)


def test_unguarded_records_pin_every_micro_batch() -> None:
    run = train_mini_batch(guarded=False)
    assert len(run.store) == MICRO_BATCHES
    assert all(ref() is not None for ref in run.leaves)  # every micro-batch's leaf is still alive
    assert all(ref().grad is not None for ref in run.leaves)  # and so is its gradient
    assert gradguard.pinned_bytes(run.store) == MICRO_BATCHES * PINNED_PER_MICRO_BATCH
    graphs = gradguard.find_graphs(run.store)
    assert {g.path for g in graphs} == {
        f"[{i}]['model_output']['{k}']" for i in range(MICRO_BATCHES) for k in ("log_probs", "entropy")
    }
    run.store.clear()  # dropping the records frees the graphs, the proof that they were the holders
    gc.collect()
    assert all(ref() is None for ref in run.leaves)


def test_guarded_records_pin_nothing() -> None:
    run = train_mini_batch(guarded=True)
    assert len(run.store) == MICRO_BATCHES
    assert all(ref() is None for ref in run.leaves)  # every leaf was released
    assert gradguard.pinned_bytes(run.store) == 0
    assert gradguard.find_graphs(run.store) == []
    for record in run.store:
        for t in record["model_output"].values():
            assert t.grad_fn is None and not t.requires_grad
    assert list(record["model_output"]) == ["log_probs", "entropy"]
    (row,) = [s for s in gradguard.stats().values() if s.store == "output_lst"]
    assert row.records == MICRO_BATCHES and row.tensors_detached == 2 * MICRO_BATCHES
    assert row.pinned_bytes_per_record == PINNED_PER_MICRO_BATCH  # the estimate matches the analysis


def test_guard_changes_no_gradient_and_no_value() -> None:
    plain = train_mini_batch(guarded=False)
    guarded = train_mini_batch(guarded=True)
    assert plain.grads.keys() == guarded.grads.keys() and "embed.weight" not in plain.grads
    for name in plain.grads:
        assert torch.equal(plain.grads[name], guarded.grads[name]), name
    assert plain.losses == guarded.losses
    for a, b in zip(plain.store, guarded.store):
        for key in ("log_probs", "entropy"):
            assert torch.equal(a["model_output"][key].detach(), b["model_output"][key])


def test_strict_mode_catches_the_leak_at_the_first_append() -> None:
    gradguard.set_mode("strict")
    with pytest.raises(gradguard.GraphRetentionError, match=r"(?s)output_lst.*\['model_output'\]\['log_probs'\]"):
        train_mini_batch(guarded=True)
