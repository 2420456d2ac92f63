"""A chain of objects from a root down to a tensor, described as the edges a reader names it by.

Dicts collapse into the attributes they store (``model.layers``, not ``model.__dict__['layers']``);
a path through a suspended generator or a closure is named from there; only what Python can name is
spelled as a step, anything else as a reference (``<frame stack>``).
"""

from __future__ import annotations

import collections
import functools
import types
from typing import Any, Protocol

import torch
from torch import nn

from .frames import frame_locals
from .paths import MODULE_STATE, Edge, Path, class_dict, instance_dict, is_a, leaf_grad, read_ref, sequence_items
from .roots import NamedRoot

__all__ = ["RootTable", "describe"]

_GENERATORS = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)


class RootTable(Protocol):
    """What a search knows of the roots, by object id: what kind each is, the named roots, the module
    of each module dict, and where each frame local is (index into ``frames``, name)."""

    root_kind: dict[int, str]
    named_by_id: dict[int, NamedRoot]
    module_of_dict: dict[int, types.ModuleType]
    local_names: dict[int, list[tuple[int, str]]]
    frames: list[types.FrameType]


def describe(chain: list[Any], search: RootTable) -> Path | None:
    """The edges along ``chain`` (root first), collapsing dicts into the attributes they store and
    naming the path from the last suspended generator or closure on it; ``None`` when an object on
    it no longer holds the next one (another thread changed it meanwhile)."""
    edges: list[Edge] = []
    named = _named_from(chain)
    i = max(named, 0)
    owner = chain[i]
    if named >= 0 and is_a(owner, _GENERATORS):
        frame = _generator_frame(owner)
        if frame is None:
            return None
        if is_a(chain[i + 1], types.FrameType):  # before 3.11: generator -> its frame -> the local
            i += 1
        else:
            i += _frame_edge(frame, chain, i, edges)
            if edges[0].kind != "local":  # held on the generator's value stack, not by a named local
                edges[0] = Edge(frame, "local", "<stack>")
    elif named >= 0:  # a function -> its __closure__ -> a cell -> the contents
        free = _free_var(owner, chain[i + 2])
        if free is None:
            return None
        edges.append(Edge(owner, "cell", free))
        i += 3
    elif search.root_kind.get(id(owner)) == "named":  # a root gradguard._heap.roots names: the path starts there
        root = search.named_by_id[id(owner)]
        edges.append(Edge(root, "named", root.name))
    elif id(owner) not in search.module_of_dict:  # a thread's frame local
        index, name = search.local_names[id(owner)][0]
        edges.append(Edge(search.frames[index], "local", name))
    else:
        key = _dict_key(owner, chain[1])
        if key is _MISSING:
            return None
        edges.append(Edge(search.module_of_dict[id(owner)], "global", key))
        i = 1
    while i < len(chain) - 1:
        i += _step(chain, i, edges)
    return tuple(_collapse_module_state(edges))


def _named_from(chain: list[Any]) -> int:
    """Where the path is named from: the last suspended generator or coroutine on ``chain``, or the last
    function that holds the rest through its closure; else -1 (named from its root)."""
    for i in range(len(chain) - 2, -1, -1):
        obj = chain[i]
        if is_a(obj, _GENERATORS) and _generator_frame(obj) is not None:
            return i
        if (
            is_a(obj, types.FunctionType)
            and i + 3 < len(chain)
            and obj.__closure__ is not None
            and chain[i + 1] is obj.__closure__
            and is_a(chain[i + 2], types.CellType)
        ):
            return i
    return -1


def _generator_frame(gen: Any) -> types.FrameType | None:
    for name in ("gi_frame", "cr_frame", "ag_frame"):
        frame = getattr(gen, name, None)
        if frame is not None:
            return frame  # type: ignore[no-any-return]
    return None


def _frame_edge(frame: types.FrameType, chain: list[Any], i: int, edges: list[Edge]) -> int:
    """``chain[i]`` holds (a frame of) ``chain[i + 1]`` as a local; a cell variable's cell is skipped."""
    child = chain[i + 1]
    values = frame_locals(frame) or []
    for name, value in values:
        if value is child:
            edges.append(Edge(frame, "local", name))
            return 1
    if is_a(child, types.CellType) and i + 2 < len(chain):
        target = chain[i + 2]
        for name, value in values:
            if value is target:
                edges.append(Edge(frame, "local", name))
                return 2
    return _ref(chain[i], child, edges, "<frame stack>")


def _ref(owner: Any, child: Any, edges: list[Edge], what: str | None = None) -> int:
    edges.append(Edge(owner, "ref", what or f"<{type(owner).__qualname__}>"))
    return 1


