"""``gradguard.guard``: every way into a list / dict / deque / append-only store is intercepted.

Two kinds of store are exercised side by side: a *new* store (``guard([])``: a real subclass of the
container, holding what is stored) and an *in-place* one (a user's ``list``/``dict``/``deque`` subclass
or any object with ``append``: a proxy, the object itself holding what is stored).
"""

from __future__ import annotations

import collections
import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _helpers import graph, record

import gradguard
from gradguard._policy import modes as _policy


def assert_detached(obj: Any) -> None:
    """No tensor reachable from ``obj`` carries a graph or requires grad."""
    assert gradguard.find_graphs(obj) == []
    for t in _tensors(obj):
        assert t.grad_fn is None and not t.requires_grad


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple, collections.deque)):
        return [t for v in obj for t in _tensors(v)]
    return []


class OwnedList(list):  # type: ignore[type-arg]
    """A user's list subclass: guarded in place."""


class OwnedDict(dict):  # type: ignore[type-arg]
    """A user's dict subclass: guarded in place."""


class OwnedDeque(collections.deque):  # type: ignore[type-arg]
    """A user's deque subclass: guarded in place."""


KINDS = ["new", "in-place"]


def make_store(base: type, kind: str, items: Any = (), **options: Any) -> tuple[Any, Any]:
    """``(store, contents)``: the store to write through and the container that holds what is stored."""
    if kind == "new":
        store = gradguard.guard(base(items) if base is not collections.deque else base(items, maxlen=10), **options)
        assert type(store) is not base and isinstance(store, base)  # a real subclass, a new object
        return store, store
    owned = {list: OwnedList, dict: OwnedDict, collections.deque: OwnedDeque}[base]
    original = owned(items) if base is not collections.deque else owned(items, maxlen=10)
    return gradguard.guard(original, **options), original


# --------------------------------------------------------------------------------------------------
# list
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_list_append_detaches_and_stores(kind: str) -> None:
    store, held = make_store(list, kind, name="out")
    rec = record(1.0)
    assert store.append(rec) is None  # like list.append
    assert len(held) == 1 and held[0] is store[0]
    assert_detached(held)
    assert held[0]["loss"] == 1.0
    assert torch.equal(held[0]["model_output"]["log_probs"], torch.full((4,), 2.0))
    # the caller's record is not mutated
    assert rec["model_output"]["log_probs"].grad_fn is not None


def test_new_store_holds_copies_of_the_items_and_leaves_the_input_alone() -> None:
    kept = record(1.0)
    original = [kept, 3]
    store = gradguard.guard(original, name="out")
    assert original == [kept, 3] and original[0] is kept  # the input list is not changed
    assert store[1] == 3 and store[0] is not kept and store[0]["loss"] == 1.0
    assert_detached(store)
    store.append(4)
    assert len(original) == 2 and len(store) == 3  # a new store: keep using the returned object


@pytest.mark.parametrize("kind", KINDS)
def test_list_append_of_a_bare_tensor(kind: str) -> None:
    store, held = make_store(list, kind)
    t = graph(3.0)
    store.append(t)
    assert held[0].grad_fn is None and not held[0].requires_grad
    assert held[0].data_ptr() == t.data_ptr()  # detached, not copied


@pytest.mark.parametrize("kind", KINDS)
def test_list_extend_insert_and_iadd(kind: str) -> None:
    store, held = make_store(list, kind, name="out")
    store.extend([record(1.0), record(2.0)])
    store.extend(record(v) for v in (3.0, 4.0))  # any iterable, generators too
    store.insert(0, record(0.0))
    store += [record(5.0)]
    assert [r["loss"] for r in held] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert_detached(held)


@pytest.mark.parametrize("kind", KINDS)
def test_iadd_keeps_the_store(kind: str) -> None:
    store, held = make_store(list, kind, name="out")
    before = store
    store += [graph()]
    assert store is before  # still guarded afterwards
    store.append(graph())
    assert_detached(held)


