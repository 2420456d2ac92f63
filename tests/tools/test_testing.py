"""gradguard.testing: assert_no_graph, assert_released and MemoryProbe (CPU, exact bytes).

The mechanism tests use the leak of the field in a few lines: a frozen embedding whose output is made
a leaf that requires grad (PEFT's ``enable_input_require_grads``), a non-reentrant checkpoint, loss,
backward, and one record per micro-batch kept to the end.
"""

from __future__ import annotations

import collections
import types
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradguard
from gradguard.testing import MemoryProbe, assert_no_graph, assert_released

VOCAB, DIM, BATCH, SEQ = 32, 16, 2, 8
LEAF_BYTES = BATCH * SEQ * DIM * 4  # the embedding output made a leaf, float32
PIN_BYTES = 2 * LEAF_BYTES  # the leaf and its .grad
RECORD_BYTES = BATCH * SEQ * 4  # the record's log_probs, float32

Entry = collections.namedtuple("Entry", "log_probs entropy")


def _graph_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(3, 4, requires_grad=True)
    log_probs = x.log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return log_probs, entropy


# --------------------------------------------------------------------------- assert_no_graph


def test_assert_no_graph_passes_on_detached_records() -> None:
    log_probs, entropy = _graph_tensors()
    records = [
        {"model_output": {"log_probs": log_probs.detach(), "entropy": entropy.detach()}, "loss": 1.0},
        Entry(log_probs.detach(), entropy.detach()),
        gradguard.detach_tree({"model_output": {"log_probs": log_probs}}),
        torch.ones(2, requires_grad=True),  # a leaf carries no grad_fn: it pins no graph
        "text",
        None,
    ]
    assert_no_graph(records)
    assert_no_graph({})
    assert_no_graph(log_probs.detach())


def test_assert_no_graph_names_the_path_and_grad_fn() -> None:
    log_probs, entropy = _graph_tensors()
    record = {"model_output": {"log_probs": log_probs, "entropy": entropy.detach()}, "loss": 1.0}
    with pytest.raises(AssertionError) as info:
        assert_no_graph(record, "record")
    message = str(info.value)
    assert "record holds 1 tensor(s)" in message
    assert "['model_output']['log_probs']: LogSoftmaxBackward0" in message
    assert "entropy" not in message


def test_assert_no_graph_lists_every_offending_path() -> None:
    log_probs, entropy = _graph_tensors()
    records = [
        {"model_output": {"log_probs": log_probs, "entropy": entropy.detach()}, "loss": 1.0},
        {"model_output": {"log_probs": log_probs.detach(), "entropy": entropy.detach()}, "loss": 1.0},
        Entry(log_probs=log_probs.detach(), entropy=entropy),
    ]
    with pytest.raises(AssertionError) as info:
        assert_no_graph(records, "output_lst")
    message = str(info.value)
    assert "output_lst holds 2 tensor(s) carrying an autograd graph" in message
    assert "[0]['model_output']['log_probs']: LogSoftmaxBackward0" in message
    assert "[2].entropy: NegBackward0" in message
    assert "[1]" not in message and "[2].log_probs" not in message


def test_assert_no_graph_on_a_bare_tensor() -> None:
    log_probs, _ = _graph_tensors()
    with pytest.raises(AssertionError, match="LogSoftmaxBackward0"):
        assert_no_graph(log_probs)


# --------------------------------------------------------------------------- assert_released


@pytest.mark.parametrize(
    "make",
    [
        lambda t: collections.UserList([t]),
        lambda t: types.SimpleNamespace(o=t),
        lambda t: {t},
        lambda t: {t: 1},
    ],
    ids=["UserList", "SimpleNamespace", "set", "dict-key"],
)
def test_assert_no_graph_looks_where_the_walk_cannot_rebuild(make: Any) -> None:
    """assert_no_graph finds graphs inside these."""
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(AssertionError, match="MulBackward0"):
        assert_no_graph(make(x * 2))


def test_assert_released_passes_on_dead_weakrefs() -> None:
    t = torch.ones(4)
    ref = weakref.ref(t)
    del t
    assert_released(ref)
    assert_released([ref, ref])
    assert_released([])


def test_assert_released_collects_cycles_first() -> None:
    class Holder:
        pass

    holder = Holder()
    holder.self = holder  # type: ignore[attr-defined]
    holder.tensor = torch.ones(4)  # type: ignore[attr-defined]
    ref = weakref.ref(holder.tensor)  # type: ignore[attr-defined]
    del holder
    assert_released(ref)  # only a gc.collect() frees the cycle


def test_assert_released_raises_naming_how_many_are_alive() -> None:
    alive = torch.ones(4)
    dead = torch.ones(4)
    refs = [weakref.ref(dead), weakref.ref(alive)]
    del dead
    with pytest.raises(AssertionError, match=r"1 of 2 leaf\(s\) still alive after gc.collect\(\) \(indices \[1\]\)"):
        assert_released(refs, "leaf")
    with pytest.raises(AssertionError, match=r"1 of 1 object\(s\) still alive"):
        assert_released(weakref.ref(alive))
    del alive


def test_assert_released_accepts_any_iterable_of_weakrefs() -> None:
    kept = [torch.ones(2) for _ in range(3)]
    refs = (weakref.ref(t) for t in kept)
    with pytest.raises(AssertionError, match=r"3 of 3"):
        assert_released(refs)


def test_assert_released_refuses_a_tensor() -> None:
    t = torch.ones(4)
    with pytest.raises(TypeError, match=r"weakref\.ref\(tensor\), not the tensor") as info:
        assert_released(t)  # type: ignore[arg-type]
    assert "keep the tensor alive" in str(info.value)


