"""A record is rebuilt exactly, or refused; never something different."""

from __future__ import annotations

import collections
import dataclasses
import types
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
import torch
from _helpers import grad_tensor
from torch.utils import _pytree

import gradguard
from gradguard import GradGuardError, detach_tree, find_graphs

# --------------------------------------------------------------------------------------------------
# Rebuilt exactly, or refused; never something different
# --------------------------------------------------------------------------------------------------


def test_chainmap_is_rebuilt_from_its_maps_not_through_its_constructor() -> None:
    """ChainMap(zip(...)) must not keep the zip object as its only map (reading the record then raised)."""
    cm = collections.ChainMap({"log_probs": grad_tensor()}, {"step": 7})
    out = detach_tree(cm)
    assert type(out) is collections.ChainMap and len(out.maps) == 2
    assert out["step"] == 7 and out["log_probs"].grad_fn is None
    assert out.maps[1] is cm.maps[1]  # the unchanged map is shared, not copied
    assert cm["log_probs"].grad_fn is not None  # the input is untouched


def test_mapping_whose_storage_is_an_attribute_is_never_mutated() -> None:
    """A MutableMapping keeping its items in ``self._d``; a shallow copy shares it."""

    class Result(MutableMapping):  # type: ignore[type-arg]
        def __init__(self, **kw: Any) -> None:
            self._d = dict(kw)

        def __getitem__(self, k: Any) -> Any:
            return self._d[k]

        def __setitem__(self, k: Any, v: Any) -> None:
            self._d[k] = v

        def __delitem__(self, k: Any) -> None:
            del self._d[k]

        def __iter__(self) -> Iterator[Any]:
            return iter(self._d)

        def __len__(self) -> int:
            return len(self._d)

    g = grad_tensor()
    r = Result(hidden=g, step=3)
    out = detach_tree(r)
    assert type(out) is Result and out is not r and out._d is not r._d
    assert out["hidden"].grad_fn is None and out["step"] == 3
    assert r["hidden"] is g  # the original keeps its graph


def test_attributes_and_slots_of_rebuilt_objects_are_kept() -> None:
    """Tensor attributes, namedtuple/tuple-subclass attributes, deque-subclass slots."""
    t = grad_tensor()
    t.tag = "chunk-3"  # type: ignore[attr-defined]
    assert detach_tree([t])[0].tag == "chunk-3"

    NT = collections.namedtuple("NT", "a b")

    class NTSub(NT):  # no __slots__: instances have a __dict__
        pass

    n = NTSub(grad_tensor(), 1)
    n.extra = "e"  # type: ignore[attr-defined]
    out_n = detach_tree(n)
    assert type(out_n) is NTSub and out_n.extra == "e" and out_n.a.grad_fn is None and out_n.b == 1

    class TL(tuple):  # type: ignore[type-arg]
        pass

    tl = TL([grad_tensor()])
    tl.note = "n"  # type: ignore[attr-defined]
    assert detach_tree(tl).note == "n"

    class DQ(collections.deque):  # type: ignore[type-arg]
        __slots__ = ("tag",)

    dq = DQ([grad_tensor()], maxlen=3)
    dq.tag = "t"
    out_dq = detach_tree(dq)
    assert type(out_dq) is DQ and out_dq.tag == "t" and out_dq.maxlen == 3


def test_subclass_overrides_are_not_run_when_rebuilding() -> None:
    """A non-idempotent __setitem__ and a partial __iter__ do not change what is rebuilt."""

    class Boxed(dict):  # type: ignore[type-arg]
        def __setitem__(self, k: Any, v: Any) -> None:
            super().__setitem__(k, v if isinstance(v, list) else [v])

    b = Boxed()
    b["step"] = 7
    b["out"] = grad_tensor()
    dict.__setitem__(b, "raw", 1)
    out = detach_tree(b)
    assert type(out) is Boxed and dict(out)["raw"] == 1 and dict(out)["step"] == [7]
    assert dict(out)["out"][0].grad_fn is None

    class Window(list):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[Any]:
            return iter(list.__getitem__(self, slice(0, 1)))

    w = Window([grad_tensor(), "keep-me", "and-me"])
    out_w = detach_tree(w)
    assert type(out_w) is Window and list.__len__(out_w) == 3
    assert list.__getitem__(out_w, slice(1, 3)) == ["keep-me", "and-me"]


