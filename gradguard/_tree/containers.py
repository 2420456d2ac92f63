"""The container registry: how the tree walk takes a container apart and builds an exact copy of it.

Every container kind is one :class:`Spec`: ``flatten(obj) -> (children, context)`` and
``unflatten(children, context) -> new object``, plus ``keys(obj, context)``, the path segment of each
child (``['log_probs']``, ``[3]``, ``.entropy``) for messages. ``unflatten`` is called only when a
child changed, and must build a *new* object without touching the original. The rules, chosen once
per type, first match wins:

1. types registered with :func:`register_container` (and their subclasses);
2. gradguard's own guarded stores;
3. ``dict``/``list``/``tuple``/``deque`` and their subclasses, namedtuples and structseqs
   (``torch.return_types.*``): the items are read and written at C level, so a subclass's
   ``__iter__``/``__setitem__``/``__init__`` overrides are never run, and the instance's own state
   (``__dict__`` and slots: a ``default_factory``, ``maxlen``, user attributes) is kept;
4. dataclasses, ``types.SimpleNamespace`` and instances of the ``Mapping``/``Sequence`` ABCs that are
   none of the above (``UserDict``, ``UserList``, ``ChainMap``, a user's ``MutableMapping``): their
   state is their content, so they are rebuilt as ``cls.__new__(cls)`` with the state set directly
   (``__init__``/``__post_init__`` do not run again; frozen classes stay frozen);
5. types registered with ``torch.utils._pytree`` (their context is walked too);
6. ``set``/``frozenset``, whose elements hash by identity, are *sealed*: looked into, never rebuilt.

Exact atoms (numbers, strings, ``None``, dtypes, devices) are leaves; tensors are the walk's business.
Anything else is *opaque*: the detach walk cannot rebuild it, and inspection looks into its state.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from .._compat import is_namedtuple_class, is_structseq_class, pytree_keystr, pytree_nodes
from .._errors import GradGuardError

__all__ = [
    "ATOM",
    "OPAQUE",
    "SEALED",
    "TENSOR",
    "Spec",
    "is_builtin_atom",
    "Slot",
    "object_state",
    "register_container",
    "register_internal",
    "spec_for",
    "state_keys",
    "unregister_container",
]

C = TypeVar("C")
_Tensor = torch.Tensor
Flatten = Callable[[Any], tuple[list[Any], Any]]
Unflatten = Callable[[list[Any], Any], Any]
Keys = Callable[[Any, Any], list[str]]


class Spec(NamedTuple):
    """How one container kind is taken apart and rebuilt; see the module docstring.

    ``item_keys(context)``, where given, names the container's *items* (mapping keys, sequence
    indices): the first ``len(item_keys(context))`` children; the rest is its state.
    """

    name: str
    flatten: Flatten
    unflatten: Unflatten
    keys: Keys
    item_keys: Callable[[Any], list[Any]] | None = None


# Kinds that are not containers: returned by spec_for in place of a Spec.
ATOM = Spec("atom", lambda o: ([], None), lambda c, x: None, lambda o, x: [])
TENSOR = Spec("tensor", lambda o: ([], None), lambda c, x: None, lambda o, x: [])
OPAQUE = Spec("opaque", lambda o: ([], None), lambda c, x: None, lambda o, x: [])
SEALED = Spec("sealed", lambda o: (list(o), None), lambda c, x: None, lambda o, x: [f"{{#{i}}}" for i in range(len(o))])

_ATOMS = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size, range)


def is_builtin_atom(cls: type) -> bool:
    """Whether ``cls`` is one of the exact leaf types (no containers, no tensors inside)."""
    return any(cls is atom for atom in _ATOMS)


# --------------------------------------------------------------------------------------------------
# Instance state: __dict__ and slots
# --------------------------------------------------------------------------------------------------


class Slot(NamedTuple):
    """One slot of an instance: its attribute name (mangled, as Python stores it) and its descriptor."""

    name: str
    descriptor: Any


_slot_cache: weakref.WeakKeyDictionary[type, tuple[Slot, ...]] = weakref.WeakKeyDictionary()


def _slots(cls: type) -> tuple[Slot, ...]:
    """The slots every class of ``cls``'s MRO declares, with the descriptor of the class declaring each."""
    try:
        return _slot_cache[cls]
    except (KeyError, TypeError):
        pass
    found: list[Slot] = []
    for base in cls.__mro__:
        declared = base.__dict__.get("__slots__", ())
        for name in (declared,) if isinstance(declared, str) else declared:
            if name in ("__dict__", "__weakref__"):
                continue
            if name.startswith("__") and not name.endswith("__"):
                name = f"_{base.__name__.lstrip('_')}{name}"  # the name Python mangled it to
            descriptor = base.__dict__.get(name)
            if isinstance(descriptor, types.MemberDescriptorType):
                found.append(Slot(name, descriptor))
    slots = tuple(found)
    try:
        _slot_cache[cls] = slots
    except TypeError:
        pass  # an unhashable metaclass: recomputed each time
    return slots


