"""detach_tree: every container kind, tensors, and laziness at every level."""

from __future__ import annotations

import collections
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import pytest
import torch
from _helpers import assert_detached_from, grad_tensor, plain_tensor
from _shapes import Plain, Point, PytreeBox
from torch import nn

from gradguard import detach_tree

# --------------------------------------------------------------------------------------------------
# container types
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: Any
    y: Any
    z: Any


@dataclasses.dataclass(frozen=True, slots=True)
class FrozenSlots:
    x: Any
    y: Any
    z: Any


@dataclasses.dataclass
class WithInitFalse:
    x: Any
    y: Any
    z: Any
    derived: str = dataclasses.field(init=False)
    unset: Any = dataclasses.field(init=False)  # no default: never assigned

    def __post_init__(self) -> None:
        self.derived = "from-post-init"


post_init_calls = collections.Counter()


@dataclasses.dataclass
class CountsPostInit:
    x: Any
    y: Any
    z: Any

    def __post_init__(self) -> None:
        post_init_calls["n"] += 1


class AttrDict(dict):
    """A user dict subclass carrying an attribute."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = "user-attr"


class FrozenMap(Mapping):
    """A user Mapping that cannot be mutated (rebuilt through its constructor)."""

    def __init__(self, items: Any = ()) -> None:
        self._d = dict(items)

    def __getitem__(self, k: Any) -> Any:
        return self._d[k]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


class AttrStore(MutableMapping):
    """A user MutableMapping backed by an attribute dict (a shallow copy would share it)."""

    def __init__(self, items: Any = ()) -> None:
        self._d = dict(items)

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


class TaggedUserDict(collections.UserDict):
    pass


def _tagged_user_dict(x: Any, y: Any, z: Any) -> TaggedUserDict:
    d = TaggedUserDict(x=x, y=y, z=z)
    d.tag = "user-attr"
    return d


def _mapping_children(m: Any) -> list[Any]:
    return [m["x"], m["y"], m["z"]]


def _attr_children(o: Any) -> list[Any]:
    return [o.x, o.y, o.z]


def _default_factory_kept(old: Any, new: Any) -> None:
    assert new.default_factory is old.default_factory is list


def _attr_kept(old: Any, new: Any) -> None:
    assert new.tag == "user-attr"
    assert new.__dict__ == old.__dict__


def _attr_kept_tag(new: Any) -> None:
    assert new.tag == "user-attr"


def _deque_kept(old: Any, new: Any) -> None:
    assert new.maxlen == old.maxlen == 7


def _init_false_kept(old: Any, new: Any) -> None:
    assert new.derived == "from-post-init"
    assert not hasattr(new, "unset")


def _label_kept(old: Any, new: Any) -> None:
    assert new.label == old.label


def _nothing(old: Any, new: Any) -> None:
    pass


# name -> (build(x, y, z), children(obj), extra check(old, new))
CONTAINERS: dict[str, tuple[Callable[..., Any], Callable[[Any], list[Any]], Callable[[Any, Any], None]]] = {
    "dict": (lambda x, y, z: {"x": x, "y": y, "z": z}, _mapping_children, _nothing),
    "OrderedDict": (
        lambda x, y, z: collections.OrderedDict([("x", x), ("y", y), ("z", z)]),
        _mapping_children,
        _nothing,
    ),
    "defaultdict": (
        lambda x, y, z: collections.defaultdict(list, {"x": x, "y": y, "z": z}),
        _mapping_children,
        _default_factory_kept,
    ),
    "dict-subclass": (lambda x, y, z: AttrDict(x=x, y=y, z=z), _mapping_children, _attr_kept),
    "immutable-Mapping": (
        lambda x, y, z: FrozenMap([("x", x), ("y", y), ("z", z)]),
        _mapping_children,
        _nothing,
    ),
    "mutable-Mapping": (
        lambda x, y, z: AttrStore([("x", x), ("y", y), ("z", z)]),
        _mapping_children,
        _nothing,
    ),
    "UserDict-subclass": (_tagged_user_dict, _mapping_children, lambda old, new: _attr_kept_tag(new)),
    "MappingProxyType": (
        lambda x, y, z: types.MappingProxyType({"x": x, "y": y, "z": z}),
        _mapping_children,
        _nothing,
    ),
    "list": (lambda x, y, z: [x, y, z], list, _nothing),
    "tuple": (lambda x, y, z: (x, y, z), list, _nothing),
    "namedtuple": (Point, list, _nothing),
    "deque": (lambda x, y, z: collections.deque([x, y, z], maxlen=7), list, _deque_kept),
    "dataclass": (Plain, _attr_children, _nothing),
    "frozen-dataclass": (Frozen, _attr_children, _nothing),
    "slots-frozen-dataclass": (FrozenSlots, _attr_children, _nothing),
    "init-false-dataclass": (WithInitFalse, _attr_children, _init_false_kept),
    "pytree-registered": (
        lambda x, y, z: PytreeBox(x, y, z, label="L"),
        _attr_children,
        _label_kept,
    ),
}


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_unchanged_container_is_returned_as_is(kind: str) -> None:
    build, children, _ = CONTAINERS[kind]
    sub = [plain_tensor(), {"k": plain_tensor()}]
    obj = build(plain_tensor(), 1.5, sub)
    assert detach_tree(obj) is obj
    # A leaf tensor that does not require grad and a tensor-free payload: still unchanged.
    obj2 = build(torch.zeros(2), "text", None)
    assert detach_tree(obj2) is obj2


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_changed_container_is_new_object_of_same_type(kind: str) -> None:
    build, children, extra = CONTAINERS[kind]
    g = grad_tensor()
    p = plain_tensor()
    sub = {"unchanged": [plain_tensor(), 3]}
    obj = build(g, p, sub)
    before = list(children(obj))

    out = detach_tree(obj)

    assert out is not obj
    assert type(out) is type(obj)
    new_x, new_y, new_z = children(out)
    assert_detached_from(new_x, g)
    assert new_y is p  # a tensor that does not require grad is the same object
    assert new_z is sub  # an unchanged sibling branch is shared
    # the input is never mutated
    after = children(obj)
    assert all(a is b for a, b in zip(before, after))
    assert obj_tensor_requires_grad(after[0])
    extra(obj, out)
    if isinstance(obj, Mapping):
        assert list(out.keys()) == list(obj.keys())


def obj_tensor_requires_grad(t: torch.Tensor) -> bool:
    return t.requires_grad and t.grad_fn is not None


@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_change_deep_inside_container(kind: str) -> None:
    build, children, _ = CONTAINERS[kind]
    g = grad_tensor()
    shared_sibling = ("s", plain_tensor())
    obj = build(1, shared_sibling, {"deep": [0, (g, "leaf")]})
    out = detach_tree(obj)
    assert type(out) is type(obj)
    x, y, z = children(out)
    assert x == 1
    assert y is shared_sibling
    assert z is not children(obj)[2]
    assert z["deep"][0] == 0
    assert_detached_from(z["deep"][1][0], g)
    assert z["deep"][1][1] == "leaf"
    assert children(obj)[2]["deep"][1][0] is g


def test_immutable_mapping_rebuilt_through_constructor() -> None:
    g = grad_tensor()
    m = FrozenMap([("a", g), ("b", 2)])
    out = detach_tree(m)
    assert type(out) is FrozenMap
    assert out is not m
    assert out["b"] == 2
    assert_detached_from(out["a"], g)
    assert m["a"] is g


def test_mapping_proxy_stays_read_only() -> None:
    g = grad_tensor()
    mp = types.MappingProxyType({"a": g})
    out = detach_tree(mp)
    assert type(out) is types.MappingProxyType
    with pytest.raises(TypeError):
        out["a"] = 1  # type: ignore[index]
    assert_detached_from(out["a"], g)


def test_defaultdict_default_factory_still_works() -> None:
    d = collections.defaultdict(list, {"a": grad_tensor()})
    out = detach_tree(d)
    out["missing"].append(1)
    assert out["missing"] == [1]
    assert "missing" not in d


def test_post_init_does_not_run_again() -> None:
    post_init_calls.clear()
    g = grad_tensor()
    obj = CountsPostInit(g, 2, 3)
    assert post_init_calls["n"] == 1
    out = detach_tree(obj)
    assert type(out) is CountsPostInit
    assert_detached_from(out.x, g)
    assert post_init_calls["n"] == 1


def test_frozen_dataclass_result_still_frozen() -> None:
    out = detach_tree(Frozen(grad_tensor(), 1, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.x = 0  # type: ignore[misc]
    out2 = detach_tree(FrozenSlots(grad_tensor(), 1, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        out2.x = 0  # type: ignore[misc]
    assert not hasattr(out2, "__dict__")


def test_init_false_field_with_value_is_detached() -> None:
    g = grad_tensor()
    obj = WithInitFalse(1, 2, 3)
    obj.unset = g  # an init=False field holding a tensor
    out = detach_tree(obj)
    assert_detached_from(out.unset, g)
    assert out.derived == "from-post-init"
    assert obj.unset is g


def test_deque_subclass_keeps_maxlen_and_attributes() -> None:
    class TaggedDeque(collections.deque):
        pass

    d = TaggedDeque([grad_tensor(), 1], maxlen=4)
    d.tag = "kept"
    out = detach_tree(d)
    assert type(out) is TaggedDeque
    assert out.maxlen == 4
    assert out.tag == "kept"
    assert out[1] == 1
    assert not out[0].requires_grad
    assert d[0].requires_grad


def test_list_and_tuple_subclasses() -> None:
    class MyList(list):
        pass

    class MyTuple(tuple):
        pass

    g = grad_tensor()
    ml = MyList([g, 1])
    ml.tag = "t"
    out = detach_tree(ml)
    assert type(out) is MyList and out.tag == "t" and out[1] == 1
    assert_detached_from(out[0], g)
    assert ml[0] is g
    mt = MyTuple((g, 1))
    out_t = detach_tree(mt)
    assert type(out_t) is MyTuple and out_t[1] == 1
    assert_detached_from(out_t[0], g)


def test_return_types() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    r = torch.max(x, 0)
    out = detach_tree(r)
    assert type(out) is type(r)
    assert_detached_from(out.values, r.values)
    assert out.indices is r.indices  # integer indices never require grad
    assert r.values.requires_grad
    # unchanged return_types come back as-is
    with torch.no_grad():
        r2 = torch.max(x, 0)
    assert detach_tree(r2) is r2
    # nested
    rec = {"m": r, "n": [r2]}
    out_rec = detach_tree(rec)
    assert out_rec["n"] is rec["n"]
    assert type(out_rec["m"]) is type(r)


def test_namedtuple_keeps_fields_and_methods() -> None:
    g = grad_tensor()
    out = detach_tree(Point(g, 1, 2))
    assert out._fields == ("x", "y", "z")
    assert out._replace(y=5).y == 5
    assert_detached_from(out.x, g)


# --------------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------------


def test_tensor_not_requiring_grad_is_same_object() -> None:
    t = plain_tensor()
    assert detach_tree(t) is t
    assert detach_tree([t])[0] is t
    with torch.no_grad():
        u = torch.ones(2, requires_grad=True) * 3
    assert detach_tree(u) is u


def test_non_leaf_tensor_detached_top_level() -> None:
    g = grad_tensor(5)
    out = detach_tree(g)
    assert_detached_from(out, g)
    assert g.requires_grad and g.grad_fn is not None


def test_leaf_requiring_grad_is_kept() -> None:
    """A leaf holds no graph: detaching it would free nothing and cut it from its .grad."""
    leaf = torch.randn(4, requires_grad=True)
    rec = {"leaf": leaf}
    assert detach_tree(rec) is rec
    assert detach_tree(leaf) is leaf and leaf.requires_grad


def test_parameter_is_kept_with_its_type_and_grad() -> None:
    p = nn.Parameter(torch.randn(3, 2))
    (p * 3).sum().backward()
    for out in (detach_tree(p), detach_tree({"p": p})["p"], detach_tree([p])[0], detach_tree((p,))[0]):
        assert out is p and isinstance(out, nn.Parameter) and out.grad is p.grad


def test_detached_view_shares_storage() -> None:
    base = torch.randn(10, requires_grad=True) * 1
    view = base[2:7]
    out = detach_tree([view])[0]
    assert_detached_from(out, view)
    assert out.storage_offset() == view.storage_offset()
    assert out.stride() == view.stride()


def test_tensor_dict_keys_left_alone() -> None:
    # only values are walked: a tensor used as a key stays the very same key object
    key = grad_tensor()
    v = grad_tensor()
    out = detach_tree({key: v})
    ((k2, v2),) = out.items()
    assert k2 is key and key.requires_grad
    assert_detached_from(v2, v)


# --------------------------------------------------------------------------------------------------
# laziness across levels
# --------------------------------------------------------------------------------------------------


def test_identity_at_every_level_when_unchanged() -> None:
    rec = {
        "a": [1, (plain_tensor(), {"b": [plain_tensor()]})],
        "c": Point(1, [2], {"d": plain_tensor()}),
        "e": collections.deque([plain_tensor()]),
        "f": Plain(plain_tensor(), "s", None),
    }
    assert detach_tree(rec) is rec


def test_changed_path_rebuilt_siblings_shared_at_every_level() -> None:
    g = grad_tensor()
    leaf_list = [plain_tensor()]
    sib_tuple = (plain_tensor(), "x")
    sib_nt = Point(1, 2, plain_tensor())
    sib_dc = Plain(1, 2, 3)
    inner = {"g": g, "keep": leaf_list}
    mid = [sib_tuple, inner, sib_nt]
    rec = {"mid": mid, "dc": sib_dc, "n": 1.5}

    out = detach_tree(rec)

    assert out is not rec and type(out) is dict
    assert out["dc"] is sib_dc
    assert out["n"] == 1.5
    assert out["mid"] is not mid and type(out["mid"]) is list
    assert out["mid"][0] is sib_tuple
    assert out["mid"][2] is sib_nt
    assert out["mid"][1] is not inner
    assert out["mid"][1]["keep"] is leaf_list
    assert_detached_from(out["mid"][1]["g"], g)
    # input untouched at every level
    assert rec["mid"] is mid and mid[1] is inner and inner["g"] is g
    assert list(rec) == ["mid", "dc", "n"] and list(inner) == ["g", "keep"]


def test_input_never_mutated_deep_snapshot() -> None:
    g1, g2 = grad_tensor(), torch.randn(2, requires_grad=True)
    rec = {
        "x": [g1, {"y": (g2, 1)}],
        "nt": Point(g1, "a", [g2]),
        "dq": collections.deque([g2, 3], maxlen=5),
        "dc": Frozen(g1, 2, {"z": g2}),
        "od": collections.OrderedDict(a=g1),
    }

    def snapshot(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return ("T", id(o), o.requires_grad, o.grad_fn)
        if isinstance(o, Mapping):
            return (type(o), id(o), [(k, snapshot(v)) for k, v in o.items()])
        if isinstance(o, (list, tuple, collections.deque)):
            return (type(o), id(o), [snapshot(v) for v in o])
        if dataclasses.is_dataclass(o):
            return (type(o), id(o), [snapshot(getattr(o, f.name)) for f in dataclasses.fields(o)])
        return o

    before = snapshot(rec)
    out = detach_tree(rec)
    assert snapshot(rec) == before
    assert snapshot(out) != before
