"""The census: every live tensor that carries ``grad_fn`` and, when asked, every live optimizer, in one pass
over the collector's objects."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

from gradguard._heap.census import live_graph_tensors


class _Tagged(torch.Tensor):
    """A tensor subclass defined by a program."""


class _MyAdam(torch.optim.Adam):
    """An optimizer subclass defined by a program."""


class _Proxy:
    """An object that claims to be a tensor through ``__class__``."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return torch.Tensor

    grad_fn = "not a node"


def test_it_finds_graph_tensors_and_optimizers_of_any_subclass_and_nothing_else() -> None:
    layer = nn.Linear(3, 3)
    out = layer(torch.randn(2, 3))
    tagged = out.as_subclass(_Tagged)
    view = layer.weight.t()  # a view of a parameter: the parameter itself, seen through a view
    plain = torch.randn(4)  # no graph
    opt = _MyAdam(layer.parameters())
    sgd = torch.optim.SGD(layer.parameters(), lr=0.1)
    proxy = _Proxy()
    optimizers: list[Any] = []
    views: list[Any] = []
    found = live_graph_tensors(set(), optimizers, views=views)
    ids = {id(t) for t in found}
    assert id(out) in ids and id(tagged) in ids
    assert not {id(view), id(plain), id(layer.weight), id(layer.bias), id(proxy)} & ids
    assert any(node is view.grad_fn for node in views)
    assert {id(o) for o in optimizers} >= {id(opt), id(sgd)}
    assert all(isinstance(o, torch.optim.Optimizer) for o in optimizers)
    assert all(type(t) is not nn.Parameter for t in found)


def test_excluded_ids_are_left_out_and_young_reads_only_the_young_generations() -> None:
    layer = nn.Linear(3, 3)
    old = layer(torch.randn(2, 3))
    gc.collect()  # ``old`` is in the oldest generation now
    young = layer(torch.randn(2, 3))
    assert id(old) not in {id(t) for t in live_graph_tensors(set(), young=True)}
    assert id(young) in {id(t) for t in live_graph_tensors(set(), young=True)}
    assert id(old) not in {id(t) for t in live_graph_tensors({id(old)})}
    assert id(young) in {id(t) for t in live_graph_tensors({id(old)})}