@pytest.mark.parametrize("kind", KINDS)
def test_list_setitem_with_index_and_slices(kind: str) -> None:
    store, held = make_store(list, kind, [0, 1, 2, 3])
    store[0] = record(10.0)
    store[-1] = graph()
    store[1:3] = [record(11.0), record(12.0), record(13.0)]  # a slice may grow the list
    assert len(held) == 5
    store[::2] = (graph() for _ in range(3))  # extended slice, from a generator
    assert len(held) == 5
    assert_detached(held)
    assert held[1]["loss"] == 11.0 and held[3]["loss"] == 13.0


@pytest.mark.parametrize("kind", KINDS)
def test_clean_values_are_stored_as_is(kind: str) -> None:
    store, held = make_store(list, kind)
    clean = {"loss": 1.0, "model_output": {"log_probs": torch.ones(3)}}
    store.append(clean)
    store.extend([clean])
    store[0] = clean
    assert held[0] is clean and held[1] is clean  # lazy: nothing to detach, same object


@pytest.mark.parametrize("kind", KINDS)
def test_leaf_requiring_grad_is_stored_as_is(kind: str) -> None:
    """A leaf holds no graph; a Parameter stays a Parameter, with its .grad."""
    store, held = make_store(list, kind, mode="raise")
    p = torch.nn.Parameter(torch.ones(2))
    store.append({"w": p})  # not refused: nothing to free
    (p * 3).sum().backward()
    assert held[0]["w"] is p and isinstance(held[0]["w"], torch.nn.Parameter)
    assert torch.equal(held[0]["w"].grad, torch.full((2,), 3.0))


# --------------------------------------------------------------------------------------------------
# dict
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_dict_setitem(kind: str) -> None:
    store, held = make_store(dict, kind, name="data")
    store["a"] = record(1.0)
    store["t"] = graph()
    assert set(held) == {"a", "t"}
    assert_detached(dict(held))


@pytest.mark.parametrize("kind", KINDS)
def test_dict_update_mapping_pairs_and_kwargs(kind: str) -> None:
    store, held = make_store(dict, kind)
    store.update({"a": graph(1.0)})
    store.update([("b", graph(2.0)), ("c", record(3.0))])
    store.update(d=graph(4.0), e=record(5.0))
    store.update({"f": graph(6.0)}, g=graph(7.0))
    store.update()  # no-op
    assert list(held) == ["a", "b", "c", "d", "e", "f", "g"]
    assert_detached(dict(held))
    assert torch.equal(held["g"], torch.full((4,), 14.0))


@pytest.mark.parametrize("kind", KINDS)
def test_dict_update_later_keys_win(kind: str) -> None:
    store, held = make_store(dict, kind)
    store.update([("a", graph(1.0)), ("a", graph(2.0))], b=graph(3.0))
    assert torch.equal(held["a"], torch.full((4,), 4.0))
    assert_detached(dict(held))


@pytest.mark.parametrize("kind", KINDS)
def test_dict_setdefault_absent_key_stores_detached_default(kind: str) -> None:
    store, held = make_store(dict, kind)
    got = store.setdefault("a", record(1.0))
    assert got is held["a"]
    assert_detached(dict(held))
    assert store.setdefault("none") is None and held["none"] is None


@pytest.mark.parametrize("kind", KINDS)
def test_dict_setdefault_present_key_leaves_default_alone(kind: str) -> None:
    kept = torch.zeros(2)
    store, held = make_store(dict, kind, {"a": kept}, name="sd", mode="raise")
    default = graph()  # in raise mode, processing it would raise
    assert store.setdefault("a", default) is kept
    assert dict(held) == {"a": kept} and held["a"] is kept
    assert all(s.site != "(no graph: site not resolved)" or s.records == 1 for s in gradguard.stats().values())


@pytest.mark.parametrize("kind", KINDS)
def test_dict_ior(kind: str) -> None:
    store, held = make_store(dict, kind, {"x": 0})
    before = store
    store |= {"a": graph(1.0)}
    store |= [("b", record(2.0))]
    assert store is before
    assert list(held) == ["x", "a", "b"]
    assert_detached(dict(held))


