"""``gradguard.guard``: every way into a list / dict / deque / append-only store is intercepted, and
the proxy reads like the container it wraps."""

from __future__ import annotations

import collections
import copy
import pickle
from typing import Any

import pytest
import torch

import gradguard
from gradguard import _policy



def graph(value: float = 1.0, n: int = 4) -> torch.Tensor:
    """A fresh tensor carrying a graph (``MulBackward0``) over a leaf that requires grad."""
    leaf = torch.full((n,), value, requires_grad=True)
    return leaf * 2


def record(value: float = 1.0) -> dict[str, Any]:
    return {"loss": value, "model_output": {"log_probs": graph(value), "entropy": graph(-value)}}


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


# --------------------------------------------------------------------------------------------------
# list
# --------------------------------------------------------------------------------------------------


def test_list_append_detaches_and_stores_in_the_wrapped_list() -> None:
    original: list[Any] = []
    store = gradguard.guard(original, name="out")
    rec = record(1.0)
    store.append(rec)
    assert len(original) == 1 and original[0] is store[0]
    assert_detached(original)
    assert original[0]["loss"] == 1.0
    assert torch.equal(original[0]["model_output"]["log_probs"], torch.full((4,), 2.0))
    # the caller's record is not mutated
    assert rec["model_output"]["log_probs"].grad_fn is not None


def test_list_append_of_a_bare_tensor() -> None:
    original: list[Any] = []
    store = gradguard.guard(original)
    t = graph(3.0)
    store.append(t)
    assert original[0].grad_fn is None and not original[0].requires_grad
    assert original[0].data_ptr() == t.data_ptr()  # detached, not copied


def test_list_extend_insert_and_iadd() -> None:
    original: list[Any] = []
    store = gradguard.guard(original, name="out")
    store.extend([record(1.0), record(2.0)])
    store.extend(record(v) for v in (3.0, 4.0))  # any iterable, generators too
    store.insert(0, record(0.0))
    store += [record(5.0)]
    assert gradguard.unwrap(store) is original
    assert [r["loss"] for r in original] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert_detached(original)


def test_iadd_keeps_the_proxy() -> None:
    store = gradguard.guard([], name="out")
    before = store
    store += [graph()]
    assert store is before  # still guarded afterwards
    store.append(graph())
    assert_detached(gradguard.unwrap(store))


def test_list_setitem_with_index_and_slices() -> None:
    original: list[Any] = [0, 1, 2, 3]
    store = gradguard.guard(original)
    store[0] = record(10.0)
    store[-1] = graph()
    store[1:3] = [record(11.0), record(12.0), record(13.0)]  # a slice may grow the list
    assert len(original) == 5
    store[::2] = (graph() for _ in range(3))  # extended slice, from a generator
    assert len(original) == 5
    assert_detached(original)
    assert original[1]["loss"] == 11.0 and original[3]["loss"] == 13.0


def test_clean_values_are_stored_as_is() -> None:
    original: list[Any] = []
    store = gradguard.guard(original)
    clean = {"loss": 1.0, "model_output": {"log_probs": torch.ones(3)}}
    store.append(clean)
    store.extend([clean])
    store[0] = clean
    assert original[0] is clean and original[1] is clean  # lazy: nothing to detach, same object


def test_leaf_requiring_grad_is_detached() -> None:
    original: list[Any] = []
    store = gradguard.guard(original)
    leaf = torch.ones(3, requires_grad=True)
    store.append({"leaf": leaf})
    assert not original[0]["leaf"].requires_grad


# --------------------------------------------------------------------------------------------------
# dict
# --------------------------------------------------------------------------------------------------


def test_dict_setitem() -> None:
    original: dict[str, Any] = {}
    store = gradguard.guard(original, name="data")
    store["a"] = record(1.0)
    store["t"] = graph()
    assert set(original) == {"a", "t"}
    assert_detached(original)


def test_dict_update_mapping_pairs_and_kwargs() -> None:
    original: dict[str, Any] = {}
    store = gradguard.guard(original)
    store.update({"a": graph(1.0)})
    store.update([("b", graph(2.0)), ("c", record(3.0))])
    store.update(d=graph(4.0), e=record(5.0))
    store.update({"f": graph(6.0)}, g=graph(7.0))
    store.update()  # no-op
    assert list(original) == ["a", "b", "c", "d", "e", "f", "g"]
    assert_detached(original)
    assert torch.equal(original["g"], torch.full((4,), 14.0))


def test_dict_update_later_keys_win() -> None:
    original: dict[str, Any] = {}
    store = gradguard.guard(original)
    store.update([("a", graph(1.0)), ("a", graph(2.0))], b=graph(3.0))
    assert torch.equal(original["a"], torch.full((4,), 4.0))
    assert_detached(original)


def test_dict_setdefault_absent_key_stores_detached_default() -> None:
    original: dict[str, Any] = {}
    store = gradguard.guard(original)
    got = store.setdefault("a", record(1.0))
    assert got is original["a"]
    assert_detached(original)
    assert store.setdefault("none") is None and original["none"] is None


