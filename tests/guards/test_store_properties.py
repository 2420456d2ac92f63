"""Property test: random records through a guarded store, in every mode.

Records mix plain containers with subclasses whose constructors take other arguments or misbehave
(a non-idempotent ``__setitem__``, a partial ``__iter__``), mappings that keep their items in an
attribute, instance attributes on containers and tensors, shared references, leaves, parameters,
views. For every record and mode: the input is never mutated; nothing is lost; types, order and
non-tensor content are kept exactly, and references that were shared stay shared; no graph is
stored in ``detach``/``warn``; nothing at all is stored in ``raise`` when the record holds a graph.

The structure is read by this file's own accessors, never by gradguard's registry, so the test
does not check gradguard with its own code.
"""

from __future__ import annotations

import collections
import dataclasses
import types
import warnings
from collections.abc import Iterator, MutableMapping
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradguard

POOL = 8  # tensors per example: plain, leaf requiring grad, graph, view of a graph, parameter, ...


class NT(NamedTuple):
    a: Any
    b: Any


class NTWithDict(NT):
    """A namedtuple subclass without __slots__: instances carry attributes."""


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: Any
    b: Any
    note: str = dataclasses.field(init=False, default="")


class ArgDict(dict):  # type: ignore[type-arg]
    """A dict subclass whose constructor wants something else, and whose __setitem__ boxes values."""

    def __init__(self, tag: str, items: Any = ()) -> None:
        super().__init__(items)
        self.tag = tag

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, [value])


class ArgList(list):  # type: ignore[type-arg]
    """A list subclass with another constructor and an __iter__ that shows one item only."""

    def __init__(self, tag: str, items: Any = ()) -> None:
        super().__init__(items)
        self.tag = tag

    def __iter__(self) -> Iterator[Any]:
        return iter(list.__getitem__(self, slice(0, 1)))


class PairTuple(tuple):  # type: ignore[type-arg]
    """A tuple subclass whose __new__ wants two arguments."""

    def __new__(cls, a: Any, b: Any) -> PairTuple:
        return super().__new__(cls, (a, b))


class AttrMapping(MutableMapping):  # type: ignore[type-arg]
    """A mapping keeping its items in an attribute (a shallow copy shares them)."""

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


# --------------------------------------------------------------------------------------------------
# Descriptions, then records built from them with a shared pool of tensors and sub-containers
# --------------------------------------------------------------------------------------------------

_leaves = st.one_of(
    st.tuples(st.just("tensor"), st.integers(0, POOL - 1)),
    st.tuples(st.just("atom"), st.one_of(st.integers(), st.text(max_size=3), st.floats(allow_nan=False), st.none())),
)
KINDS = ["list", "tuple", "deque", "dict", "odict", "ddict", "nt", "ntd", "frozen", "argdict", "arglist", "pair",
         "attrmap", "chainmap", "userdict", "userlist", "namespace"]  # fmt: skip


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.tuples(st.sampled_from(KINDS), st.lists(children, min_size=2, max_size=4), st.booleans())


descriptions = st.recursive(_leaves, _containers, max_leaves=20)


def make_pool() -> list[torch.Tensor]:
    pool: list[torch.Tensor] = []
    for i in range(POOL):
        base = torch.full((4,), float(i))
        kind = i % 5
        if kind == 0:
            pool.append(base)
        elif kind == 1:
            pool.append(base.requires_grad_())
        elif kind == 2:
            graph = base.requires_grad_() * 3
            graph.tag = f"t{i}"  # type: ignore[attr-defined]  # an attribute on a tensor
            pool.append(graph)
        elif kind == 3:
            pool.append((base.requires_grad_() * 2)[1:3])  # a view of a graph tensor
        else:
            pool.append(torch.nn.Parameter(base))
    return pool


def build(desc: Any, pool: list[torch.Tensor], shared: dict[int, Any]) -> Any:
    if desc[0] == "tensor":
        return pool[desc[1]]
    if desc[0] == "atom":
        return desc[1]
    kind, payload, share = desc
    key = id(desc)
    if share and key in shared:
        return shared[key]
    kids = [build(d, pool, shared) for d in payload]
    obj = _make(kind, kids)
    if share:
        shared[key] = obj
    return obj


def _make(kind: str, kids: list[Any]) -> Any:
    keyed = {f"k{i}": v for i, v in enumerate(kids)}
    if kind == "list":
        return kids
    if kind == "tuple":
        return tuple(kids)
    if kind == "deque":
        return collections.deque(kids, maxlen=len(kids) + 2)
    if kind == "dict":
        return keyed
    if kind == "odict":
        od = collections.OrderedDict(keyed)
        od.move_to_end("k0")
        return od
    if kind == "ddict":
        return collections.defaultdict(list, keyed)
    if kind == "nt":
        return NT(kids[0], kids[1])
    if kind == "ntd":
        n = NTWithDict(kids[0], kids[1])
        n.extra = kids[2:]  # type: ignore[attr-defined]
        return n
    if kind == "frozen":
        f = Frozen(kids[0], kids[1])
        object.__setattr__(f, "note", "set-later")
        return f
    if kind == "argdict":
        d = ArgDict("tag")
        for k, v in keyed.items():
            dict.__setitem__(d, k, v)
        return d
    if kind == "arglist":
        return ArgList("tag", kids)
    if kind == "pair":
        return PairTuple(kids[0], kids[1])
    if kind == "attrmap":
        return AttrMapping(keyed)
    if kind == "chainmap":
        return collections.ChainMap(dict(list(keyed.items())[:1]), dict(list(keyed.items())[1:]))
    if kind == "userdict":
        return collections.UserDict(keyed)
    if kind == "userlist":
        return collections.UserList(kids)
    return types.SimpleNamespace(**keyed)