def test_assert_released_refuses_an_item_that_is_not_a_weakref() -> None:
    t = torch.ones(4)
    with pytest.raises(TypeError, match=r"item 1 is a Tensor, not a weakref\.ref"):
        assert_released([weakref.ref(t), t])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"item 0 is a str"):
        assert_released(["x"])  # type: ignore[list-item]


# --------------------------------------------------------------------------- the mechanism


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM).requires_grad_(False)  # frozen, as under LoRA
        self.block = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)


def _micro_batch(model: _TinyLM, i: int, store: Any) -> weakref.ref[torch.Tensor]:
    """Forward, loss, one record kept in ``store``, backward; a weakref to the leaf."""
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(i))
    h = model.embed(ids)
    h.requires_grad_(True)  # enable_input_require_grads: the embedding output becomes a leaf
    leaf = weakref.ref(h)
    out = checkpoint(model.block, h, use_reentrant=False)
    log_probs = model.head(out).log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    loss = -log_probs.mean()
    store.append({"model_output": {"log_probs": log_probs}, "loss": loss.item()})
    loss.backward()
    return leaf


def test_mechanism_kept_records_pin_leaves_and_guard_releases_them() -> None:
    model = _TinyLM()
    kept: list[Any] = []
    leaves = [_micro_batch(model, i, kept) for i in range(3)]
    assert all(leaf() is not None and leaf().grad is not None for leaf in leaves)  # type: ignore[union-attr]
    with pytest.raises(AssertionError, match=r"3 of 3 leaf\(s\) still alive"):
        assert_released(leaves, "leaf")
    with pytest.raises(AssertionError, match=r"holds 3 tensor\(s\)") as info:
        assert_no_graph(kept)
    for i in range(3):
        assert f"[{i}]['model_output']['log_probs']: SqueezeBackward1" in str(info.value)

    store = gradguard.guard([])
    leaves = [_micro_batch(model, i, store) for i in range(3)]
    assert_released(leaves, "leaf")
    assert_no_graph(store)
    assert len(store) == 3


# --------------------------------------------------------------------------- MemoryProbe


def test_probe_measures_a_kept_tensor_per_step_exactly() -> None:
    kept = []
    with MemoryProbe() as probe:
        for _ in range(5):
            kept.append(torch.randn(4096))  # 16384 bytes kept per iteration
            scratch = torch.ones(1000) * 2  # replaced every iteration: no growth
            probe.step()
    del scratch
    assert len(probe.readings) == 6  # the reading on entering, then one per step
    assert probe.growth_per_step == pytest.approx(16384, abs=1)
    assert [b - a for a, b in zip(probe.readings[1:], probe.readings[2:])] == [16384] * 4
    assert probe.peak >= max(probe.readings)
    assert probe.peak == max(probe.readings)  # CPU: the largest reading
    probe.assert_growth_below(16385)
    with pytest.raises(AssertionError, match=r"memory grew 16,384 bytes per iteration over 5 iterations") as info:
        probe.assert_growth_below(16000)
    assert "limit 16,000" in str(info.value)


def test_probe_sees_no_growth_when_nothing_is_kept() -> None:
    with MemoryProbe() as probe:
        for _ in range(5):
            scratch = torch.randn(4096) * 2
            probe.step()
    del scratch
    assert probe.growth_per_step == 0.0
    probe.assert_growth_below(0)
    assert probe.peak >= max(probe.readings) > 0


def test_probe_step_returns_the_reading() -> None:
    kept = []
    with MemoryProbe() as probe:
        kept.append(torch.empty(100, dtype=torch.float64))
        value = probe.step()
    assert value == probe.readings[-1] == 800


@pytest.mark.parametrize("steps", [0, 1])
def test_probe_needs_two_steps_to_measure_growth(steps: int) -> None:
    with MemoryProbe() as probe:
        for _ in range(steps):
            probe.step()
    with pytest.raises(AssertionError, match=rf"needs at least 2 step\(\) readings to measure growth, has {steps}"):
        probe.assert_growth_below(1e12)


def test_probe_used_before_entering_says_how_to_use_it() -> None:
    """It must not say "needs at least 2 step() readings ..., has -1"."""
    probe = MemoryProbe()
    for use in (probe.step, lambda: probe.assert_growth_below(1)):
        with pytest.raises(RuntimeError, match=r"before the probe was entered: use `with MemoryProbe\(\) as probe:`"):
            use()


def test_probe_measures_the_leak_and_the_guard() -> None:
    model = _TinyLM()
    _micro_batch(model, 0, [])  # warm-up: parameter grads and the checkpoint's lazy initialisation

    kept: list[Any] = []
    with MemoryProbe() as unguarded:
        for i in range(5):
            _micro_batch(model, i, kept)
            unguarded.step()
    # Each kept record pins its leaf and the leaf's grad, on top of its own tensors.
    assert unguarded.growth_per_step == pytest.approx(PIN_BYTES + RECORD_BYTES, abs=1)
    with pytest.raises(AssertionError, match=f"memory grew {PIN_BYTES + RECORD_BYTES:,} bytes per iteration"):
        unguarded.assert_growth_below(RECORD_BYTES + 0.01 * PIN_BYTES)

    store = gradguard.guard([])
    with MemoryProbe() as guarded:
        for i in range(5):
            _micro_batch(model, i, store)
            guarded.step()
    assert abs(guarded.growth_per_step - RECORD_BYTES) < 1  # only the record's own bytes
    guarded.assert_growth_below(RECORD_BYTES)
    assert guarded.peak < unguarded.peak