def test_dict_setdefault_present_key_leaves_default_alone() -> None:
    kept = torch.zeros(2)
    original: dict[str, Any] = {"a": kept}
    store = gradguard.guard(original, name="sd", mode="raise")
    default = graph()  # in raise mode, processing it would raise
    assert store.setdefault("a", default) is kept
    assert original == {"a": kept} and original["a"] is kept
    assert gradguard.stats() == {}  # nothing was published, not even counted


def test_dict_ior() -> None:
    original: dict[str, Any] = {"x": 0}
    store = gradguard.guard(original)
    before = store
    store |= {"a": graph(1.0)}
    store |= [("b", record(2.0))]
    assert store is before
    assert list(original) == ["x", "a", "b"]
    assert_detached(original)


def test_dict_subclasses_keep_their_type() -> None:
    original: collections.OrderedDict[str, Any] = collections.OrderedDict()
    store = gradguard.guard(original)
    assert isinstance(store, collections.OrderedDict)
    store["a"] = graph()
    assert_detached(dict(original))
    dd: collections.defaultdict[str, list[Any]] = collections.defaultdict(list)
    guarded_dd = gradguard.guard(dd)
    guarded_dd["a"] = [graph()]
    assert_detached(dd["a"])


# --------------------------------------------------------------------------------------------------
# deque and append-only objects
# --------------------------------------------------------------------------------------------------


def test_deque_every_way_in() -> None:
    original: collections.deque[Any] = collections.deque(maxlen=10)
    store = gradguard.guard(original, name="q")
    assert isinstance(store, collections.deque)
    store.append(record(1.0))
    store.appendleft(record(0.0))
    store.extend([record(2.0), record(3.0)])
    store.extendleft([record(-1.0), record(-2.0)])
    store += [record(4.0)]
    store[0] = record(-3.0)
    assert [r["loss"] for r in original] == [-3.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    assert original.maxlen == 10
    assert_detached(list(original))


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


# --------------------------------------------------------------------------------------------------
# the proxy reads like the container
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [lambda: [1, 2, 3], lambda: {"a": 1, "b": 2}, lambda: collections.deque([1, 2, 3], maxlen=5)],
    ids=["list", "dict", "deque"],
)
def test_reading_iteration_len_equality(make: Any) -> None:
    original = make()
    store = gradguard.guard(original)
    assert isinstance(store, type(original))
    assert len(store) == len(original)
    assert list(store) == list(original)
    assert store == make() and make() == store
    assert store != type(original)()
    assert (1 in store) == (1 in original)
    if isinstance(original, dict):
        assert store["a"] == 1 and store.get("b") == 2 and list(store.items()) == list(original.items())
    else:
        assert store[0] == 1 and store[-1] == 3


@pytest.mark.parametrize(
    "make",
    [lambda: [], lambda: {}, lambda: collections.deque(maxlen=4)],
    ids=["list", "dict", "deque"],
)
def test_pickle_and_copy_yield_the_plain_container(make: Any) -> None:
    original = make()
    store = gradguard.guard(original, name="p")
    if isinstance(original, dict):
        store["a"] = {"t": graph(1.0), "n": 3}
    else:
        store.append({"t": graph(1.0), "n": 3})
    for clone in (pickle.loads(pickle.dumps(store)), copy.copy(store), copy.deepcopy(store)):
        assert type(clone) is type(original)
        assert clone is not original
        first = clone["a"] if isinstance(clone, dict) else clone[0]
        assert first["n"] == 3 and torch.equal(first["t"], torch.full((4,), 2.0))
        if isinstance(original, collections.deque):
            assert clone.maxlen == 4
    shallow = copy.copy(store)
    assert (shallow["a"] if isinstance(shallow, dict) else shallow[0]) is (
        original["a"] if isinstance(original, dict) else original[0]
    )


def test_repr_names_the_store() -> None:
    store = gradguard.guard([1], name="forward_data_store")
    assert "forward_data_store" in repr(store) and "[1]" in repr(store)


# --------------------------------------------------------------------------------------------------
# unwrap, double guard, bad arguments
# --------------------------------------------------------------------------------------------------


def test_unwrap() -> None:
    original: list[Any] = []
    store = gradguard.guard(original)
    assert gradguard.unwrap(store) is original
    other = [1]
    assert gradguard.unwrap(other) is other  # not a guarded store: returned as is


def test_guarding_a_guarded_store_returns_it() -> None:
    original: list[Any] = []
    store = gradguard.guard(original, name="once")
    assert gradguard.guard(store) is store
    assert gradguard.guard(store, mode="raise", name="twice") is store
    assert gradguard.unwrap(gradguard.guard(store)) is original
    store.append(graph())  # keeps its first options (detach, not raise)
    assert_detached(original)
    assert {key[0] for key in gradguard.stats()} == {"once"}


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
    assert [r.path for r in records] == ["[0]['x']"]  # the proxy adds nothing to the path
    assert gradguard.pinned_bytes(store) > 0
    detached = gradguard.detach_tree(store)
    assert detached is not store and type(detached) is type(store)
    assert gradguard.unwrap(detached) is not gradguard.unwrap(store)
    assert gradguard.find_graphs(detached) == [] and gradguard.find_graphs(store) != []  # input untouched
    assert repr(detached).endswith("name='kept')")
    clean = gradguard.guard([{"x": 1.0}])
    assert gradguard.detach_tree(clean) is clean
