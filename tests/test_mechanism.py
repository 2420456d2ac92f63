"""The mechanism gradguard exists for, end to end on CPU.

A frozen embedding whose output is made a leaf that requires grad (PEFT's
``enable_input_require_grads``), a non-reentrant checkpoint block, loss, backward. A record that
holds a tensor derived from the block output with ``grad_fn`` keeps the leaf (and its ``.grad``)
alive after backward; the ``detach_tree`` of the same record does not, and training is unchanged.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradguard import detach_tree, find_graphs, pinned_bytes

VOCAB, DIM, BATCH, SEQ = 50, 16, 2, 12


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.embed.requires_grad_(False)  # frozen, as under LoRA
        self.block = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)


def micro_batch(model: TinyLM, ids: torch.Tensor, detach: bool) -> tuple[dict[str, Any], weakref.ref]:
    """One micro-batch: forward, loss, backward; returns the published record and a weakref to
    the block input (the embedding output made a leaf)."""
    h = model.embed(ids)
    assert h.grad_fn is None
    h.requires_grad_(True)  # enable_input_require_grads: the embedding output becomes a leaf
    assert h.is_leaf and h.requires_grad
    block_in = weakref.ref(h)
    out = checkpoint(model.block, h, use_reentrant=False)
    log_probs = model.head(out).log_softmax(-1)
    loss = -log_probs[..., 0].mean()
    record = {"model_output": {"log_probs": log_probs, "hidden": out[:, -1]}, "loss": loss.item()}
    if detach:
        record = detach_tree(record)
    loss.backward()
    return record, block_in


def run(detach: bool, n_micro: int = 3) -> tuple[list[dict[str, Any]], list[weakref.ref], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyLM()
    gen = torch.Generator().manual_seed(1)
    records, refs = [], []
    for _ in range(n_micro):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        rec, ref = micro_batch(model, ids, detach)
        records.append(rec)
        refs.append(ref)
    gc.collect()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return records, refs, grads


def test_raw_record_pins_leaf_detached_record_does_not() -> None:
    raw_records, raw_refs, _ = run(detach=False)
    det_records, det_refs, _ = run(detach=True)

    # the raw records keep every micro-batch's leaf (and its grad) alive
    assert all(r() is not None for r in raw_refs)
    leaf = raw_refs[0]()
    assert leaf is not None and leaf.grad is not None and leaf.grad.shape == (BATCH, SEQ, DIM)
    del leaf
    assert len(find_graphs(raw_records)) == 2 * len(raw_records)
    leaf_bytes = BATCH * SEQ * DIM * 4
    # per micro-batch at least the leaf and its .grad
    assert pinned_bytes(raw_records[0]) >= 2 * leaf_bytes
    assert pinned_bytes(raw_records) >= 2 * leaf_bytes * len(raw_records)

    # the detached records let them go
    assert all(r() is None for r in det_refs)
    assert find_graphs(det_records) == []
    assert pinned_bytes(det_records) == 0

    # dropping the raw records frees the leaves: the records were what pinned them
    del raw_records
    gc.collect()
    assert all(r() is None for r in raw_refs)


def test_detached_record_has_the_same_values() -> None:
    raw_records, _, _ = run(detach=False, n_micro=2)
    det_records, _, _ = run(detach=True, n_micro=2)
    for raw, det in zip(raw_records, det_records):
        assert raw["loss"] == det["loss"]
        for key in ("log_probs", "hidden"):
            a, b = raw["model_output"][key], det["model_output"][key]
            assert a.requires_grad and not b.requires_grad
            assert torch.equal(a.detach(), b)


def test_parameter_grads_bitwise_equal() -> None:
    _, _, raw_grads = run(detach=False)
    _, _, det_grads = run(detach=True)
    assert raw_grads.keys() == det_grads.keys()
    assert {"block.0.weight", "block.2.bias", "head.weight"} <= raw_grads.keys()
    assert not any(k.startswith("embed") for k in raw_grads)
    for name, g in raw_grads.items():
        assert torch.count_nonzero(g) > 0, name
        assert torch.equal(g, det_grads[name]), name


def test_detaching_before_loss_breaks_training() -> None:
    """Why the boundary is after the loss: detaching the output first leaves nothing to train."""
    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    h = model.embed(ids).requires_grad_(True)
    out = checkpoint(model.block, h, use_reentrant=False)
    log_probs = detach_tree(model.head(out).log_softmax(-1))
    loss = -log_probs[..., 0].mean()
    assert not loss.requires_grad
    with pytest.raises(RuntimeError):
        loss.backward()