_MISSING: Any = object()


def _dict_key(d: Any, child: Any) -> Any:
    for k, v in dict.items(d):
        if v is child:
            return k
    return _MISSING


def _free_var(fn: types.FunctionType, cell: Any) -> str | None:
    for name, c in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        if c is cell:
            return name
    return None


_REFS: dict[type, tuple[str, ...]] = {
    types.MethodType: ("__self__", "__func__"),
    functools.partial: ("func", "args", "keywords"),
    types.TracebackType: ("tb_frame", "tb_next"),
    types.FunctionType: ("__defaults__", "__kwdefaults__", "__closure__", "__dict__"),
    property: ("fget", "fset", "fdel"),
    staticmethod: ("__func__",),
    classmethod: ("__func__",),
    types.CellType: ("cell_contents",),
    BaseException: ("__traceback__", "__context__", "__cause__", "args"),
}


def _step(chain: list[Any], i: int, edges: list[Edge]) -> int:
    """Describe ``chain[i]`` holding ``chain[i + 1]``; returns how many links of the chain it used."""
    owner, child = chain[i], chain[i + 1]
    if is_a(owner, types.FrameType):
        return _frame_edge(owner, chain, i, edges)
    if is_a(owner, _GENERATORS):
        frame = _generator_frame(owner)
        return _frame_edge(frame, chain, i, edges) if frame is not None else _ref(owner, child, edges)
    if is_a(owner, dict):
        for k, v in dict.items(owner):
            if v is child:
                edges.append(Edge(owner, "item", k))
                return 1
        for position, k in enumerate(dict.keys(owner)):
            if k is child:
                edges.append(Edge(owner, "key", position))
                return 1
    elif is_a(owner, (list, tuple, collections.deque)):
        for index, v in sequence_items(owner):
            if v is child:
                edges.append(Edge(owner, "item", index))
                return 1
    elif is_a(owner, (set, frozenset)):
        edges.append(Edge(owner, "member", None))
        return 1
    elif is_a(owner, torch.Tensor) and leaf_grad(owner) is child:
        edges.append(Edge(owner, "grad", "grad"))
        return 1
    for cls in type(owner).__mro__:
        refs = _REFS.get(cls)
        if refs is not None:
            for name in refs:
                try:
                    held = read_ref(owner, cls, name)
                except (AttributeError, LookupError, TypeError, ValueError):
                    continue
                if held is child:
                    edges.append(Edge(owner, "ref", name))
                    return 1
            break
    if is_a(owner, type):  # a class -> its __dict__ -> the value: a class attribute
        key = _dict_key(child, chain[i + 2]) if type(child) is dict and i + 2 < len(chain) else _MISSING
        if key is not _MISSING and class_dict(owner).get(key) is chain[i + 2]:
            edges.append(Edge(owner, "class", key))
            return 2
        return _ref(owner, child, edges)
    namespace = instance_dict(owner)
    if namespace is not None:
        if namespace is child and i + 2 < len(chain):  # owner -> its __dict__ -> value: one attribute
            key = _dict_key(namespace, chain[i + 2])
            if key is not _MISSING:
                edges.append(Edge(owner, "attr", key))
                return 2
        for k, v in dict.items(namespace):
            if v is child:
                edges.append(Edge(owner, "attr", k))
                return 1
    slot = _slot_name(owner, child)
    if slot is not None:
        edges.append(Edge(owner, "slot", slot))
        return 1
    return _ref(owner, child, edges)


def _slot_name(obj: Any, child: Any) -> str | None:
    for cls in type(obj).__mro__:
        namespace = class_dict(cls)
        slots = namespace.get("__slots__", ())
        for name in (slots,) if type(slots) is str else slots if type(slots) in (tuple, list) else ():
            descriptor = namespace.get(name)
            if type(descriptor) is not types.MemberDescriptorType:
                continue
            try:
                if descriptor.__get__(obj, type(obj)) is child:
                    return str(name)
            except AttributeError:  # an unset slot
                continue
    return None


def _collapse_module_state(edges: list[Edge]) -> list[Edge]:
    """``module._modules['layers']`` becomes the attribute it is: ``module.layers``."""
    out: list[Edge] = []
    i = 0
    while i < len(edges):
        edge = edges[i]
        if (
            edge.kind == "attr"
            and edge.key in MODULE_STATE
            and is_a(edge.owner, nn.Module)
            and i + 1 < len(edges)
            and edges[i + 1].kind == "item"
            and type(edges[i + 1].key) is str
        ):
            out.append(Edge(edge.owner, "attr", edges[i + 1].key))
            i += 2
            continue
        out.append(edge)
        i += 1
    return out
