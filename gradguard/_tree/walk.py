"""The tree walk: ``detach_tree`` (lazy, exact, shared references kept shared) and ``find_graphs``.

A *graph tensor* is a tensor that carries ``grad_fn``: it keeps its autograd graph alive. Leaves (no
``grad_fn``) hold no graph, whether they require grad or not (a ``Parameter``, a receive buffer), so
they are never replaced: detaching one would change its type and cut it from its ``.grad`` and free
nothing.

How containers are taken apart and rebuilt is :mod:`gradguard._tree.containers`' business. The walk
recurses; exact ``dict``/``list``/``tuple`` children are scanned inline, which is what a
per-micro-batch record costs. Past ``_MAX_DEPTH`` levels the same walk goes on with an explicit stack,
so any depth terminates without a ``RecursionError``. Every object is walked once: a tensor or
container met twice comes back as the same replacement both times, and a cycle terminates (a
container that contains itself *and* must be rebuilt raises :class:`GradGuardError`: a copy cannot
keep the self-reference).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import torch

from .._errors import GradGuardError
from . import containers as _containers
from .containers import ATOM, OPAQUE, SEALED, TENSOR, Spec, object_state, spec_for, state_keys

__all__ = [
    "Detached",
    "GraphRecord",
    "detach",
    "detach_tree",
    "find_graphs",
    "graph_record",
    "iter_tensors",
    "map_tensors",
    "substitute",
]

T = TypeVar("T")
_Tensor = torch.Tensor
_MAX_DEPTH = 100


Detached = tuple[Any, int]
"""What one :func:`detach` walk did: the detached object (the input itself when nothing changed) and
the number of distinct graph tensors it replaced."""


def detach_tree(obj: T) -> T:
    """Return ``obj`` with every tensor that carries ``grad_fn`` replaced by ``tensor.detach()``.

    Contract:

    * A detached tensor shares its storage, keeps its subclass (nested tensors, ``DTensor``,
      quantized subclasses) and its Python attributes. Leaves, parameters included, and tensors
      without ``grad_fn`` are the same objects.
    * Lazy: a container in which nothing changed comes back as the *same object*; a changed one is
      a new container of the same type, with the same non-tensor content and state, whose unchanged
      branches are the original objects. The input is never mutated.
    * References stay shared: a tensor or container reached twice is replaced by one object.
    * Objects that no rule can rebuild pass through untouched, as do dict keys and set elements
      (they hash by identity); :func:`find_graphs` still looks into them. See :func:`register_container`.
    * Any depth and self-reference terminate.

    Args:
        obj: Any object: a tensor, a container of them at any depth, or an object no rule knows.

    Returns:
        ``obj`` itself when it holds no tensor that carries ``grad_fn``; else a copy of the same type
        in which those tensors are detached.

    Raises:
        GradGuardError: a self-referencing container that would have to be rebuilt, or a container
            whose rebuild fails.
    """
    return _Walk(_detach_tensor).visit(obj, 0)


def detach(obj: Any) -> Detached:
    """:func:`detach_tree`, also telling how many tensors it detached."""
    walk = _Walk(_detach_tensor)
    value = walk.visit(obj, 0)
    return value, len(walk.tensors)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``; the same laziness and sharing as :func:`detach_tree`.

    A tensor for which ``fn`` returns the same object leaves its containers untouched.
    """
    return _Walk(fn).visit(obj, 0)


def substitute(obj: Any, replacements: dict[int, tuple[Any, Any]]) -> Any:
    """``obj`` rebuilt with objects replaced wherever it holds them: ``{id(old): (old, new)}``.

    The same exact rebuild and sharing as :func:`detach_tree`; nothing else is replaced.
    """
    walk = _Walk(_same)
    for key, (old, new) in replacements.items():
        (walk.tensors if isinstance(old, torch.Tensor) else walk.walked)[key] = (old, new)
    return walk.visit(obj, 0)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _detach_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.grad_fn is not None else t