def object_state(obj: Any) -> tuple[list[str | Slot], list[Any]]:
    """The instance's own attributes, ``__dict__`` entries first, then the slots that are set.

    ``(where, values)``: ``where`` holds a ``__dict__`` key or a :class:`Slot` per value. Read without
    running user code: the instance dictionary and the slot descriptors directly.
    """
    where: list[str | Slot] = []
    values: list[Any] = []
    state = getattr(obj, "__dict__", None)
    if type(state) is dict:
        where.extend(state)
        values.extend(state.values())
    for slot in _slots(type(obj)):
        try:
            value = slot.descriptor.__get__(obj, type(obj))
        except AttributeError:
            continue  # declared, never set
        where.append(slot)
        values.append(value)
    return where, values


def _set_state(new: Any, where: list[str | Slot], values: Sequence[Any]) -> None:
    """Set ``values`` on ``new`` where :func:`object_state` read them (frozen classes included)."""
    for place, value in zip(where, values):
        if isinstance(place, Slot):
            place.descriptor.__set__(new, value)
        else:
            new.__dict__[place] = value


def state_keys(where: list[str | Slot]) -> list[str]:
    """Path segments of the state :func:`object_state` read: ``.name`` each."""
    return [f".{place.name if isinstance(place, Slot) else place}" for place in where]


def _new_instance(cls: type, base_new: Callable[..., Any]) -> Any:
    try:
        return base_new(cls)
    except Exception as exc:
        raise GradGuardError(
            f"gradguard cannot rebuild a {cls.__qualname__} holding a tensor that carries a graph: creating "
            f"an empty one failed ({type(exc).__name__}: {exc}). Teach it with gradguard.register_container"
        ) from exc


# --------------------------------------------------------------------------------------------------
# Builtin container families: items at C level, plus instance state
# --------------------------------------------------------------------------------------------------


def _dict_base(cls: type) -> type:
    if issubclass(cls, collections.OrderedDict):
        return collections.OrderedDict
    if issubclass(cls, collections.defaultdict):
        return collections.defaultdict
    return dict


def _dict_spec(cls: type) -> Spec:
    base: Any = _dict_base(cls)
    setitem = base.__setitem__

    def unflatten(children: list[Any], context: Any) -> Any:
        keys, names, original_type, factory = context
        new = _new_instance(original_type, base.__new__)
        if base is collections.defaultdict:
            new.default_factory = factory
        for key, value in zip(keys, children):
            setitem(new, key, value)
        _set_state(new, names, children[len(keys) :])
        return new

    def flatten(obj: Any) -> tuple[list[Any], Any]:
        keys = list(base.keys(obj))  # type: ignore[attr-defined]
        names, state = object_state(obj)
        factory = obj.default_factory if base is collections.defaultdict else None
        return [dict.__getitem__(obj, k) for k in keys] + state, (keys, names, type(obj), factory)

    def keys(obj: Any, context: Any) -> list[str]:
        return [f"[{_safe_repr(k)}]" for k in context[0]] + state_keys(context[1])

    return Spec(f"{cls.__qualname__} (dict)", flatten, unflatten, keys, lambda context: context[0])