def test_a_class_with_an_unhashable_metaclass_is_a_leaf() -> None:
    """Looking a class up must not hash it (`cls in frozenset`): an unhashable metaclass raised TypeError."""

    class Meta(type):
        def __eq__(cls, other: object) -> bool:
            return cls is other

        __hash__ = None  # type: ignore[assignment]

    class Odd(metaclass=Meta):
        pass

    odd = Odd()
    out = detach_tree([odd, grad_tensor()])
    assert out[0] is odd and out[1].grad_fn is None


def test_shared_references_stay_shared_and_are_counted_once() -> None:
    """One tensor referenced many times is detached once, and stays one object."""
    from gradguard._tree.walk import detach

    y = grad_tensor()
    r = detach_tree({"a": y, "b": y, "c": [y]})
    assert r["a"] is r["b"] is r["c"][0]
    sub = {"x": y}
    r2 = detach_tree([sub, sub, (sub,)])
    assert r2[0] is r2[1] is r2[2][0]
    many = detach([y] * 100_000)
    value, tensors = many
    assert tensors == 1 and len({id(t) for t in value}) == 1


def test_counts_survive_deep_nesting() -> None:
    """The count survives a deep input that makes the walk switch to its explicit stack (71, not 1)."""
    from gradguard._tree.walk import detach

    deep: Any = grad_tensor()
    for _ in range(70):
        deep = [deep, grad_tensor()]
    assert detach(deep)[1] == 71
    deeper: Any = grad_tensor()
    for _ in range(3000):
        deeper = {"a": deeper, "b": (grad_tensor(),)}
    assert detach(deeper)[1] == 3001


def test_dataclass_instance_state_is_walked_too() -> None:
    """A cached_property cache (in __dict__) carrying a graph is detached and found."""
    from functools import cached_property

    @dataclasses.dataclass
    class Foo:
        var: torch.Tensor

        @cached_property
        def doubled(self) -> torch.Tensor:
            return self.var * 2

    foo = Foo(grad_tensor())
    foo.doubled  # noqa: B018 - fills the cache
    assert [g.path for g in find_graphs(foo)] == [".var", ".doubled"]
    out = detach_tree(foo)
    assert out.var.grad_fn is None and out.doubled.grad_fn is None and "doubled" in vars(out)
    assert foo.doubled.grad_fn is not None


def test_pytree_context_tensors_are_detached_and_found() -> None:
    """A tensor in a registered pytree node's context."""

    class Custom:
        def __init__(self, x: Any, y: Any, z: Any) -> None:
            self.x, self.y, self.z = x, y, z

    _pytree.register_pytree_node(Custom, lambda f: ([f.x, f.y], f.z), lambda xy, z: Custom(xy[0], xy[1], z))
    try:
        t, u = grad_tensor(), grad_tensor()
        obj = Custom(t, torch.ones(1), u)
        assert [g.path for g in find_graphs(obj)] == ["[0]", ".<pytree context>"]
        out = detach_tree(obj)
        assert out.x.grad_fn is None and out.z.grad_fn is None
        shared = detach_tree(Custom(t, torch.ones(1), t))
        assert shared.x is shared.z  # one tensor, one replacement
    finally:
        _pytree.SUPPORTED_NODES.pop(Custom)

    @dataclasses.dataclass
    class ACustomPytree:  # the case of torch's test_pytree: a dataclass, its state walked whole
        x: Any
        y: Any
        z: Any

    _pytree.register_pytree_node(
        ACustomPytree, lambda f: ([f.x, f.y], f.z), lambda xy, z: ACustomPytree(xy[0], xy[1], z)
    )
    try:
        t = grad_tensor()
        out = detach_tree(ACustomPytree(t, t, t))
        assert out.z.grad_fn is None and out.x is out.y is out.z
    finally:
        _pytree.SUPPORTED_NODES.pop(ACustomPytree)