# --------------------------------------------------------------------------------------------------
# This file's own view of a structure
# --------------------------------------------------------------------------------------------------


def parts(obj: Any) -> list[tuple[Any, Any]] | None:
    """``(label, child)`` pairs: items read at C level, then instance attributes; ``None`` for a leaf."""
    if isinstance(obj, torch.Tensor):
        return [(("attr", k), v) for k, v in vars(obj).items()] or None
    cls = type(obj)
    if isinstance(obj, dict):
        base = collections.OrderedDict if isinstance(obj, collections.OrderedDict) else dict
        items = [(("item", k), dict.__getitem__(obj, k)) for k in base.keys(obj)]  # type: ignore[attr-defined]
    elif isinstance(obj, list):
        items = [(("item", i), v) for i, v in enumerate(list.copy(obj))]
    elif isinstance(obj, tuple):
        items = [(("item", i), v) for i, v in enumerate(tuple.__getitem__(obj, slice(None)))]
    elif isinstance(obj, collections.deque):
        items = [(("item", i), v) for i, v in enumerate(collections.deque.__iter__(obj))]
    elif isinstance(obj, (AttrMapping, collections.ChainMap, collections.UserDict, collections.UserList, Frozen)):
        items = []
    elif cls is types.SimpleNamespace:
        items = []
    else:
        return None
    state = [(("attr", k), v) for k, v in getattr(obj, "__dict__", {}).items()]
    return items + state


def snapshot(obj: Any, seen: dict[int, int] | None = None) -> Any:
    """Everything the test compares, with shared references numbered in order of first meeting."""
    seen = {} if seen is None else seen
    if id(obj) in seen:
        return ("ref", seen[id(obj)])
    kids = parts(obj)
    if isinstance(obj, torch.Tensor):
        seen[id(obj)] = len(seen)
        value = (type(obj), obj.dtype, tuple(obj.shape), obj.detach().tolist(), obj.grad_fn is not None, obj.is_leaf)
        return ("T", value, [(lab, snapshot(c, seen)) for lab, c in kids or []])
    if kids is None:
        return ("A", type(obj), obj)
    seen[id(obj)] = len(seen)
    extra = (obj.maxlen,) if isinstance(obj, collections.deque) else ()
    extra += (obj.default_factory,) if isinstance(obj, collections.defaultdict) else ()
    return (type(obj), extra, [(lab, snapshot(c, seen)) for lab, c in kids])


def tensors(obj: Any, out: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        if id(obj) not in out:
            out[id(obj)] = obj
    for _, child in parts(obj) or []:
        if not (isinstance(child, torch.Tensor) and id(child) in out):
            tensors(child, out)
    return out


def same_but_detached(old: Any, new: Any) -> Any:
    """``snapshot(old)`` with every graph tensor shown as its detached self: what a guarded store must hold."""

    def fix(s: Any) -> Any:
        if isinstance(s, tuple) and s and s[0] == "T":
            cls, dtype, shape, values, has_graph, is_leaf = s[1]
            return ("T", (cls, dtype, shape, values, False, is_leaf or has_graph), [(lab, fix(c)) for lab, c in s[2]])
        if isinstance(s, tuple) and len(s) == 3 and isinstance(s[2], list):
            return (s[0], s[1], [(lab, fix(c)) for lab, c in s[2]])
        return s

    return fix(snapshot(old)), snapshot(new)


# --------------------------------------------------------------------------------------------------
# The property
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["off", "detach", "warn", "raise"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(desc=descriptions)
def test_a_guarded_store_never_mutates_loses_or_changes_a_record(mode: str, desc: Any) -> None:
    pool = make_pool()
    record = build(desc, pool, {})
    before = snapshot(record)
    has_graph = any(t.grad_fn is not None for t in tensors(record).values())
    store = gradguard.guard([], mode=mode, name="prop")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradguard.GraphRetentionWarning)
        if mode == "raise" and has_graph:
            with pytest.raises(gradguard.GraphRetentionError):
                store.append(record)
        else:
            store.append(record)
    assert snapshot(record) == before  # the input is never mutated
    if mode == "raise" and has_graph:
        assert len(store) == 0  # nothing stored
        return
    assert len(store) == 1  # nothing lost
    stored = store[0]
    if mode == "off" or not has_graph:
        assert stored is record
        return
    expected, got = same_but_detached(record, stored)
    assert got == expected  # types, order, non-tensor content, sharing: all as they were
    assert all(t.grad_fn is None for t in tensors(stored).values())  # no graph stored
    kept = {id(t) for t in tensors(record).values() if t.grad_fn is None}
    assert kept <= set(tensors(stored))  # leaves, parameters included, are the very same objects
