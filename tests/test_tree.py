"""detach_tree: every container kind, laziness, the registry, and robustness (depth, cycles, sharing)."""

from __future__ import annotations

import collections
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.utils import _pytree

import gradguard
from gradguard import GradGuardError, detach_tree, find_graphs

# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def grad_tensor(n: int = 3) -> torch.Tensor:
    """A non-leaf tensor carrying grad_fn."""
    return torch.arange(float(n), requires_grad=True) * 2


def plain_tensor(n: int = 3) -> torch.Tensor:
    return torch.arange(float(n)) + 10


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def assert_detached_from(new: Any, old: torch.Tensor) -> None:
    assert isinstance(new, torch.Tensor)
    assert new is not old
    assert not new.requires_grad
    assert new.grad_fn is None
    assert storage_ptr(new) == storage_ptr(old)
    assert new.data_ptr() == old.data_ptr()
    assert torch.equal(new, old.detach())


# --------------------------------------------------------------------------------------------------
# container types
# --------------------------------------------------------------------------------------------------


class Point(NamedTuple):
    x: Any
    y: Any
    z: Any


@dataclasses.dataclass
class Plain:
    x: Any
    y: Any
    z: Any


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


class PytreeBox:
    """Registered with torch.utils._pytree (module-level, once)."""

    def __init__(self, x: Any, y: Any, z: Any, label: str = "box") -> None:
        self.x, self.y, self.z, self.label = x, y, z, label


_pytree.register_pytree_node(
    PytreeBox,
    lambda b: ([b.x, b.y, b.z], b.label),
    lambda children, label: PytreeBox(*children, label=label),
)


class UserBox:
    """Taught to gradguard with register_container (by the fixture below)."""

    def __init__(self, x: Any, y: Any, z: Any, label: str = "ubox") -> None:
        self.x, self.y, self.z, self.label = x, y, z, label


@pytest.fixture
def user_box_registered() -> Iterator[None]:
    gradguard.register_container(
        UserBox,
        lambda b: ([b.x, b.y, b.z], b.label),
        lambda children, label: UserBox(*children, label=label),
    )
    try:
        yield
    finally:
        gradguard.unregister_container(UserBox)


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
    """A leaf holds no graph: detaching it would free nothing and cut it from its .grad (d15)."""
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
    (k2, v2), = out.items()
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


# --------------------------------------------------------------------------------------------------
# register_container
# --------------------------------------------------------------------------------------------------


def test_register_container_round_trip(user_box_registered: None) -> None:
    g = grad_tensor()
    p = plain_tensor()
    box = UserBox(g, p, [1], label="lbl")
    out = detach_tree(box)
    assert type(out) is UserBox and out is not box
    assert out.label == "lbl"
    assert_detached_from(out.x, g)
    assert out.y is p and out.z is box.z
    assert box.x is g
    unchanged = UserBox(p, 1, "s")
    assert detach_tree(unchanged) is unchanged
    recs = find_graphs({"b": box})
    assert [r.path for r in recs] == ["['b'][0]"]


def test_register_container_applies_to_subclasses(user_box_registered: None) -> None:
    class SubBox(UserBox):
        pass

    g = grad_tensor()
    out = detach_tree(SubBox(g, 1, 2))
    # the registered unflatten decides the type it rebuilds
    assert isinstance(out, UserBox)
    assert_detached_from(out.x, g)


def test_unregister_container_restores_pass_through() -> None:
    g = grad_tensor()
    box = UserBox(g, 1, 2)
    assert detach_tree(box) is box  # unknown: passes through untouched
    gradguard.register_container(UserBox, lambda b: ([b.x], None), lambda c, _: UserBox(c[0], 1, 2))
    try:
        assert not detach_tree(box).x.requires_grad
    finally:
        gradguard.unregister_container(UserBox)
    assert detach_tree(box) is box  # the cached spec was dropped
    assert box.x is g
    with pytest.raises(KeyError):
        gradguard.unregister_container(UserBox)


def test_register_container_takes_precedence_over_pytree() -> None:
    g = grad_tensor()
    box = PytreeBox(g, 2, 3, label="orig")
    gradguard.register_container(
        PytreeBox, lambda b: ([b.x], b.label), lambda c, label: PytreeBox(c[0], "via", "gradguard", label)
    )
    try:
        out = detach_tree(box)
        assert (out.y, out.z, out.label) == ("via", "gradguard", "orig")
    finally:
        gradguard.unregister_container(PytreeBox)
    out = detach_tree(box)
    assert (out.y, out.z, out.label) == (2, 3, "orig")


@pytest.mark.parametrize("not_a_class", [UserBox(1, 2, 3), "UserBox", lambda: None, 3])
def test_register_container_rejects_non_class(not_a_class: Any) -> None:
    with pytest.raises(TypeError):
        gradguard.register_container(not_a_class, lambda o: ([], None), lambda c, x: None)


