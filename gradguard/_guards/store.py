"""Guarded stores: every way into them goes through the publish boundary.

Two kinds, for two needs:

* :func:`guard` of a ``list``, ``dict``, ``OrderedDict``, ``defaultdict`` or ``deque`` makes a *new*
  store, a real subclass of that type holding the given items: every consumer of the type accepts it
  (``torch.stack``, ``torch.tensor``, ``json``, pytree, ``torch.compile``, ``type(store)(iterable)``).
  A ``defaultdict``'s missing container values become guarded stores too.
* Any other mutable sequence or mapping (``UserList``, a subclass of ``list`` or ``dict``) or object
  with ``append`` is guarded *in place*: a ``wrapt.ObjectProxy`` whose every way in publishes, the
  object itself receiving what is stored. Engine adapters guard their engines' own lists this way,
  for the duration of a call.

Copying or pickling a store yields the plain container, without the guard.
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable, Iterable, MutableMapping, MutableSequence
from typing import Any, SupportsIndex, TypeVar

import torch
import wrapt

from .._boundary.offload import check_offload, to_host
from .._boundary.publish import ToHost, publish, publish_many
from .._compat import register_pytree_node
from .._errors import GradGuardError
from .._policy.modes import Mode, normalize_mode
from .._tree.containers import Spec, register_internal, safe_repr

__all__ = ["guard", "guard_in_place", "unwrap"]

S = TypeVar("S")


class _Publisher:
    """How a store publishes: its label, its own mode (``None``: the context's) and its host copy."""

    __slots__ = ("label", "mode", "offload", "to_host")

    def __init__(self, label: str, mode: Mode | None = None, offload: str | None = None) -> None:
        self.label, self.mode, self.offload = label, mode, offload
        self.to_host: ToHost | None = to_host if offload == "cpu" else None

    def one(self, value: Any) -> Any:
        """``value`` as it may be stored (detached per the mode; refused in ``raise``)."""
        return publish(value, self.label, self.mode, self.to_host)

    def many(self, values: Iterable[Any]) -> list[Any]:
        """Each of ``values`` as :meth:`one` gives it, all or nothing (``raise`` refuses the whole batch)."""
        return publish_many(values, self.label, self.mode, self.to_host)

    def options(self) -> tuple[Mode | None, str | None]:
        """``(mode, offload)``: the options the store was guarded with (a default factory's stores inherit them)."""
        return self.mode, self.offload


def _default(cls: type) -> _Publisher:
    return _Publisher(f"<{cls.__mro__[-2].__name__} store>")


# --------------------------------------------------------------------------------------------------
# Ways in, written once for the real stores and the in-place proxies
# --------------------------------------------------------------------------------------------------


class _SequenceWays:
    """``append``, ``extend``, ``insert``, item and slice assignment, ``+=``: each publishes first."""

    __slots__ = ()
    _publisher: _Publisher
    _raw: Callable[[], Any]  # the unguarded container methods: super() for real stores, the object in place

    def append(self, value: Any) -> None:
        self._raw().append(self._publisher.one(value))

    def extend(self, values: Iterable[Any]) -> None:
        self._raw().extend(self._publisher.many(values))

    def insert(self, index: SupportsIndex, value: Any) -> None:
        self._raw().insert(index, self._publisher.one(value))

    def __setitem__(self, key: Any, value: Any) -> None:
        stored = self._publisher.many(value) if isinstance(key, slice) else self._publisher.one(value)
        self._raw().__setitem__(key, stored)

    def __iadd__(self, values: Iterable[Any]) -> Any:
        self.extend(values)
        return self


class _DequeWays(_SequenceWays):
    __slots__ = ()

    def appendleft(self, value: Any) -> None:
        self._raw().appendleft(self._publisher.one(value))

    def extendleft(self, values: Iterable[Any]) -> None:
        self._raw().extendleft(self._publisher.many(values))


class _MappingWays:
    """Item assignment, ``update``, ``setdefault``, ``|=``: each publishes first."""

    __slots__ = ()
    _publisher: _Publisher
    _raw: Callable[[], Any]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._raw().__setitem__(key, self._publisher.one(value))

    def update(self, *args: Any, **kwargs: Any) -> None:
        items = dict(*args, **kwargs)  # update's own argument rules; later keys win
        self._raw().update(zip(items.keys(), self._publisher.many(items.values())))

    def setdefault(self, key: Any, default: Any = None) -> Any:
        raw = self._raw()
        if key in self:  # type: ignore[operator]
            return self[key]  # type: ignore[index]
        return raw.setdefault(key, self._publisher.one(default))

    def __ior__(self, other: Any) -> Any:
        self.update(other)
        return self


# --------------------------------------------------------------------------------------------------
# Real stores: subclasses of the builtin containers
# --------------------------------------------------------------------------------------------------


def _unguarded(plain: Any) -> Any:
    """The load side of a pickled store: the plain container (allow-listed for ``torch.load``)."""
    return plain


class _Store:
    """What every real store shares: its publisher, ``repr``, and copies and pickles as plain containers."""

    __slots__ = ()
    _publisher: _Publisher
    _base: type

    def _plain(self) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"gradguard.guard({self._plain()!r}, name={self._publisher.label!r})"

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return (_unguarded, (self._plain(),))

    def __copy__(self) -> Any:
        return self._plain()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self._plain(), memo)

    def copy(self) -> Any:
        return self._plain()