def _list_flatten(obj: list[Any]) -> tuple[list[Any], Any]:
    items = list.copy(obj)
    names, state = object_state(obj)
    return items + state, (len(items), names, type(obj))


def _list_unflatten(children: list[Any], context: Any) -> Any:
    n, names, cls = context
    new = _new_instance(cls, list.__new__)
    list.extend(new, children[:n])
    _set_state(new, names, children[n:])
    return new


def _tuple_flatten(obj: tuple[Any, ...]) -> tuple[list[Any], Any]:
    items = list(tuple.__iter__(obj))
    names, state = object_state(obj)
    return items + state, (len(items), names, type(obj))


def _tuple_unflatten(children: list[Any], context: Any) -> Any:
    n, names, cls = context
    try:
        new = tuple.__new__(cls, children[:n])
    except Exception as exc:
        raise GradGuardError(
            f"gradguard cannot rebuild a {cls.__qualname__}: tuple.__new__ refused it ({exc}); "
            "teach it with gradguard.register_container"
        ) from exc
    _set_state(new, names, children[n:])
    return new


def _structseq_flatten(obj: Any) -> tuple[list[Any], Any]:
    # structseqs may carry fields beyond the sequence ones; __reduce__ gives both (os.stat_result)
    _, (sequence, extra) = obj.__reduce__()
    return list(sequence), (type(obj), extra, len(sequence))


def _structseq_unflatten(children: list[Any], context: Any) -> Any:
    cls, extra, _ = context
    return cls(children, extra) if extra else cls(children)


def _deque_flatten(obj: collections.deque[Any]) -> tuple[list[Any], Any]:
    items = list(collections.deque.__iter__(obj))
    names, state = object_state(obj)
    return items + state, (len(items), names, type(obj), obj.maxlen)


def _deque_unflatten(children: list[Any], context: Any) -> Any:
    n, names, cls, maxlen = context
    new = _new_instance(cls, collections.deque.__new__)
    collections.deque.__init__(new, children[:n], maxlen)
    _set_state(new, names, children[n:])
    return new


def _sequence_keys(obj: Any, context: Any) -> list[str]:
    n, names = context[0], context[1]
    fields: tuple[str, ...] = getattr(context[2], "_fields", ()) if is_namedtuple_class(context[2]) else ()
    return [f".{f}" for f in fields[:n]] + [f"[{i}]" for i in range(len(fields), n)] + state_keys(names)


def _structseq_keys(obj: Any, context: Any) -> list[str]:
    cls = context[0]
    fields: tuple[str, ...] = tuple(getattr(cls, "_fields", ()) or getattr(cls, "__match_args__", ()))
    n = context[2]
    return [f".{f}" for f in fields[:n]] + [f"[{i}]" for i in range(len(fields), n)]


def _indices(context: Any) -> list[int]:
    return list(range(context[0]))


_LIST = Spec("list", _list_flatten, _list_unflatten, _sequence_keys, _indices)
_TUPLE = Spec("tuple", _tuple_flatten, _tuple_unflatten, _sequence_keys, _indices)
_DEQUE = Spec("deque", _deque_flatten, _deque_unflatten, _sequence_keys, _indices)
_STRUCTSEQ = Spec(
    "structseq", _structseq_flatten, _structseq_unflatten, _structseq_keys, lambda context: list(range(context[2]))
)


# --------------------------------------------------------------------------------------------------
# Objects whose state is their content: dataclasses, SimpleNamespace, Mapping/Sequence ABCs
# --------------------------------------------------------------------------------------------------


def _state_flatten(obj: Any) -> tuple[list[Any], Any]:
    names, values = object_state(obj)
    return values, (names, type(obj))


def _state_unflatten(children: list[Any], context: Any) -> Any:
    names, cls = context
    new = _new_instance(cls, cls.__new__)
    _set_state(new, names, children)
    return new


