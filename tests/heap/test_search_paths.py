"""The heap search's climb: every target a root reaches gets a path, whatever level each met the objects on
its way at."""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator

import pytest
import torch
from _helpers import script_module

from gradguard._heap import holders, paths


class Record:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


@pytest.fixture
def module() -> Iterator[types.ModuleType]:
    with script_module("gradguard_test_search_paths_program") as program:
        yield program


def test_a_list_met_first_from_a_record_a_global_also_holds_is_climbed_for_the_older_ones(
    module: types.ModuleType,
) -> None:
    """The newest record is held by the list and by a global alias (``r = Record(...); RECS.append(r)``); the
    older ones' attributes live in a ``__dict__`` of their own (one level further from the list, as after
    anything read ``vars()`` of them). The list, met from the newest record and not climbed then (the alias
    held it), leads to the older ones one level later: its global must still be found."""
    x = torch.ones(2, requires_grad=True)
    module.RECS = [Record(x * (i + 1)) for i in range(4)]
    module.r = module.RECS[-1]
    for record in module.RECS[:-1]:
        vars(record)  # a __dict__ of its own
    found = holders.find_paths([record.loss for record in module.RECS])
    assert all(path is not None for path in found)
    spelled = [paths.spell(path) for path in found if path is not None]
    assert spelled[:3] == [f"{module.__name__}:RECS[{i}].loss" for i in range(3)]


def test_a_target_a_frame_local_holds_costs_no_pass_for_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gradients' pass over the heap (for a graph torch holds as a leaf's ``.grad``, which no object refers
    to) is made only for targets no referrer and no frame local holds: the program's current loss, held by
    its loop's variable alone, is found without it (it was one more pass over the heap at every audit)."""
    passes = []
    real = holders.live_tensors
    monkeypatch.setattr(holders, "live_tensors", lambda: passes.append(1) or real())
    x = torch.ones(2, requires_grad=True)
    loss = (x * 2).sum()
    (found,) = holders.find_paths([loss])
    assert found is not None and paths.spell(found).endswith("loss")
    assert passes == []
    p = torch.nn.Parameter(torch.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's create_graph warning, once a process
        (p * p).sum().backward(create_graph=True)  # p.grad keeps a graph: torch holds it, no object refers to it
    grad = p.grad
    assert grad is not None and grad.grad_fn is not None
    del grad
    targets = [p.grad]
    (found,) = holders.find_paths(targets, {id(targets)})
    assert passes == [1]
    assert found is not None and paths.spell(found).endswith("p.grad")
    p.grad = None  # the graph on p.grad refers to p: a cycle


class _Unreadable(torch.Tensor):
    """A tensor whose autograd state cannot be read, as a tensor the collector cleared while something kept
    it alive (its reading raises what torch raises for an undefined tensor)."""

    @property
    def is_leaf(self) -> bool:  # type: ignore[override]
        raise RuntimeError("cannot call get_autograd_meta() on undefined tensor")


def test_the_gradients_pass_steps_over_a_live_tensor_whose_autograd_state_cannot_be_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gradients' pass reads every live tensor: one without autograd state (the collector cleared it and
    it lives on) is no leaf whose ``.grad`` holds a target, and the search goes on past it."""
    unreadable = torch.Tensor._make_subclass(_Unreadable, torch.zeros(1))
    real = holders.live_tensors
    monkeypatch.setattr(holders, "live_tensors", lambda: [unreadable, *real()])
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2, requires_grad=True) * 2  # a graph torch holds as p's gradient, no object refers to it
    targets = [p.grad]
    (found,) = holders.find_paths(targets, {id(targets)})
    assert found is not None and paths.spell(found).endswith("p.grad")
    assert paths.leaf_grad(unreadable) is None
    p.grad = None
