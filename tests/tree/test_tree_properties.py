"""Property tests: detach_tree and find_graphs on random nested structures."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradguard import detach_tree, find_graphs

POOL = 6  # tensors per example; index % 3 -> 0: plain, 1: leaf requiring grad, 2: carries grad_fn


class NT(NamedTuple):
    a: Any
    b: Any


@dataclasses.dataclass
class DC:
    a: Any
    b: Any


@dataclasses.dataclass(frozen=True)
class FDC:
    a: Any
    b: Any


# A structure is described first (hypothesis shrinks descriptions well), then built with fresh
# tensors, so tensors can be shared between positions (the pool).
_atoms = st.one_of(
    st.tuples(st.just("tensor"), st.integers(0, POOL - 1)),
    st.tuples(st.just("atom"), st.one_of(st.floats(allow_nan=False), st.text(max_size=3), st.integers(), st.none())),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    seq = st.lists(children, max_size=4)
    return st.one_of(
        st.tuples(st.sampled_from(["list", "tuple", "deque"]), seq),
        st.tuples(st.sampled_from(["dict", "odict"]), st.dictionaries(st.text(max_size=2), children, max_size=4)),
        st.tuples(st.sampled_from(["nt", "dc", "fdc"]), st.tuples(children, children)),
    )


descriptions = st.recursive(_atoms, _containers, max_leaves=25)


def make_pool() -> list[torch.Tensor]:
    pool = []
    for i in range(POOL):
        base = torch.full((2,), float(i))
        if i % 3 == 0:
            pool.append(base)
        elif i % 3 == 1:
            pool.append(base.requires_grad_())
        else:
            pool.append(base.requires_grad_() * 3)
    return pool


def build(desc: Any, pool: list[torch.Tensor]) -> Any:
    kind, payload = desc
    if kind == "tensor":
        return pool[payload]
    if kind == "atom":
        return payload
    if kind == "list":
        return [build(d, pool) for d in payload]
    if kind == "tuple":
        return tuple(build(d, pool) for d in payload)
    if kind == "deque":
        return collections.deque([build(d, pool) for d in payload], maxlen=len(payload) + 3)
    if kind == "dict":
        return {k: build(d, pool) for k, d in payload.items()}
    if kind == "odict":
        return collections.OrderedDict((k, build(d, pool)) for k, d in payload.items())
    cls = {"nt": NT, "dc": DC, "fdc": FDC}[kind]
    return cls(build(payload[0], pool), build(payload[1], pool))


def children(obj: Any) -> list[tuple[Any, Any]] | None:
    """(label, child) pairs of a container built by ``build``; None for a leaf."""
    if isinstance(obj, Mapping):
        return list(obj.items())
    if isinstance(obj, (list, tuple, collections.deque)):
        return list(enumerate(obj))
    if dataclasses.is_dataclass(obj):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return None


def tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    kids = children(obj)
    return [] if kids is None else [t for _, c in kids for t in tensors(c)]


def needs_detach(obj: Any) -> bool:
    return any(t.grad_fn is not None for t in tensors(obj))


def snapshot(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return ("T", id(obj), obj.requires_grad, obj.grad_fn)
    kids = children(obj)
    if kids is None:
        return ("A", obj)
    extra = obj.maxlen if isinstance(obj, collections.deque) else None
    return (type(obj), id(obj), extra, [(lab, snapshot(c)) for lab, c in kids])


def check_pair(old: Any, new: Any) -> None:
    """Structure and values equal; unchanged subtrees identical, changed ones rebuilt."""
    assert type(new) is type(old)
    if isinstance(old, torch.Tensor):
        assert new.grad_fn is None
        assert torch.equal(new.detach(), old.detach())
        assert new.untyped_storage().data_ptr() == old.untyped_storage().data_ptr()
        assert (new is old) == (old.grad_fn is None)  # leaves, even requiring grad, are kept
        return
    old_kids = children(old)
    if old_kids is None:
        assert new is old or new == old
        return
    if needs_detach(old):
        assert new is not old
    else:
        assert new is old
    new_kids = children(new)
    assert new_kids is not None
    assert [lab for lab, _ in old_kids] == [lab for lab, _ in new_kids]
    if isinstance(old, collections.deque):
        assert new.maxlen == old.maxlen
    for (_, o), (_, n) in zip(old_kids, new_kids):
        check_pair(o, n)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(descriptions)
def test_detach_tree_properties(desc: Any) -> None:
    pool = make_pool()
    obj = build(desc, pool)
    before = snapshot(obj)

    out = detach_tree(obj)

    assert not any(t.grad_fn is not None for t in tensors(out))
    assert (out is obj) == (not needs_detach(obj))
    check_pair(obj, out)
    assert snapshot(obj) == before  # the input is not mutated
    assert detach_tree(out) is out  # idempotent: nothing left to detach


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(descriptions)
def test_find_graphs_counts_distinct_graph_tensors(desc: Any) -> None:
    pool = make_pool()
    obj = build(desc, pool)
    with_graph = {id(t) for t in tensors(obj) if t.grad_fn is not None}
    recs = find_graphs(obj)
    assert len(recs) == len(with_graph)
    assert len({r.path for r in recs}) == len(recs)
    assert all(r.grad_fn == "MulBackward0" and r.shape == (2,) for r in recs)
    # every path is a readable expression that leads back to a distinct tensor with a graph
    found = [eval("obj" + r.path, {"obj": obj}) for r in recs]  # noqa: S307 - our own paths
    assert {id(t) for t in found} == with_graph
    assert find_graphs(detach_tree(obj)) == []