_STATE = Spec("object state", _state_flatten, _state_unflatten, lambda o, c: state_keys(c[0]))


def _mappingproxy_flatten(obj: types.MappingProxyType[Any, Any]) -> tuple[list[Any], Any]:
    return [obj.copy()], None


_MAPPINGPROXY = Spec(
    "mappingproxy", _mappingproxy_flatten, lambda c, x: types.MappingProxyType(c[0]), lambda o, c: [""]
)


# --------------------------------------------------------------------------------------------------
# torch.utils._pytree nodes: children, and the context walked as one more child
# --------------------------------------------------------------------------------------------------


def _pytree_spec(cls: type, node: Any) -> Spec:
    def flatten(obj: Any) -> tuple[list[Any], Any]:
        children, context = node.flatten_fn(obj)
        children = list(children)
        return [*children, context], len(children)

    def unflatten(children: list[Any], n: Any) -> Any:
        return node.unflatten_fn(children[:n], children[n])

    def keys(obj: Any, n: Any) -> list[str]:
        if node.flatten_with_keys_fn is not None:
            pairs, _ = node.flatten_with_keys_fn(obj)
            return [pytree_keystr(key) for key, _ in pairs] + [".<pytree context>"]
        return [f"[{i}]" for i in range(n)] + [".<pytree context>"]

    return Spec(f"{cls.__qualname__} (pytree)", flatten, unflatten, keys)


# --------------------------------------------------------------------------------------------------
# Registry and resolution
# --------------------------------------------------------------------------------------------------

_lock = threading.Lock()
_user_specs: dict[type, Spec] = {}
_internal_specs: dict[type, Spec] = {}
# id(cls) -> Spec. An entry leaves with its class (a weakref callback), so a later class reusing the
# id never meets a stale entry, and a class made at run time is not kept alive by the cache.
_cache: dict[int, Spec] = {}
_cache_refs: dict[int, weakref.ref[type]] = {}


def spec_for(cls: type) -> Spec:
    """The rule for instances of ``cls``: a container :class:`Spec`, or ``ATOM``/``TENSOR``/``OPAQUE``/``SEALED``."""
    spec = _cache.get(id(cls))
    if spec is None:
        spec = _resolve(cls)
        key = id(cls)
        try:
            ref = weakref.ref(cls, functools.partial(_forget_class, key))
        except TypeError:
            return spec  # not weakly referenceable: not cached
        with _lock:
            _cache_refs[key] = ref
            _cache[key] = spec
    return spec


def _forget_class(key: int, _: object) -> None:
    _cache.pop(key, None)
    _cache_refs.pop(key, None)


def _resolve(cls: type) -> Spec:
    if is_builtin_atom(cls) or issubclass(cls, (type, types.ModuleType)) or callable_kind(cls):
        return ATOM  # data leaves, and code (classes, modules, functions): never looked into
    with _lock:
        for base in cls.__mro__:
            for table in (_user_specs, _internal_specs):
                spec = _by_identity(table, base)
                if spec is not None:
                    return spec
    if issubclass(cls, _Tensor):
        return TENSOR
    if issubclass(cls, dict):
        return _dict_spec(cls)
    if issubclass(cls, list):
        return _LIST
    if is_structseq_class(cls):
        return _STRUCTSEQ
    if issubclass(cls, tuple):
        return _TUPLE
    if issubclass(cls, collections.deque):
        return _DEQUE
    if issubclass(cls, (set, frozenset)):
        return SEALED
    if issubclass(cls, types.MappingProxyType):
        return _MAPPINGPROXY
    if dataclasses.is_dataclass(cls) or issubclass(cls, types.SimpleNamespace):
        return _STATE
    node = _by_identity(pytree_nodes(), cls)
    if node is not None:
        return _pytree_spec(cls, node)
    try:
        abstract = issubclass(cls, (Mapping, Sequence))
    except TypeError:
        abstract = False  # the ABCs' cache hashes the class: an unhashable metaclass is no ABC member
    return _STATE if abstract else OPAQUE