class _GuardedList(_Store, _SequenceWays, list):  # type: ignore[misc]
    __slots__ = ("_publisher",)

    def __init__(self, iterable: Iterable[Any] = (), /) -> None:
        self._publisher = _default(list)
        list.__init__(self, self._publisher.many(iterable))

    def _raw(self) -> Any:
        return super(_SequenceWays, self)

    def _plain(self) -> list[Any]:
        return list.copy(self)


class _GuardedDeque(_Store, _DequeWays, collections.deque):  # type: ignore[misc]
    __slots__ = ("_publisher",)

    def __init__(self, iterable: Iterable[Any] = (), maxlen: int | None = None) -> None:
        self._publisher = _default(collections.deque)
        collections.deque.__init__(self, self._publisher.many(iterable), maxlen)

    def _raw(self) -> Any:
        return super(_SequenceWays, self)

    def _plain(self) -> collections.deque[Any]:
        return collections.deque(collections.deque.__iter__(self), self.maxlen)


class _GuardedDict(_Store, _MappingWays, dict):  # type: ignore[misc]
    __slots__ = ("_publisher",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._publisher = _default(dict)
        dict.__init__(self)
        self.update(*args, **kwargs)

    def _raw(self) -> Any:
        return super(_MappingWays, self)

    def _plain(self) -> dict[Any, Any]:
        return dict(dict.items(self))


class _GuardedOrderedDict(_Store, _MappingWays, collections.OrderedDict):  # type: ignore[misc]
    __slots__ = ("_publisher",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._publisher = _default(collections.OrderedDict)
        collections.OrderedDict.__init__(self)
        self.update(*args, **kwargs)

    def _raw(self) -> Any:
        return super(_MappingWays, self)

    def _plain(self) -> collections.OrderedDict[Any, Any]:
        return collections.OrderedDict(collections.OrderedDict.items(self))


class _GuardedDefaultDict(_Store, _MappingWays, collections.defaultdict):  # type: ignore[misc]
    """A ``defaultdict`` store: a missing key's default is published too, and a default that is a
    list, dict or deque becomes a guarded store itself (``store["loss"].append(x)`` is guarded)."""

    __slots__ = ("_publisher",)

    def __init__(self, default_factory: Any = None, *args: Any, **kwargs: Any) -> None:
        self._publisher = _default(collections.defaultdict)
        collections.defaultdict.__init__(self, default_factory)
        self.update(*args, **kwargs)

    def _raw(self) -> Any:
        return super(_MappingWays, self)

    def __missing__(self, key: Any) -> Any:
        if self.default_factory is None:
            raise KeyError(key)
        value = _missing_value(self._publisher, key, self.default_factory)
        dict.__setitem__(self, key, value)
        return value

    def _plain(self) -> collections.defaultdict[Any, Any]:
        return collections.defaultdict(self.default_factory, dict.items(self))


_REAL: dict[type, Any] = {
    list: _GuardedList,
    dict: _GuardedDict,
    collections.OrderedDict: _GuardedOrderedDict,
    collections.defaultdict: _GuardedDefaultDict,
    collections.deque: _GuardedDeque,
}


def _new_store(items: Any, publisher: _Publisher) -> Any:
    """A real store of ``type(items)`` holding ``items`` published through ``publisher`` (all or nothing)."""
    base = type(items)
    cls = _REAL[base]
    store: Any = cls.__new__(cls)
    store._publisher = publisher
    if not items and base is not collections.defaultdict:
        base.__init__(store, *(() if base is not collections.deque else ((), items.maxlen)))
        return store  # nothing to publish: the mode is not even resolved
    if base is list:
        list.__init__(store, publisher.many(items))
    elif base is collections.deque:
        collections.deque.__init__(store, publisher.many(items), items.maxlen)
    else:
        if base is collections.defaultdict:
            collections.defaultdict.__init__(store, items.default_factory)
        else:
            base.__init__(store)
        keys = list(base.keys(items))
        for key, value in zip(keys, publisher.many([dict.__getitem__(items, k) for k in keys])):
            base.__setitem__(store, key, value)
    return store


def _missing_value(publisher: _Publisher, key: Any, factory: Any) -> Any:
    """A ``defaultdict`` store's default for ``key``: a guarded store when it is a container, else published."""
    value = factory()
    if type(value) in _REAL:
        return _new_store(value, _Publisher(f"{publisher.label}[{safe_repr(key)}]", *publisher.options()))
    return publisher.one(value)


# --------------------------------------------------------------------------------------------------
# In-place stores: a proxy of an object someone else holds
# --------------------------------------------------------------------------------------------------


class _InPlace(wrapt.ObjectProxy):  # type: ignore[misc]
    """The object itself to readers; every way in routed through its publisher."""

    def __init__(self, wrapped: Any, publisher: _Publisher) -> None:
        super().__init__(wrapped)
        self._self_publisher = publisher

    @property
    def _publisher(self) -> _Publisher:
        return self._self_publisher  # type: ignore[no-any-return]

    def _raw(self) -> Any:
        return self.__wrapped__

    def __repr__(self) -> str:
        return f"gradguard.guard({self.__wrapped__!r}, name={self._self_publisher.label!r})"

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return self.__wrapped__.__reduce_ex__(protocol)

    def __copy__(self) -> Any:
        return copy.copy(self.__wrapped__)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.__wrapped__, memo)


class _InPlaceAppend(_InPlace):
    """Any object with ``append``: only ``append`` is intercepted."""

    def append(self, value: Any) -> Any:
        return self.__wrapped__.append(self._self_publisher.one(value))


class _InPlaceSequence(_SequenceWays, _InPlace):  # type: ignore[misc]
    pass


class _InPlaceDeque(_DequeWays, _InPlace):  # type: ignore[misc]
    pass


class _InPlaceMapping(_MappingWays, _InPlace):  # type: ignore[misc]
    def __getitem__(self, key: Any) -> Any:
        wrapped = self.__wrapped__
        if isinstance(wrapped, collections.defaultdict) and wrapped.default_factory is not None and key not in wrapped:
            dict.__setitem__(wrapped, key, _missing_value(self._self_publisher, key, wrapped.default_factory))
        return wrapped[key]


def _is_guarded(store: Any) -> bool:
    return isinstance(store, (_Store, _InPlace))


def _in_place_class(store: Any) -> type[_InPlace] | None:
    if isinstance(store, collections.deque):
        return _InPlaceDeque
    if isinstance(store, (list, MutableSequence)):
        return _InPlaceSequence
    if isinstance(store, MutableMapping):
        return _InPlaceMapping
    if callable(getattr(store, "append", None)):
        return _InPlaceAppend
    return None


def guard_in_place(store: Any, label: str, mode: Mode | None = None, offload: str | None = None) -> Any:
    """A proxy of ``store`` publishing everything put into it, the object itself keeping what is stored.

    For adapters that guard an engine's own list for the duration of a call. A store already guarded
    is returned as it is.
    """
    if _is_guarded(store):
        return store
    cls = _in_place_class(store)
    if cls is None:
        raise TypeError(f"a {type(store).__qualname__} cannot be guarded in place: it has no append()")
    return cls(store, _Publisher(label, mode, offload))


def guard(store: S, *, mode: str | None = None, name: str | None = None, offload: str | None = None) -> S:
    """A store that detaches (per ``mode``) everything put into it.

    Guarding a guarded store returns it unchanged.

    Args:
        store: The container to guard. A ``list``, ``dict``, ``collections.OrderedDict``,
            ``collections.defaultdict`` or ``collections.deque`` gives a *new* store of that type (a
            real subclass), holding ``store``'s items published as if appended; ``store`` itself is
            left as it is, so keep using the returned object:
            ``output_lst = gradguard.guard([], name="output_lst")``. Any other mutable sequence or
            mapping (``UserList``, a subclass of ``list``/``dict``), or any object with an ``append``
            method, is guarded *in place*: the returned proxy passes ``isinstance`` as that object,
            and what is stored lands in the object itself.
        mode: This store's mode (``"off"``, ``"detach"``, ``"warn"``, ``"raise"`` or an alias), or
            ``None`` for the mode in force at each store (see :func:`gradguard.get_mode`).
        name: The store's label in messages and stats; ``None`` labels it by type and address.
        offload: ``"cpu"`` also moves published tensors to the CPU; ``None`` leaves them where they are.

    Returns:
        The guarded store: a new store of ``store``'s type, a proxy of ``store``, or ``store`` itself
        when it is already guarded.

    Raises:
        TypeError: ``store`` is a class, or an object with no ``append`` that is not a mutable
            sequence or mapping; ``name`` is not a ``str``.
        GradGuardError: a bad ``mode`` or ``offload``, or ``store`` is already guarded with other
            options than those asked for (guard ``gradguard.unwrap(store)`` instead).
    """
    if isinstance(store, type):
        raise TypeError(
            f"guard() takes a store object, not the class {store.__qualname__}: guard({store.__qualname__}()) "
            f"makes a new guarded {store.__qualname__}"
        )
    checked_mode = None if mode is None else normalize_mode(mode)
    checked_offload = check_offload(offload)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"guard: name must be a str, got {type(name).__qualname__}")
    if _is_guarded(store):
        publisher = store._publisher  # type: ignore[attr-defined]
        asked = (checked_mode, checked_offload)
        if asked != (None, None) and asked != publisher.options():
            raise GradGuardError(
                f"{publisher.label} is already guarded with mode={publisher.mode!r}, offload={publisher.offload!r}; "
                f"cannot also guard it with mode={checked_mode!r}, offload={checked_offload!r}. Guard "
                "gradguard.unwrap(store) instead"
            )
        return store
    label = name if name is not None else f"<{type(store).__name__} at 0x{id(store):x}>"
    publisher = _Publisher(label, checked_mode, checked_offload)
    if type(store) in _REAL:
        return _new_store(store, publisher)  # type: ignore[no-any-return]
    cls = _in_place_class(store)
    if cls is None:
        raise TypeError(
            f"guard: a {type(store).__qualname__} cannot be a store; accepted: a list, dict, OrderedDict, "
            "defaultdict or deque (a new store), or any other mutable sequence or mapping, or object with an "
            "append() method (guarded in place)"
        )
    return cls(store, publisher)  # type: ignore[return-value]