@pytest.mark.parametrize("native", [dict, list, tuple, torch.Tensor, nn.Parameter, int, str])
def test_register_container_rejects_native_types(native: type) -> None:
    with pytest.raises(GradGuardError):
        gradguard.register_container(native, lambda o: ([], None), lambda c, x: None)
    # nothing got registered, so the native handling is intact
    g = grad_tensor()
    assert not detach_tree({"a": [g]})["a"][0].requires_grad
    with pytest.raises(KeyError):
        gradguard.unregister_container(native)


@pytest.mark.parametrize("which", ["flatten", "unflatten"])
def test_register_container_rejects_non_callable(which: str) -> None:
    fns: dict[str, Any] = {"flatten": lambda o: ([], None), "unflatten": lambda c, x: None}
    fns[which] = "not callable"
    with pytest.raises(TypeError, match=which):
        gradguard.register_container(UserBox, fns["flatten"], fns["unflatten"])
    box = UserBox(grad_tensor(), 1, 2)
    assert detach_tree(box) is box  # not registered
    with pytest.raises(KeyError):
        gradguard.unregister_container(UserBox)


def test_register_container_bad_flatten_result() -> None:
    class Odd:
        pass

    gradguard.register_container(Odd, lambda o: 5, lambda c, x: Odd())
    try:
        with pytest.raises(GradGuardError, match="flatten"):
            detach_tree(Odd())
    finally:
        gradguard.unregister_container(Odd)


def test_gradguard_error_is_runtime_error() -> None:
    assert issubclass(GradGuardError, RuntimeError)


# --------------------------------------------------------------------------------------------------
# unknown objects
# --------------------------------------------------------------------------------------------------


class Opaque:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_unknown_objects_pass_through_untouched() -> None:
    g = grad_tensor()
    o = Opaque(g)
    assert detach_tree(o) is o
    assert o.t is g
    s = {1, 2}
    f = frozenset({"a"})
    rec = [o, s, f, g, object]
    out = detach_tree(rec)
    assert out[0] is o and out[1] is s and out[2] is f and out[4] is object
    assert_detached_from(out[3], g)
    assert o.t is g and o.t.requires_grad


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

    gradguard.register_container(
        Pair, lambda p: ([[p.a], [p.b]], None), lambda ch, _: Pair(ch[0][0], ch[1][0])
    )
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


# --------------------------------------------------------------------------------------------------
# Reported defects (issue 14): rebuilt exactly, or refused; never something different
# --------------------------------------------------------------------------------------------------


def test_chainmap_is_rebuilt_from_its_maps_not_through_its_constructor() -> None:
    """d01: ChainMap(zip(...)) kept the zip object as its only map; reading the record raised."""
    cm = collections.ChainMap({"log_probs": grad_tensor()}, {"step": 7})
    out = detach_tree(cm)
    assert type(out) is collections.ChainMap and len(out.maps) == 2
    assert out["step"] == 7 and out["log_probs"].grad_fn is None
    assert out.maps[1] is cm.maps[1]  # the unchanged map is shared, not copied
    assert cm["log_probs"].grad_fn is not None  # the input is untouched


def test_mapping_whose_storage_is_an_attribute_is_never_mutated() -> None:
    """d02's mechanism: a MutableMapping keeping its items in ``self._d``; a shallow copy shares it."""

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
    """d14: tensor attributes, namedtuple/tuple-subclass attributes, deque-subclass slots."""
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
    """d14, d24: a non-idempotent __setitem__ and a partial __iter__ do not change what is rebuilt."""

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
    """d24: `cls in frozenset` hashed the class; an unhashable metaclass raised TypeError."""

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
    """d22, d21: one tensor referenced many times is detached once, and stays one object."""
    from gradguard._tree import detach

    y = grad_tensor()
    r = detach_tree({"a": y, "b": y, "c": [y]})
    assert r["a"] is r["b"] is r["c"][0]
    sub = {"x": y}
    r2 = detach_tree([sub, sub, (sub,)])
    assert r2[0] is r2[1] is r2[2][0]
    many = detach([y] * 100_000)
    assert many.tensors == 1 and len({id(t) for t in many.value}) == 1


def test_counts_survive_deep_nesting() -> None:
    """Issue 12: the old walk reset its count when a deep input made it restart (returned 1, not 71)."""
    from gradguard._tree import detach

    deep: Any = grad_tensor()
    for _ in range(70):
        deep = [deep, grad_tensor()]
    assert detach(deep).tensors == 71
    deeper: Any = grad_tensor()
    for _ in range(3000):
        deeper = {"a": deeper, "b": (grad_tensor(),)}
    assert detach(deeper).tensors == 3001


def test_dataclass_instance_state_is_walked_too() -> None:
    """d25: a cached_property cache (in __dict__) carrying a graph is detached and found."""
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
    """d25: a tensor in a registered pytree node's context."""

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


def test_a_pytree_registered_dataclass_keeps_its_init_false_field() -> None:
    """d25: pytree's register_dataclass rebuilds through __init__ and loses init=False fields."""

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
    """d13: UserList and SimpleNamespace are rebuilt; sets and dict keys are found, never replaced."""
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
    """d18: the spec cache held every record type ever walked."""
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