def _by_identity(table: Mapping[type, Any], cls: type) -> Any:
    """``table.get(cls)``, also for a class whose metaclass makes it unhashable."""
    try:
        return table.get(cls)
    except TypeError:
        return next((value for key, value in list(table.items()) if key is cls), None)


def callable_kind(cls: type) -> bool:
    """Functions, methods, code and the like: never data, never looked into."""
    return issubclass(
        cls,
        (
            types.FunctionType,
            types.BuiltinFunctionType,
            types.MethodType,
            types.CodeType,
            types.FrameType,
            types.GeneratorType,
            types.CoroutineType,
            property,
            staticmethod,
            classmethod,
        ),
    )


def register_container(
    cls: type[C],
    flatten: Callable[[C], tuple[Iterable[Any], Any]],
    unflatten: Callable[[list[Any], Any], C],
    *,
    replace: bool = False,
) -> None:
    """Teach :func:`gradguard.detach_tree` and :func:`gradguard.find_graphs` a container type (and its subclasses).

    A registration takes precedence over every built-in rule and over ``torch.utils._pytree``.

    Args:
        cls: The container class; not ``dict``, ``list``, ``tuple``, a tensor class or an atom
            (numbers, strings, ...), which are handled natively.
        flatten: ``flatten(obj) -> (children, context)``: the children to walk, and whatever
            ``unflatten`` needs to rebuild the container around them.
        unflatten: ``unflatten(children, context) -> new container``, from a list of (possibly
            detached) children and that context: only called when some child changed, and must build
            a *new* container without mutating the original.
        replace: Replace the functions of a type already registered.

    Raises:
        TypeError: ``cls`` is not a class, or ``flatten``/``unflatten`` is not callable.
        GradGuardError: ``cls`` is handled natively, or is already registered and ``replace`` is false;
            during a walk, ``flatten`` returned something other than ``(children, context)``.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_container: cls must be a class, got {cls!r}")
    if cls in (dict, list, tuple) or issubclass(cls, _Tensor) or is_builtin_atom(cls):
        raise GradGuardError(
            f"register_container: {cls.__qualname__} is handled natively and cannot be registered; "
            "register a subclass instead"
        )
    for name, fn in (("flatten", flatten), ("unflatten", unflatten)):
        if not callable(fn):
            raise TypeError(f"register_container: {name} must be callable, got {fn!r}")

    def checked_flatten(obj: Any) -> tuple[list[Any], Any]:
        result = flatten(obj)
        try:
            children, context = result
            return list(children), context
        except (TypeError, ValueError):
            raise GradGuardError(
                f"the flatten function registered for {cls.__qualname__} must return "
                f"(children, context); it returned {type(result).__qualname__}"
            ) from None

    with _lock:
        if cls in _user_specs and not replace:
            raise GradGuardError(
                f"register_container: {cls.__qualname__} is already registered; pass replace=True to replace "
                "its functions, or gradguard.unregister_container() it first"
            )
        _user_specs[cls] = Spec(f"{cls.__qualname__} (registered)", checked_flatten, unflatten, _index_keys)
        _forget()


def _index_keys(obj: Any, context: Any) -> list[str]:
    return []  # filled in by the inspection walk, which knows how many children there are


def _forget() -> None:
    _cache.clear()
    _cache_refs.clear()


def unregister_container(cls: type) -> None:
    """Undo :func:`register_container` for ``cls``.

    Args:
        cls: A class registered with :func:`register_container`.

    Raises:
        KeyError: ``cls`` was never registered, naming it.
    """
    with _lock:
        if cls not in _user_specs:
            raise KeyError(f"unregister_container: {cls!r} was never registered")
        del _user_specs[cls]
        _forget()


def register_internal(cls: type, spec: Spec) -> None:
    """Let the walk see through one of gradguard's own container types (and its subclasses)."""
    with _lock:
        _internal_specs[cls] = spec
        _forget()


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a key whose repr raises must not break a message
        return f"<{type(value).__qualname__} object at 0x{id(value):x}>"


safe_repr = _safe_repr
