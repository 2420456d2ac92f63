"""detach_tree on cycles and on any depth: terminates, keeps sharing, never confuses objects."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _helpers import assert_detached_from, grad_tensor, plain_tensor
from _shapes import Plain, Point

import gradguard
from gradguard import GradGuardError, detach_tree, find_graphs

# --------------------------------------------------------------------------------------------------
# robustness: cycles
# --------------------------------------------------------------------------------------------------


def test_self_referencing_list_without_grad_returns_itself() -> None:
    lst: list[Any] = [1, plain_tensor()]
    lst.append(lst)
    assert detach_tree(lst) is lst
    assert find_graphs(lst) == []


def test_self_referencing_dict_without_grad_returns_itself() -> None:
    d: dict[str, Any] = {"a": plain_tensor(), "n": [1]}
    d["self"] = d
    d["n"].append(d)
    assert detach_tree(d) is d


def test_cycle_elsewhere_does_not_block_detaching() -> None:
    cyc: list[Any] = [1]
    cyc.append(cyc)
    g = grad_tensor()
    out = detach_tree({"cyc": cyc, "g": g})
    assert out["cyc"] is cyc
    assert_detached_from(out["g"], g)


@pytest.mark.parametrize("shape", ["list", "dict", "indirect"])
def test_self_referencing_container_with_grad_raises(shape: str) -> None:
    g = grad_tensor()
    obj: Any
    if shape == "list":
        obj = [g]
        obj.append(obj)
    elif shape == "dict":
        obj = {"g": g}
        obj["me"] = obj
    else:
        a: list[Any] = []
        b = {"a": a, "g": g}
        a.append(b)
        obj = [a]
    with pytest.raises(GradGuardError):
        detach_tree(obj)
    # find_graphs terminates on it and reports the tensor once
    recs = find_graphs(obj)
    assert len(recs) == 1 and recs[0].grad_fn == "MulBackward0"


# --------------------------------------------------------------------------------------------------
# robustness: depth
# --------------------------------------------------------------------------------------------------

DEEP = 20_000


def _nest(kind: str, bottom: Any, n: int = DEEP) -> Any:
    obj = bottom
    for i in range(n):
        k = kind if kind != "mixed" else ("list", "dict", "tuple", "namedtuple", "deque", "dataclass")[i % 6]
        if k == "list":
            obj = [obj]
        elif k == "dict":
            obj = {"k": obj}
        elif k == "tuple":
            obj = (obj, i)
        elif k == "namedtuple":
            obj = Point(obj, i, None)
        elif k == "deque":
            obj = collections.deque([obj])
        else:
            obj = Plain(obj, i, None)
    return obj


def _descend(obj: Any) -> Iterator[Any]:
    """Yield each level from the top down to the bottom of a _nest structure."""
    while True:
        yield obj
        if isinstance(obj, dict):
            obj = obj["k"]
        elif isinstance(obj, (list, tuple, collections.deque)):
            obj = obj[0]
        elif isinstance(obj, Plain):
            obj = obj.x
        else:
            return


def _kinds(obj: Any) -> list[type]:
    return [type(o) for o in _descend(obj)]


@pytest.mark.parametrize("kind", ["list", "dict", "tuple", "mixed"])
def test_deep_nesting_detach(kind: str) -> None:
    g = grad_tensor()
    obj = _nest(kind, g)
    out = detach_tree(obj)
    in_levels = list(_descend(obj))
    out_levels = list(_descend(out))
    assert len(in_levels) == len(out_levels) == DEEP + 1
    assert [type(o) for o in in_levels] == [type(o) for o in out_levels]
    assert all(a is not b for a, b in zip(in_levels[:-1], out_levels[:-1]))
    assert in_levels[-1] is g  # input untouched
    assert_detached_from(out_levels[-1], g)
    if kind == "tuple":
        assert [o[1] for o in out_levels[:-1]] == [o[1] for o in in_levels[:-1]]


@pytest.mark.parametrize("kind", ["list", "dict", "tuple", "mixed"])
def test_deep_nesting_unchanged_is_identity(kind: str) -> None:
    obj = _nest(kind, plain_tensor())
    assert detach_tree(obj) is obj


@pytest.mark.parametrize("kind", ["list", "dict", "tuple", "mixed"])
def test_deep_nesting_find_graphs(kind: str) -> None:
    g = grad_tensor()
    obj = _nest(kind, {"bottom": g})
    recs = find_graphs(obj)
    assert len(recs) == 1
    rec = recs[0]
    assert rec.grad_fn == "MulBackward0" and rec.shape == (3,)
    assert rec.path.endswith("['bottom']")
    if kind == "list":
        assert rec.path == "[0]" * DEEP + "['bottom']"
    elif kind == "dict":
        assert rec.path == "['k']" * DEEP + "['bottom']"
    elif kind == "tuple":
        assert rec.path == "[0]" * DEEP + "['bottom']"


def test_deep_shared_subobjects_stay_shared() -> None:
    g = grad_tensor()
    shared = {"g": g, "n": 1}
    also_shared = [plain_tensor()]  # unchanged, shared
    bottom = [shared, shared, also_shared, also_shared]
    obj = _nest("list", bottom, 500)
    # the same dict referenced again higher up
    obj = {"top": shared, "deep": obj}
    out = detach_tree(obj)
    new_bottom = out["deep"]
    for _ in range(500):
        new_bottom = new_bottom[0]
    assert type(new_bottom) is list and len(new_bottom) == 4
    assert new_bottom[0] is new_bottom[1]
    assert new_bottom[0] is out["top"]
    assert new_bottom[0] is not shared
    assert new_bottom[2] is also_shared and new_bottom[3] is also_shared
    assert_detached_from(new_bottom[0]["g"], g)
    assert shared["g"] is g


def test_deep_transient_children_from_flatten_not_confused() -> None:
    """A flatten that builds fresh child containers must not let the deep walk confuse them.

    The iterative walk remembers finished objects by ``id``; if it let a transient child die,
    a later transient could reuse the id and receive another object's result.
    """

    class Pair:
        def __init__(self, a: Any, b: Any) -> None:
            self.a, self.b = a, b

    gradguard.register_container(Pair, lambda p: ([[p.a], [p.b]], None), lambda ch, _: Pair(ch[0][0], ch[1][0]))
    try:
        leaves = [torch.full((1,), float(i), requires_grad=True) * 1 for i in range(60)]
        pairs = [Pair(t, torch.tensor([100.0 + i])) for i, t in enumerate(leaves)]
        obj = _nest("list", pairs, 100)  # deep enough for the iterative walk
        out = detach_tree(obj)
        for _ in range(100):
            out = out[0]
        assert [p.a.item() for p in out] == [float(i) for i in range(60)]
        assert [p.b.item() for p in out] == [100.0 + i for i in range(60)]
        assert all(p.a.grad_fn is None for p in out)
    finally:
        gradguard.unregister_container(Pair)


@pytest.mark.parametrize("changed", [False, True])
def test_a_container_reached_twice_at_every_level_is_walked_once(changed: bool) -> None:
    """Each level holds the level below twice (as a dict holding itself and a list of itself does):
    without remembering what it walked, the walk visits the bottom 2**levels times and never ends."""
    flattened: list[int] = []

    class Node:
        def __init__(self, left: Any, right: Any) -> None:
            self.left, self.right = left, right

    def flatten(node: Node) -> tuple[list[Any], None]:
        flattened.append(id(node))
        return [node.left, node.right], None

    gradguard.register_container(Node, flatten, lambda children, _: Node(*children))
    try:
        levels = 24
        obj: Any = grad_tensor() if changed else plain_tensor()
        for _ in range(levels):
            obj = [Node(obj, obj)]  # an exact list above each Node: both walk paths are exercised
        out = detach_tree(obj)
        assert len(flattened) == levels
        assert (out is obj) is not changed
        for _ in range(levels):
            assert out[0].left is out[0].right
            out = out[0].left
        assert out.grad_fn is None
    finally:
        gradguard.unregister_container(Node)


def test_a_dict_holding_itself_twice_terminates() -> None:
    d: dict[str, Any] = {"a": plain_tensor(), "n": [1]}
    d["self"] = d
    d["n"].append(d)
    d["m"] = [[d, d], d]
    assert detach_tree(d) is d
    g = grad_tensor()
    d["g"] = g
    with pytest.raises(GradGuardError, match="contains itself"):
        detach_tree(d)