@pytest.mark.skipif(
    not hasattr(_pytree, "register_dataclass"), reason="torch.utils._pytree.register_dataclass is from torch 2.5"
)
def test_a_pytree_registered_dataclass_keeps_its_init_false_field() -> None:
    """A dataclass registered with pytree's register_dataclass (which calls __init__) keeps init=False fields."""

    @dataclasses.dataclass
    class Data:
        a: torch.Tensor
        b: str = "moo"
        d: str = dataclasses.field(init=False, default="")

    _pytree.register_dataclass(Data)
    try:
        d = Data(grad_tensor(), "b")
        d.d = "set-later"
        out = detach_tree(d)
        assert (out.b, out.d) == ("b", "set-later") and out.a.grad_fn is None
    finally:
        _pytree.SUPPORTED_NODES.pop(Data)


def test_containers_the_walk_enters_and_those_it_only_inspects() -> None:
    """UserList and SimpleNamespace are rebuilt; sets and dict keys are found, never replaced."""
    user_list = collections.UserList([grad_tensor()])
    assert detach_tree(user_list).data[0].grad_fn is None and find_graphs(user_list)[0].path == ".data[0]"
    ns = types.SimpleNamespace(o=grad_tensor())
    assert detach_tree(ns).o.grad_fn is None and find_graphs(ns)[0].path == ".o"
    key = grad_tensor()
    for sealed, path in (({key}, "{#0}"), ({key: 1}, ".keys()[0]"), (frozenset({key}), "{#0}")):
        assert detach_tree(sealed) is sealed  # tensors hash by identity: a copy would be another set
        assert [g.path for g in find_graphs(sealed)] == [path]


def test_objects_no_rule_knows_are_inspected_not_rebuilt() -> None:
    class Holder:
        def __init__(self) -> None:
            self.t = grad_tensor()

    h = Holder()
    assert detach_tree([h])[0] is h
    assert [g.path for g in find_graphs([h])] == ["[0].t"]
    assert find_graphs([len, Holder, types]) == []  # code is never looked into


def test_run_time_types_are_not_kept_alive_by_the_walk() -> None:
    """The spec cache must not hold every record type ever walked."""
    import gc
    import weakref

    refs = []
    for i in range(50):
        cls = collections.namedtuple(f"R{i}", "a")  # type: ignore[misc]
        detach_tree(cls(grad_tensor()))
        refs.append(weakref.ref(cls))
        del cls
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


def test_registering_a_type_twice_needs_replace() -> None:
    class Box:
        def __init__(self, x: Any) -> None:
            self.x = x

    gradguard.register_container(Box, lambda b: ([b.x], None), lambda c, _: Box(c[0]))
    try:
        with pytest.raises(GradGuardError, match="already registered; pass replace=True"):
            gradguard.register_container(Box, lambda b: ([b.x], None), lambda c, _: Box(c[0]))
        gradguard.register_container(Box, lambda b: ([], None), lambda c, _: Box(None), replace=True)
        b = Box(grad_tensor())
        assert detach_tree(b) is b  # the replacement's flatten sees no children
    finally:
        gradguard.unregister_container(Box)


def test_private_and_shadowed_slots_are_kept() -> None:
    """Slots are read and written through the descriptor of the class that declares them: a mangled
    ``__x`` slot, and a slot a subclass shadows with a property, survive a rebuild."""

    class Private(list):  # type: ignore[type-arg]
        __slots__ = ("__x", "y")

    p = Private([grad_tensor()])
    p._Private__x = "private"  # type: ignore[attr-defined]
    p.y = grad_tensor()  # type: ignore[attr-defined]
    out = detach_tree(p)
    assert out._Private__x == "private" and out.y.grad_fn is None and out[0].grad_fn is None
    assert [g.path for g in find_graphs(p)] == ["[0]", ".y"]

    class Holder(list):  # type: ignore[type-arg]
        __slots__ = ("v",)

    class Shadowing(Holder):
        v = property(lambda self: "shadowed")  # type: ignore[assignment]

    s = Shadowing([grad_tensor()])
    Holder.v.__set__(s, "real")  # type: ignore[attr-defined]
    assert Holder.v.__get__(detach_tree(s)) == "real"  # type: ignore[attr-defined]
