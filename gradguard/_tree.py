"""The tree walk: a lazy ``detach_tree``, the container registry, and ``find_graphs``.

Containers are understood through one protocol, a *spec*: ``flatten(obj) -> (children, context)``
and ``unflatten(children, context) -> obj``. Exact ``dict``/``list``/``tuple``/``Tensor`` never
reach a spec: they take the fast path at the top of :func:`_fast`, which is what the common case
(an engine's per-micro-batch record) pays for. Every other container goes through its spec, chosen
once per type (cached) in this order: types registered with :func:`register_container`, types
registered with ``torch.utils._pytree``, namedtuples and structseqs, mappings, deques, dataclasses,
list and tuple subclasses. Anything else is a leaf and passes through untouched.

The fast path recurses up to ``_FAST_DEPTH`` levels; deeper (or self-referencing) inputs are redone
by an iterative walk that handles any depth, keeps shared sub-objects shared, and raises
:class:`GradGuardError` for the one case a lazy copy cannot express: a container that contains
itself *and* holds a tensor that needs detaching.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree

from ._errors import GradGuardError

__all__ = ["GraphRecord", "detach_tree", "find_graphs", "register_container", "unregister_container"]

_Tensor = torch.Tensor
_ATOMS = frozenset({int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device})
_FAST_DEPTH = 64


class _Spec(NamedTuple):
    flatten: Callable[[Any], tuple[Sequence[Any], Any]]
    unflatten: Callable[[list[Any], Any], Any]
    # Path segments for find_graphs: labels(obj, context, n_children) -> list[str]
    labels: Callable[[Any, Any, int], list[str]]


class _TooDeep(Exception):
    """Internal signal: the fast recursive walk hands over to the iterative one."""


_PENDING = object()  # _rebuild: the first changed child is a tensor not yet detached


# --------------------------------------------------------------------------------------------------
# The hot path
# --------------------------------------------------------------------------------------------------


def detach_tree(obj: Any) -> Any:
    """Return ``obj`` with every tensor that requires grad replaced by ``tensor.detach()``.

    Contract:
      * Tensors that do not require grad come back as the same object; detached tensors share their
        storage (and keep their subclass: nested tensors, ``DTensor``, quantized subclasses).
      * Lazy: a container in which nothing changed comes back as the *same object*. A container in
        which something changed is a new container of the same type whose unchanged branches are
        the original objects. The input is never mutated.
      * Unknown objects pass through untouched (see :func:`register_container`).
      * Any depth and self-reference terminate; a self-referencing container that would have to be
        rebuilt raises :class:`GradGuardError`.
    """
    return detach_counted(obj, [0])


def detach_counted(obj: Any, count: list[int]) -> Any:
    """:func:`detach_tree`, adding the number of tensors it detached to ``count[0]``."""
    try:
        return _fast(obj, 0, count)
    except (_TooDeep, RecursionError):
        return _detach_deep(obj, count)


def _detach_deep(obj: Any, count: list[int]) -> Any:
    """The iterative walk, for what the fast one gave up on (too deep, or a cycle)."""
    count[0] = 0  # the fast walk's partial count
    return _slow(obj, _counting_detach(count))


def _fast(obj: Any, depth: int, count: list[int]) -> Any:
    cls = type(obj)
    if cls is dict:
        children: Any = obj.values()
    elif cls is list or cls is tuple:
        children = obj
    elif cls is _Tensor:
        if obj.requires_grad:
            count[0] += 1
            return obj.detach()
        return obj
    elif cls in _ATOMS:
        return obj
    else:
        return _general(obj, depth, count)
    if depth > _FAST_DEPTH:
        raise _TooDeep
    # Scan for the first child that changes: most records have none and come back as they are.
    for child in children:
        kind = type(child)
        if kind is _Tensor:
            if child.requires_grad:
                return _rebuild(obj, cls, child, _PENDING, depth, count)
            continue
        if kind in _ATOMS:
            continue
        if kind is dict or kind is list or kind is tuple:
            # One level scanned inline, without a call: a record's sub-containers mostly hold tensors
            # and scalars. On a hit the recursive call below walks this child again.
            for grandchild in child.values() if kind is dict else child:
                inner = type(grandchild)
                if inner is _Tensor:
                    if grandchild.requires_grad:
                        break
                elif inner not in _ATOMS:
                    break
            else:
                continue
        new = _fast(child, depth + 1, count)
        if new is not child:
            return _rebuild(obj, cls, child, new, depth, count)
    return obj


def _rebuild(obj: Any, cls: type, first: Any, first_new: Any, depth: int, count: list[int]) -> Any:
    """A new ``dict``/``list``/``tuple``: children before ``first`` (the first that changes, already
    scanned) are kept, ``first`` becomes ``first_new`` (a tensor still to detach: ``_PENDING``), the
    rest are walked."""
    items = iter(obj.items()) if cls is dict else enumerate(obj)
    out = obj.copy() if cls is dict else list(obj)
    for key, child in items:  # noqa: B007 - key is where first sits, used below
        if child is first:
            break
    detached = 0
    if first_new is _PENDING:
        detached = 1
        first_new = first.detach()
    out[key] = first_new
    for key, child in items:
        kind = type(child)
        if kind is _Tensor:
            if child.requires_grad:
                detached += 1
                out[key] = child.detach()
        elif kind not in _ATOMS:
            new = _fast(child, depth + 1, count)
            if new is not child:
                out[key] = new
    count[0] += detached
    return tuple(out) if cls is tuple else out


def _general(obj: Any, depth: int, count: list[int]) -> Any:
    if isinstance(obj, _Tensor):
        if obj.requires_grad:
            count[0] += 1
            return obj.detach()
        return obj
    spec = _spec_for(type(obj))
    if spec is None:
        return obj
    children, context = spec.flatten(obj)
    new = None
    for i, child in enumerate(children):
        nc = _fast(child, depth + 1, count)
        if nc is not child:
            if new is None:
                new = list(children)
            new[i] = nc
    return obj if new is None else spec.unflatten(new, context)


# --------------------------------------------------------------------------------------------------
# The iterative walk: any depth, cycles, shared sub-objects
# --------------------------------------------------------------------------------------------------

_PUSHED = object()


class _Frame:
    __slots__ = ("obj", "spec", "children", "context", "index", "new")

    def __init__(self, obj: Any, spec: _Spec) -> None:
        self.obj = obj
        self.spec = spec
        children, self.context = spec.flatten(obj)
        self.children = list(children)
        self.index = 0
        self.new: list[Any] | None = None

    def take(self, value: Any) -> None:
        i = self.index - 1
        if value is not self.children[i]:
            if self.new is None:
                self.new = list(self.children)
            self.new[i] = value

    def finish(self) -> Any:
        return self.obj if self.new is None else self.spec.unflatten(self.new, self.context)


def _counting_detach(count: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    def leaf(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            count[0] += 1
            return t.detach()
        return t

    return leaf


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Like :func:`detach_tree`, with ``fn`` applied to every tensor (the general, iterative walk).

    Same laziness and structural sharing: a tensor for which ``fn`` returns the same object leaves
    its containers untouched.
    """
    return _slow(obj, fn)