def test_dict_kinds_keep_their_type() -> None:
    od = gradguard.guard(collections.OrderedDict(b=1, a=2))
    assert isinstance(od, collections.OrderedDict) and list(od) == ["b", "a"]
    od["c"] = graph()
    od.move_to_end("b")
    assert list(od) == ["a", "c", "b"]
    assert_detached(dict(od))
    dd = gradguard.guard(collections.defaultdict(list))
    assert isinstance(dd, collections.defaultdict) and dd.default_factory is list
    dd["a"] = [graph()]
    assert_detached(dd["a"])


@pytest.mark.parametrize("kind", KINDS)
def test_defaultdict_missing_values_are_guarded_stores(kind: str) -> None:
    """``store["loss"].append(...)`` goes into a store the default factory made: guarded too."""
    if kind == "new":
        store = gradguard.guard(collections.defaultdict(list), name="hist", mode="raise")
        held = store
    else:

        class Owned(collections.defaultdict):  # type: ignore[type-arg]
            pass

        held = Owned(list)
        store = gradguard.guard(held, name="hist", mode="raise")
    with pytest.raises(gradguard.GraphRetentionError, match=r"hist\['loss'\]"):
        store["loss"].append(graph())
    assert list(held["loss"]) == []
    store["loss"].append(graph().detach())
    assert len(held["loss"]) == 1 and isinstance(held["loss"], list)