def unwrap(store: S) -> S:
    """The plain container behind a guarded store.

    Args:
        store: A store returned by :func:`guard`, or any other object.

    Returns:
        For an in-place store, the object it wraps; for a store :func:`guard` made, a new plain
        container of its type with the same items; any other object as it is.
    """
    if isinstance(store, _InPlace):
        return store.__wrapped__  # type: ignore[no-any-return]
    if isinstance(store, _Store):
        return store._plain()  # type: ignore[no-any-return]
    return store


# --------------------------------------------------------------------------------------------------
# The walk, pytree and torch.load see through stores
# --------------------------------------------------------------------------------------------------


def _store_flatten(store: Any) -> tuple[list[Any], Any]:
    plain = unwrap(store)
    return [plain], store


def _store_unflatten(children: list[Any], store: Any) -> Any:
    publisher = store._publisher
    if isinstance(store, _InPlace):
        return type(store)(children[0], publisher)
    return _new_store(children[0], publisher)


register_internal(_Store, Spec("guarded store", _store_flatten, _store_unflatten, lambda o, c: [""]))
register_internal(_InPlace, Spec("guarded store", _store_flatten, _store_unflatten, lambda o, c: [""]))


def _pytree_flatten(store: Any) -> tuple[list[Any], Any]:
    """Children: the items; context: the options and the shape of the plain container (keys, factory, maxlen)."""
    publisher = store._publisher
    base = type(store).__mro__[-2] if not isinstance(store, dict) else _dict_base_of(store)
    if isinstance(store, dict):
        keys = list(dict.keys(store))
        extra = store.default_factory if isinstance(store, collections.defaultdict) else None
        return [dict.__getitem__(store, k) for k in keys], (publisher, base, keys, extra)
    return list(store), (publisher, base, None, getattr(store, "maxlen", None))


def _pytree_unflatten(children: Iterable[Any], context: Any) -> Any:
    """A new store of the same kind and options, the children published into it."""
    publisher, base, keys, extra = context
    children = list(children)
    if base is collections.defaultdict:
        plain: Any = collections.defaultdict(extra, zip(keys, children))
    elif keys is not None:
        plain = base(zip(keys, children))
    elif base is collections.deque:
        plain = collections.deque(children, extra)
    else:
        plain = list(children)
    return _new_store(plain, publisher)


def _dict_base_of(store: Any) -> type:
    for base in (collections.defaultdict, collections.OrderedDict):
        if isinstance(store, base):
            return base
    return dict


for _cls in _REAL.values():
    register_pytree_node(_cls, _pytree_flatten, _pytree_unflatten)
torch.serialization.add_safe_globals([_unguarded])