def _slow(root: Any, leaf: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    done: dict[int, Any] = {}
    open_ids: set[int] = set()
    looped: set[int] = set()
    stack: list[_Frame] = []
    # ids stay unique only while their objects live; a flatten may hand out fresh containers
    keep_alive: list[Any] = []

    def enter(obj: Any) -> Any:
        if isinstance(obj, _Tensor):
            return leaf(obj)
        if type(obj) in _ATOMS:
            return obj
        oid = id(obj)
        if oid in done:
            return done[oid]
        if oid in open_ids:
            looped.add(oid)
            return obj
        spec = _spec_for(type(obj))
        if spec is None:
            return obj
        stack.append(_Frame(obj, spec))
        open_ids.add(oid)
        keep_alive.append(obj)
        return _PUSHED

    result = enter(root)
    while stack:
        frame = stack[-1]
        if frame.index < len(frame.children):
            child = frame.children[frame.index]
            frame.index += 1
            value = enter(child)
            if value is not _PUSHED:
                frame.take(value)
            continue
        stack.pop()
        value = frame.finish()
        oid = id(frame.obj)
        open_ids.discard(oid)
        if value is not frame.obj and oid in looped:
            raise GradGuardError(
                f"gradguard: a {type(frame.obj).__qualname__} contains itself and holds a tensor "
                "to replace (one that requires grad); a rebuilt copy cannot keep that "
                "self-reference. Break the cycle or detach the tensor where it is created."
            )
        done[oid] = value
        if stack:
            stack[-1].take(value)
        else:
            result = value
    return result


# --------------------------------------------------------------------------------------------------
# find_graphs
# --------------------------------------------------------------------------------------------------


class GraphRecord(NamedTuple):
    """One tensor that carries ``grad_fn``, found by :func:`find_graphs`.

    ``path`` is how to reach it from the inspected object, e.g. ``['model_output']['log_probs']``
    or ``[3].entropy``; the empty string is the object itself. ``shape`` is ``None`` where the
    tensor has no single shape (strided nested tensors). The record holds no reference to the
    tensor, so keeping it pins nothing.
    """

    path: str
    shape: tuple[Any, ...] | None
    dtype: torch.dtype
    device: torch.device
    grad_fn: str


def find_graphs(obj: Any) -> list[GraphRecord]:
    """Return one :class:`GraphRecord` per distinct tensor in ``obj`` that carries ``grad_fn``.

    Walks the same containers as :func:`detach_tree` (any depth; each object visited once, so
    cycles terminate), in container order.
    """
    return [_record(t, path) for path, t in _iter_tensors(obj) if t.grad_fn is not None]


def _iter_tensors(obj: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for each distinct tensor in ``obj``, depth first, in container order."""
    seen: set[int] = set()
    keep_alive: list[Any] = []  # ids stay unique only while their objects live
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        item, path = stack.pop()
        if type(item) in _ATOMS or id(item) in seen:
            continue
        seen.add(id(item))
        keep_alive.append(item)
        if isinstance(item, _Tensor):
            yield path, item
            continue
        spec = _spec_for(type(item))
        if spec is None:
            continue
        children, context = spec.flatten(item)
        children = list(children)
        labels = spec.labels(item, context, len(children))
        stack.extend((c, path + lab) for c, lab in zip(reversed(children), reversed(labels)))


def _record(t: torch.Tensor, path: str) -> GraphRecord:
    try:
        shape: tuple[Any, ...] | None = tuple(t.shape)
    except RuntimeError:
        shape = None
    return GraphRecord(path, shape, t.dtype, t.device, type(t.grad_fn).__name__)


# --------------------------------------------------------------------------------------------------
# Specs and the registry
# --------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_user_specs: dict[type, _Spec] = {}
_internal_specs: dict[type, _Spec] = {}  # gradguard's own wrappers (guarded stores), see _register_internal
_spec_cache: dict[type, _Spec | None] = {}


def register_container(
    cls: type,
    flatten: Callable[[Any], tuple[Iterable[Any], Any]],
    unflatten: Callable[[list[Any], Any], Any],
) -> None:
    """Teach :func:`detach_tree` and :func:`find_graphs` a container type (and its subclasses).

    ``flatten(obj)`` returns ``(children, context)``; ``unflatten(children, context)`` builds a new
    container from a list of (possibly detached) children and that context. ``unflatten`` is only
    called when some child changed, and must not mutate the original. A registration takes
    precedence over every built-in rule and over ``torch.utils._pytree`` registrations.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_container: cls must be a class, got {cls!r}")
    if cls in (dict, list, tuple) or issubclass(cls, _Tensor) or cls in _ATOMS:
        raise GradGuardError(
            f"register_container: {cls.__qualname__} is handled natively and cannot be re-registered; "
            "register a subclass instead"
        )
    for name, fn in (("flatten", flatten), ("unflatten", unflatten)):
        if not callable(fn):
            raise TypeError(f"register_container: {name} must be callable, got {fn!r}")
    with _lock:
        _user_specs[cls] = _Spec(lambda o: _as_pair(flatten(o), cls), unflatten, _index_labels)
        _spec_cache.clear()


def unregister_container(cls: type) -> None:
    """Undo :func:`register_container` for ``cls``; a ``KeyError`` names a type never registered."""
    with _lock:
        if cls not in _user_specs:
            raise KeyError(f"unregister_container: {cls!r} was never registered")
        del _user_specs[cls]
        _spec_cache.clear()


def _register_internal(
    cls: type, flatten: Callable[[Any], tuple[list[Any], Any]], unflatten: Callable[[list[Any], Any], Any]
) -> None:
    """Let the walk see through a gradguard wrapper type (and its subclasses); its path adds nothing."""
    with _lock:
        _internal_specs[cls] = _Spec(flatten, unflatten, lambda o, c, n: [""] * n)
        _spec_cache.clear()


def _as_pair(result: Any, cls: type) -> tuple[list[Any], Any]:
    try:
        children, context = result
        return list(children), context
    except (TypeError, ValueError):
        raise GradGuardError(
            f"the flatten function registered for {cls.__qualname__} must return "
            f"(children, context); it returned {type(result).__qualname__}"
        ) from None


def _spec_for(cls: type) -> _Spec | None:
    try:
        return _spec_cache[cls]
    except KeyError:
        spec = _resolve(cls)
        _spec_cache[cls] = spec
        return spec


def _resolve(cls: type) -> _Spec | None:
    for base in cls.__mro__:
        if base in _user_specs:
            return _user_specs[base]
        if base in _internal_specs:
            return _internal_specs[base]
    if cls is dict or cls is collections.OrderedDict or cls is collections.defaultdict:
        return _MAPPING
    if cls is list:
        return _LIST
    if cls is tuple:
        return _TUPLE
    if cls is collections.deque:
        return _DEQUE
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return _NAMEDTUPLE
    if issubclass(cls, tuple) and hasattr(cls, "n_sequence_fields"):
        return _STRUCTSEQ  # torch.return_types.*
    node = _pytree.SUPPORTED_NODES.get(cls)
    if node is not None:
        return _Spec(node.flatten_fn, node.unflatten_fn, _index_labels)
    if issubclass(cls, tuple):
        return _TUPLE_SUBCLASS
    if issubclass(cls, Mapping):
        return _MAPPING
    if issubclass(cls, collections.deque):
        return _DEQUE
    if dataclasses.is_dataclass(cls):
        return _DATACLASS
    if issubclass(cls, list):
        return _LIST_SUBCLASS
    return None


def _index_labels(obj: Any, context: Any, n: int) -> list[str]:
    return [f"[{i}]" for i in range(n)]


# Mappings: a shallow copy keeps the exact type and everything the type carries (default_factory,
# attributes); assigning the changed values keeps key order.
def _mapping_flatten(m: Mapping[Any, Any]) -> tuple[list[Any], Any]:
    keys = list(m.keys())
    return [m[k] for k in keys], (m, keys)


def _mapping_unflatten(values: list[Any], context: Any) -> Any:
    original, keys = context
    if type(original) is dict:
        return dict(zip(keys, values))
    if isinstance(original, types.MappingProxyType):
        return types.MappingProxyType(dict(zip(keys, values)))
    first_error: Exception | None = None
    if isinstance(original, (dict, collections.UserDict)):
        # Their shallow copy owns its items: it keeps the exact type, default_factory, attributes.
        try:
            new = copy.copy(original)
            for k, v in zip(keys, values):
                if new[k] is not v:
                    new[k] = v
            return new
        except Exception as exc:  # a mapping that refuses mutation: try its constructor below
            first_error = exc
    # Any other mapping: a shallow copy may share its storage (an attribute dict) with the
    # original, so writing into it would mutate the input; rebuild through the constructor.
    try:
        return type(original)(zip(keys, values))
    except Exception as exc:
        raise GradGuardError(
            f"detach_tree cannot rebuild a {type(original).__qualname__} holding a tensor that "
            f"requires grad ({first_error or exc}); teach it with gradguard.register_container"
        ) from exc


def _mapping_labels(obj: Any, context: Any, n: int) -> list[str]:
    return [f"[{k!r}]" for k in context[1]]


def _seq_flatten(s: Sequence[Any]) -> tuple[list[Any], Any]:
    return list(s), s


def _tuple_subclass_unflatten(values: list[Any], original: Any) -> Any:
    try:
        return type(original)(values)
    except Exception as exc:
        raise GradGuardError(
            f"detach_tree cannot rebuild a {type(original).__qualname__} holding a tensor that "
            f"requires grad ({exc}); teach it with gradguard.register_container"
        ) from exc


def _list_subclass_unflatten(values: list[Any], original: Any) -> Any:
    new = copy.copy(original)
    new[:] = values
    return new


def _deque_unflatten(values: list[Any], original: collections.deque[Any]) -> Any:
    # Not copy.copy: deque.__copy__ rebuilds a subclass as type(d)(d, maxlen), which drops its
    # attributes and calls its __init__. Build the same type, keep maxlen and the instance dict.
    cls = type(original)
    if cls is collections.deque:
        return collections.deque(values, original.maxlen)
    new = cls.__new__(cls)
    collections.deque.__init__(new, values, original.maxlen)
    state = getattr(original, "__dict__", None)
    if state:
        new.__dict__.update(state)
    return new


def _attr_labels(obj: Any, context: Any, n: int) -> list[str]:
    names: tuple[str, ...] = getattr(type(obj), "_fields", None) or getattr(type(obj), "__match_args__", ()) or ()
    return [f".{name}" for name in names] + [f"[{i}]" for i in range(len(names), n)]


def _dataclass_flatten(obj: Any) -> tuple[list[Any], Any]:
    names = [f.name for f in dataclasses.fields(obj) if hasattr(obj, f.name)]
    return [getattr(obj, n) for n in names], (obj, names)


def _dataclass_unflatten(values: list[Any], context: Any) -> Any:
    # copy + object.__setattr__: frozen classes and init=False fields survive, __post_init__ does
    # not run again.
    original, names = context
    new = copy.copy(original)
    for name, value in zip(names, values):
        object.__setattr__(new, name, value)
    return new


_MAPPING = _Spec(_mapping_flatten, _mapping_unflatten, _mapping_labels)
_LIST = _Spec(_seq_flatten, lambda v, o: v, _index_labels)
_TUPLE = _Spec(_seq_flatten, lambda v, o: tuple(v), _index_labels)
_DEQUE = _Spec(_seq_flatten, _deque_unflatten, _index_labels)
_NAMEDTUPLE = _Spec(_seq_flatten, lambda v, o: type(o)._make(v), _attr_labels)
_STRUCTSEQ = _Spec(_seq_flatten, lambda v, o: type(o)(v), _attr_labels)
_TUPLE_SUBCLASS = _Spec(_seq_flatten, _tuple_subclass_unflatten, _index_labels)
_LIST_SUBCLASS = _Spec(_seq_flatten, _list_subclass_unflatten, _index_labels)
_DATACLASS = _Spec(_dataclass_flatten, _dataclass_unflatten, lambda o, c, n: [f".{name}" for name in c[1]])