# --------------------------------------------------------------------------------------------------
# deque and append-only objects
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_deque_every_way_in(kind: str) -> None:
    store, held = make_store(collections.deque, kind, name="q")
    assert isinstance(store, collections.deque)
    store.append(record(1.0))
    store.appendleft(record(0.0))
    store.extend([record(2.0), record(3.0)])
    store.extendleft([record(-1.0), record(-2.0)])
    store += [record(4.0)]
    store[0] = record(-3.0)
    store.insert(1, record(9.0))
    assert [r["loss"] for r in held] == [-3.0, 9.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    assert held.maxlen == 10
    assert_detached(list(held))


class AppendOnly:
    """An engine-style store: only ``append``."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def append(self, value: Any) -> None:
        self.items.append(value)

    def __len__(self) -> int:
        return len(self.items)


def test_object_with_append() -> None:
    original = AppendOnly()
    store = gradguard.guard(original, name="custom")
    assert isinstance(store, AppendOnly)
    store.append(record(1.0))
    store.append(graph())
    assert len(store) == 2 and store.items is original.items  # attributes pass through
    assert_detached(original.items)


def test_user_list_every_way_in_is_guarded() -> None:
    """A ``UserList`` (a MutableSequence) is guarded in place on every way in."""
    original = collections.UserList()
    store = gradguard.guard(original, mode="raise")
    for way in (
        lambda: store.append(graph()),
        lambda: store.extend([graph()]),
        lambda: store.insert(0, graph()),
        lambda: store.__iadd__([graph()]),
        lambda: store.__setitem__(slice(0, 0), [graph()]),
    ):
        with pytest.raises(gradguard.GraphRetentionError):
            way()
    assert original.data == []


# --------------------------------------------------------------------------------------------------
# every consumer of a list accepts a new store
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [lambda: [1, 2, 3], lambda: {"a": 1, "b": 2}, lambda: collections.deque([1, 2, 3], maxlen=5)],
    ids=["list", "dict", "deque"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_reading_iteration_len_equality(make: Any, kind: str) -> None:
    original = make()
    if kind == "in-place":
        owned = {list: OwnedList, dict: OwnedDict, collections.deque: OwnedDeque}[type(original)]
        original = owned(original) if type(original) is not collections.deque else owned(original, maxlen=5)
    store = gradguard.guard(original)
    assert isinstance(store, type(make()))
    assert len(store) == len(original)
    assert list(store) == list(original)
    assert store == make() and make() == store
    assert store != type(make())()
    assert (1 in store) == (1 in original)
    if isinstance(original, dict):
        assert store["a"] == 1 and store.get("b") == 2 and list(store.items()) == list(original.items())
    else:
        assert store[0] == 1 and store[-1] == 3


def test_torch_and_json_consumers_accept_a_new_store() -> None:
    import io
    import json

    x = torch.randn(3, requires_grad=True)
    losses = gradguard.guard([], name="losses")
    for i in range(3):
        losses.append((x * i).sum())
    assert torch.equal(torch.stack(losses), torch.stack([(x * i).sum().detach() for i in range(3)]))
    assert torch.equal(torch.tensor(gradguard.guard([1.0, 2.0])), torch.tensor([1.0, 2.0]))
    assert json.dumps(gradguard.guard([1, 2])) == "[1, 2]"
    assert json.dumps(gradguard.guard({"a": 1})) == '{"a": 1}'
    buf = io.BytesIO()
    torch.save({"losses": losses}, buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only=True, the default
    assert type(loaded["losses"]) is list and torch.equal(torch.stack(loaded["losses"]), torch.stack(losses))


@pytest.mark.parametrize(
    "make",
    [lambda: [1, 2], lambda: {"a": 1}, lambda: collections.deque([1], maxlen=3), lambda: collections.OrderedDict(a=1)],
    ids=["list", "dict", "deque", "ordereddict"],
)
def test_type_of_a_store_called_with_an_iterable_is_a_store(make: Callable[[], Any]) -> None:
    """accelerate's send_to_device and lightning's apply_to_collection rebuild with type(obj)(...)."""
    store = gradguard.guard(make(), name="s", mode="raise")
    plain = make()
    rebuilt = type(store)(plain.items() if isinstance(plain, dict) else plain)
    assert rebuilt == plain and type(rebuilt) is type(store)
    # the type carries no options: what it builds follows the context's mode
    items = [("a", graph())] if isinstance(plain, dict) else [graph()]
    assert_detached(list(type(store)(items).values()) if isinstance(plain, dict) else list(type(store)(items)))
    with gradguard.enforce(mode="raise", engines="none"), pytest.raises(gradguard.GraphRetentionError):
        type(store)(items)


def test_pytree_sees_the_items_of_a_store() -> None:
    from torch.utils import _pytree

    x = torch.randn(2)
    store = gradguard.guard([x, x + 1], name="losses")
    leaves, spec = _pytree.tree_flatten({"s": store})
    assert len(leaves) == 2
    mapped = _pytree.tree_map(lambda t: t.to(torch.float64), store)
    assert type(mapped) is type(store) and [t.dtype for t in mapped] == [torch.float64] * 2
    raise_store = gradguard.guard([x], name="r", mode="raise")
    w = torch.ones(2, requires_grad=True)
    with pytest.raises(gradguard.GraphRetentionError):
        _pytree.tree_map(lambda t: t * w, raise_store)  # a store never holds a graph


@pytest.mark.parametrize("backend", ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.integration)])
def test_torch_compile_with_a_new_store(backend: str) -> None:
    """Compiled code may append to a store: a graph break, never a crash or a kept graph."""
    torch._dynamo.reset()
    lin = torch.nn.Linear(4, 4)

    def step(x: torch.Tensor, store: list[Any]) -> torch.Tensor:
        y = lin(x)
        store.append({"y": y})
        return y.sum() + len(store)

    x = torch.randn(2, 4)
    store = gradguard.guard([], name="compiled")
    out = torch.compile(step, backend=backend)(x, store)
    assert len(store) == 1 and store[0]["y"].grad_fn is None
    assert torch.equal(store[0]["y"], lin(x).detach())
    assert torch.allclose(out, lin(x).sum() + 1)
    out.backward()
    assert lin.weight.grad is not None


@pytest.mark.parametrize(
    "make",
    [lambda: [], lambda: {}, lambda: collections.deque(maxlen=4)],
    ids=["list", "dict", "deque"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_pickle_and_copy_yield_the_plain_container(make: Any, kind: str) -> None:
    base = type(make())
    store, held = make_store(base, kind, name="p")
    if isinstance(held, dict):
        store["a"] = {"t": graph(1.0), "n": 3}
    else:
        store.append({"t": graph(1.0), "n": 3})
    plain_type = base if kind == "new" else type(held)
    for clone in (pickle.loads(pickle.dumps(store)), copy.copy(store), copy.deepcopy(store)):
        assert type(clone) is plain_type
        assert clone is not held
        first = clone["a"] if isinstance(clone, dict) else clone[0]
        assert first["n"] == 3 and torch.equal(first["t"], torch.full((4,), 2.0))
        if isinstance(clone, collections.deque):
            assert clone.maxlen == 10
    shallow = copy.copy(store)
    assert (shallow["a"] if isinstance(shallow, dict) else shallow[0]) is (
        held["a"] if isinstance(held, dict) else held[0]
    )


def test_repr_names_the_store() -> None:
    store = gradguard.guard([1], name="forward_data_store")
    assert "forward_data_store" in repr(store) and "[1]" in repr(store)


# --------------------------------------------------------------------------------------------------
# unwrap, double guard, bad arguments
# --------------------------------------------------------------------------------------------------


def test_unwrap() -> None:
    store = gradguard.guard([1])
    plain = gradguard.unwrap(store)
    assert type(plain) is list and plain == [1]
    owned = OwnedList()
    assert gradguard.unwrap(gradguard.guard(owned)) is owned  # in place: the object itself
    other = [1]
    assert gradguard.unwrap(other) is other  # not a guarded store: returned as is


@pytest.mark.parametrize("kind", KINDS)
def test_guarding_a_guarded_store(kind: str) -> None:
    store, held = make_store(list, kind, name="once", mode="detach")
    assert gradguard.guard(store) is store
    assert gradguard.guard(store, mode="detach") is store  # the same options
    with pytest.raises(gradguard.GradGuardError, match=r"already guarded with mode='detach'.*mode='raise'"):
        gradguard.guard(store, mode="raise", name="twice")  # never silently ignored
    store.append(graph())
    assert_detached(held)
    assert {key[0] for key in gradguard.stats()} == {"once"}


def test_guarding_a_class_is_a_clear_error() -> None:
    """guard(list), the class, says what was meant."""
    with pytest.raises(TypeError, match=r"not the class list: guard\(list\(\)\)"):
        gradguard.guard(list)


@pytest.mark.parametrize("bad", [42, "str", (1, 2), 1.5, frozenset({1}), None])
def test_guard_rejects_non_stores(bad: Any) -> None:
    with pytest.raises(TypeError) as info:
        gradguard.guard(bad)
    message = str(info.value)
    assert type(bad).__qualname__ in message
    for accepted in ("list", "dict", "deque", "append"):
        assert accepted in message


@pytest.mark.parametrize("bad", ["maybe", "strictly", "", 1])
def test_bad_mode_is_a_gradguard_error_listing_modes(bad: Any) -> None:
    with pytest.raises(gradguard.GradGuardError) as info:
        gradguard.guard([], mode=bad)
    message = str(info.value)
    assert repr(bad) in message
    for accepted in ("off", "detach", "warn", "raise", "strict"):
        assert accepted in message
    assert message.endswith(_policy.ACCEPTED)


@pytest.mark.parametrize("good", ["OFF", "Detach", "warn", "STRICT", "true", "0"])
def test_mode_aliases_are_accepted(good: str) -> None:
    store = gradguard.guard([], mode=good)
    assert store == []


@pytest.mark.parametrize("bad", ["gpu", "cuda", "host", 1, True])
def test_bad_offload_is_a_value_error(bad: Any) -> None:
    with pytest.raises(ValueError) as info:
        gradguard.guard([], offload=bad)
    assert repr(bad) in str(info.value) and "'cpu'" in str(info.value)


def test_bad_name_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="name"):
        gradguard.guard([], name=3)  # type: ignore[arg-type]


def test_tree_functions_see_through_a_guarded_store() -> None:
    store = gradguard.guard([], mode="off", name="kept")
    store.append({"x": graph()})
    records = gradguard.find_graphs(store)
    assert [r.path for r in records] == ["[0]['x']"]  # the store adds nothing to the path
    assert gradguard.pinned_bytes(store) > 0
    detached = gradguard.detach_tree(store)
    assert detached is not store and type(detached) is type(store)
    assert gradguard.unwrap(detached) is not gradguard.unwrap(store)
    assert gradguard.find_graphs(detached) == [] and gradguard.find_graphs(store) != []  # input untouched
    assert repr(detached).endswith("name='kept')")
    clean = gradguard.guard([{"x": 1.0}])
    assert gradguard.detach_tree(clean) is clean