class _Walk:
    """One walk: what it does to a tensor, and what it replaced already.

    ``tensors`` maps ``id(original)`` to ``(original, replacement)`` for the tensors that changed,
    ``walked`` for every container walked to its end, the unchanged ones mapped to themselves (the
    original is kept so its id cannot be reused by an object made during the walk). Without that memo
    a container reached twice at every level (a dict that holds itself and a list holding it) is
    walked an exponential number of times. The recursive walk does not track the containers it is
    inside: a cycle recurses until ``_MAX_DEPTH``, where the explicit-stack walk, which does track
    them, takes over and resolves it.
    """

    __slots__ = ("fn", "detaching", "tensors", "walked", "entered", "self_containing")

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn
        self.detaching = fn is _detach_tensor  # then a tensor without grad_fn is skipped inline
        self.tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.walked: dict[int, tuple[Any, Any]] = {}
        self.entered: set[int] | None = None  # the explicit-stack walk: containers whose children it walks
        self.self_containing: set[int] | None = None  # ... and those it met again while walking them

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` replaced (once: a tensor met again gets the same replacement)."""
        if self.detaching:
            return t if t.grad_fn is None else self.detached(t)
        entry = self.tensors.get(id(t))
        if entry is not None:
            return entry[1]
        new = self.fn(t)
        return t if new is t else self.keep(t, new)

    def detached(self, t: torch.Tensor) -> torch.Tensor:
        """``t.detach()`` for a tensor that carries ``grad_fn``; the same object each time ``t`` is met."""
        entry = self.tensors.get(id(t))
        if entry is not None:
            return entry[1]
        new = t.detach()
        if t.__dict__:
            return self.keep(t, new)
        self.tensors[id(t)] = (t, new)
        return new

    def keep(self, t: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        if t.__dict__:  # attributes on the tensor object (t.tag = ...): keep them
            new.__dict__.update({k: self.visit(v, 1) for k, v in t.__dict__.items()})
        self.tensors[id(t)] = (t, new)
        return new

    def visit(self, obj: Any, depth: int) -> Any:
        cls = type(obj)
        if cls is _Tensor:
            return self.tensor(obj)
        if cls is str or cls is int or cls is float or cls is bool or obj is None:
            return obj
        if cls is dict or cls is list or cls is tuple:
            return self.builtin(obj, cls, depth)
        spec = spec_for(cls)
        if spec is TENSOR:
            return self.tensor(obj)
        if spec is ATOM or spec is OPAQUE or spec is SEALED:
            return obj  # nothing inside, or nothing a copy could be built of
        return self.container(obj, spec, depth)

    def builtin(self, obj: Any, cls: type, depth: int) -> Any:
        """An exact ``dict``/``list``/``tuple``: children scanned inline, rebuilt only when one changed."""
        if depth >= _MAX_DEPTH:
            return self.deep(obj)
        walked = self.walked
        entry = walked.get(id(obj))
        if entry is not None:
            return entry[1]
        items = obj.values() if cls is dict else obj
        new: list[Any] | None = None
        for index, child in enumerate(items):
            kind = type(child)
            if kind is _Tensor:
                if not self.detaching:
                    value = self.tensor(child)
                elif child.grad_fn is None:
                    continue  # the common clean child, without a call
                else:
                    value = self.detached(child)
            elif kind is dict or kind is list or kind is tuple:
                value = self.builtin(child, kind, depth + 1)
            elif kind is str or kind is float or kind is int or kind is bool or child is None:
                continue
            else:
                value = self.visit(child, depth + 1)
            if value is not child:
                if new is None:
                    new = list(items)
                new[index] = value
        if new is None:
            walked[id(obj)] = (obj, obj)
            return obj
        result: Any = dict(zip(obj, new)) if cls is dict else new if cls is list else tuple(new)
        walked[id(obj)] = (obj, result)
        return result

    def container(self, obj: Any, spec: Spec, depth: int) -> Any:
        """Any other container, through its spec."""
        if depth >= _MAX_DEPTH:
            return self.deep(obj)
        entry = self.walked.get(id(obj))
        if entry is not None:
            return entry[1]
        children, context = spec.flatten(obj)
        new: list[Any] | None = None
        for i, child in enumerate(children):
            value = self.visit(child, depth + 1)
            if value is not child:
                if new is None:
                    new = list(children)
                new[i] = value
        result = obj if new is None else spec.unflatten(new, context)
        self.walked[id(obj)] = (obj, result)
        return result

    def replace(self, obj: Any, new: Any) -> Any:
        """A rebuilt container of the explicit-stack walk; one that contains itself cannot be rebuilt."""
        assert self.self_containing is not None
        if id(obj) in self.self_containing:
            raise GradGuardError(
                f"gradguard: a {type(obj).__qualname__} contains itself and holds a tensor that carries a "
                "graph; a rebuilt copy cannot keep that self-reference. Break the cycle, or detach the "
                "tensor where it is created."
            )
        return new

    def deep(self, root: Any) -> Any:
        """The same walk with an explicit stack, for a subtree below ``_MAX_DEPTH`` levels."""
        entered = self.entered = self.entered or set()
        self_containing = self.self_containing = self.self_containing or set()
        # frame: [obj, spec, children, context, next index, new children or None]
        stack: list[list[Any]] = []
        result: Any = None

        def enter(obj: Any) -> tuple[bool, Any]:
            """``(True, replacement)`` for a leaf or a container already walked; ``(False, None)`` when pushed."""
            cls = type(obj)
            spec = _containers_spec(cls)
            if spec is TENSOR:
                return True, self.tensor(obj)
            if spec is ATOM or spec is OPAQUE or spec is SEALED:
                return True, obj
            oid = id(obj)
            entry = self.walked.get(oid)
            if entry is not None:
                return True, entry[1]
            if oid in entered:
                self_containing.add(oid)
                return True, obj
            entered.add(oid)
            children, context = spec.flatten(obj)
            stack.append([obj, spec, list(children), context, 0, None])
            return False, None

        done, result = enter(root)
        while stack:
            frame = stack[-1]
            obj, spec, children, context, i, new = frame
            if i < len(children):
                frame[4] = i + 1
                done, value = enter(children[i])
                if done and value is not children[i]:
                    if new is None:
                        new = frame[5] = list(children)
                    new[i] = value
                continue
            stack.pop()
            entered.discard(id(obj))
            value = obj if new is None else self.replace(obj, spec.unflatten(new, context))
            self.walked[id(obj)] = (obj, value)
            if stack:
                parent = stack[-1]
                j = parent[4] - 1
                if value is not parent[2][j]:
                    if parent[5] is None:
                        parent[5] = list(parent[2])
                    parent[5][j] = value
            else:
                result = value
        return result


def _containers_spec(cls: type) -> Spec:
    if cls is _Tensor:
        return TENSOR
    return spec_for(cls)


# --------------------------------------------------------------------------------------------------
# Inspection: find_graphs and iter_tensors
# --------------------------------------------------------------------------------------------------


class GraphRecord(NamedTuple):
    """One tensor that carries ``grad_fn``, found by :func:`find_graphs`.

    The record holds no reference to the tensor, so keeping it pins nothing.

    Attributes:
        path: How to reach the tensor from the inspected object, e.g. ``['model_output']['log_probs']``,
            ``[3].entropy`` or ``.keys()[0]`` (a dict key); the empty string is the object itself.
        shape: The tensor's shape (a jagged nested tensor's ragged size is a ``torch.SymInt``); ``None``
            where the tensor has no single shape (strided nested tensors).
        dtype: The tensor's dtype.
        device: The tensor's device.
        grad_fn: The name of its ``grad_fn``'s type, e.g. ``"MulBackward0"``.
    """

    path: str
    shape: tuple[int | torch.SymInt, ...] | None
    dtype: torch.dtype
    device: torch.device
    grad_fn: str


def find_graphs(obj: object) -> list[GraphRecord]:
    """Every distinct tensor in ``obj`` that carries ``grad_fn``.

    Looks everywhere :func:`detach_tree` looks, and also where it cannot rebuild: dict keys, set
    elements, a registered pytree node's context, tensors' attributes, and the attributes of objects
    no rule knows (read from their ``__dict__`` and slots, never through user code). Classes, modules
    and functions are not looked into. Each object is visited once, so cycles terminate.

    Args:
        obj: Any object: a tensor, a container of them at any depth, or an object no rule knows.

    Returns:
        One :class:`GraphRecord` per tensor, in container order (depth first); empty when there is none.
    """
    return [graph_record(t, path) for path, t in iter_tensors(obj) if t.grad_fn is not None]


def iter_tensors(obj: object) -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for each distinct tensor reachable from ``obj``, depth first, in container order."""
    seen: set[int] = set()
    keep_alive: list[Any] = []  # ids stay unique only while their objects live; flatten may make new ones
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        item, path = stack.pop()
        cls = type(item)
        if cls is str or cls is int or cls is float or item is None or id(item) in seen:
            continue
        seen.add(id(item))
        keep_alive.append(item)
        spec = _containers_spec(cls)
        if spec is ATOM:
            continue
        children: list[Any]
        labels: list[str]
        if spec is TENSOR:
            yield path, item
            where, children = object_state(item) if item.__dict__ else ([], [])
            labels = state_keys(where)
        elif spec is OPAQUE:
            where, children = object_state(item)
            labels = state_keys(where)
        elif spec is SEALED:
            children = list(item)
            labels = [f"{{#{i}}}" for i in range(len(children))]
        else:
            children, context = spec.flatten(item)
            children = list(children)
            labels = spec.keys(item, context)
            labels += [f"[{i}]" for i in range(len(labels), len(children))]
            if isinstance(item, dict):
                keys = [k for k in item if type(k) is not str and type(k) is not int]
                children += keys
                labels += [f".keys()[{list(item).index(k)}]" for k in keys]
        stack.extend((c, path + label) for c, label in zip(reversed(children), reversed(labels)))


def graph_record(t: torch.Tensor, path: str = "") -> GraphRecord:
    """The :class:`GraphRecord` of ``t``, a tensor that carries ``grad_fn``, found at ``path``."""
    try:
        shape: tuple[int | torch.SymInt, ...] | None = tuple(t.shape)
    except RuntimeError:
        shape = None
    return GraphRecord(path, shape, t.dtype, t.device, type(t.grad_fn).__name__)


register_container = _containers.register_container
unregister_container = _containers.unregister_container
