"""Guarded stores: ``wrapt.ObjectProxy`` wrappers whose every way in goes through ``publish_into``.

The proxy is the container as far as readers can tell (``isinstance``, indexing, iteration, ``len``,
equality); copying or pickling it yields a copy of the plain container, without the guard.
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Iterable, MutableMapping
from typing import Any, SupportsIndex, TypeVar

import wrapt

from ._offload import check_offload, to_host
from ._policy import Mode, normalize_mode, resolve
from ._publish import publish_into, publish_many
from ._tree import _register_internal

__all__ = ["guard", "unwrap"]

S = TypeVar("S")
logger = logging.getLogger("gradguard")


class _Sink:
    """How a guarded store publishes: its label and options. Immutable, so proxies can share one.

    One object behind one proxy attribute (``_self_sink``): each attribute fetch on a wrapt proxy
    costs about 0.1 us, and engine adapters create a proxy per call.
    """

    __slots__ = ("label", "mode", "offload", "options")

    def __init__(self, label: str, mode: Mode | None, offload: str | None) -> None:
        self.label, self.mode, self.options = label, mode, (mode, offload)
        self.offload = to_host if offload == "cpu" else None

    def one(self, value: Any) -> Any:
        return publish_into(None, self.label, self.mode, self.offload, value)

    def many(self, values: Iterable[Any]) -> list[Any]:
        return publish_many(self.label, resolve(self.mode), list(values), self.offload)


class _Guarded(wrapt.ObjectProxy):  # type: ignore[misc]
    """The proxy: the container itself to readers, every way in routed through its ``_Sink``."""

    def __init__(self, wrapped: Any, sink: _Sink) -> None:
        super().__init__(wrapped)
        self._self_sink = sink

    def __repr__(self) -> str:
        return f"gradguard.guard({self.__wrapped__!r}, name={self._self_sink.label!r})"

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return self.__wrapped__.__reduce_ex__(protocol)

    def __copy__(self) -> Any:
        import copy

        return copy.copy(self.__wrapped__)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        import copy

        return copy.deepcopy(self.__wrapped__, memo)


class _GuardedAppend(_Guarded):
    """Any object with ``append``: only ``append`` is intercepted."""

    # The hot path of every engine adapter. ``append`` is a slot holding a partial of publish_into,
    # so ``proxy.append(x)`` costs one attribute fetch on the proxy and one Python frame.
    __slots__ = ("append",)

    def __init__(self, wrapped: Any, sink: _Sink) -> None:
        super().__init__(wrapped, sink)
        # Set through the slot's descriptor: wrapt forwards ``self.append = ...`` to the wrapped object.
        _APPEND.__set__(self, functools.partial(publish_into, wrapped.append, sink.label, sink.mode, sink.offload))


_APPEND = _GuardedAppend.__dict__["append"]


class _GuardedList(_GuardedAppend):
    def extend(self, values: Iterable[Any]) -> None:
        self.__wrapped__.extend(self._self_sink.many(values))

    def insert(self, index: Any, value: Any) -> None:
        self.__wrapped__.insert(index, self._self_sink.one(value))

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__wrapped__[key] = self._self_sink.many(value) if isinstance(key, slice) else self._self_sink.one(value)

    def __iadd__(self, values: Iterable[Any]) -> Any:  # type: ignore[misc]
        self.extend(values)
        return self


class _GuardedDeque(_GuardedList):
    def appendleft(self, value: Any) -> None:
        self.__wrapped__.appendleft(self._self_sink.one(value))

    def extendleft(self, values: Iterable[Any]) -> None:
        self.__wrapped__.extendleft(self._self_sink.many(values))


class _GuardedDict(_Guarded):
    def __setitem__(self, key: Any, value: Any) -> None:
        self.__wrapped__[key] = self._self_sink.one(value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        items = dict(*args, **kwargs)  # update's own argument rules; later keys win
        self.__wrapped__.update(zip(items.keys(), self._self_sink.many(items.values())))

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key in self.__wrapped__:
            return self.__wrapped__[key]
        return self.__wrapped__.setdefault(key, self._self_sink.one(default))

    def __ior__(self, other: Any) -> Any:
        self.update(other)
        return self


def _rewrap(children: list[Any], proxy: _Guarded) -> Any:
    return type(proxy)(children[0], proxy._self_sink)


# detach_tree, find_graphs and pinned_bytes look through a guarded store to its contents; a changed
# store comes back as a new guarded store around the rebuilt container.
_register_internal(_Guarded, lambda proxy: ([proxy.__wrapped__], proxy), _rewrap)


def guard(store: S, *, mode: str | None = None, name: str | None = None, offload: str | None = None) -> S:
    """Return a proxy of ``store`` that detaches (per ``mode``) everything put into it.

    ``store`` may be a ``list``, a ``dict`` or other mutable mapping, a ``collections.deque``, or any
    object with an ``append`` method (only ``append`` is intercepted there). ``mode`` overrides the
    context's mode for this store (see :func:`gradguard.get_mode`); ``name`` labels the store in
    messages and stats; ``offload="cpu"`` also moves published tensors to the CPU.

    Guarding a guarded store returns it unchanged, with its first options.
    """
    if isinstance(store, _Guarded):
        if (mode, offload) != (None, None) and store._self_sink.options != (mode, offload):
            logger.debug("gradguard: %r is already guarded; keeping its first options", store)
        return store
    checked_mode = None if mode is None else normalize_mode(mode)
    checked_offload = check_offload(offload)
    if name is not None and not isinstance(name, str):
        raise TypeError(f"guard: name must be a str, got {type(name).__qualname__}")
    label = name if name is not None else f"<{type(store).__name__} at 0x{id(store):x}>"
    if isinstance(store, collections.deque):
        cls: type[_Guarded] = _GuardedDeque
    elif isinstance(store, list):
        cls = _GuardedList
    elif isinstance(store, MutableMapping):
        cls = _GuardedDict
    elif callable(getattr(store, "append", None)):
        cls = _GuardedAppend
    else:
        raise TypeError(
            f"guard: a {type(store).__qualname__} cannot be a store; accepted: a list, a dict or "
            "other mutable mapping, a collections.deque, or any object with an append() method"
        )
    return cls(store, _Sink(label, checked_mode, checked_offload))  # type: ignore[return-value]


def guarded(store: Any, label: str) -> Any:
    """:func:`guard` with the context's mode and no offload, for adapters that guard a store per call.

    A plain ``list`` skips ``guard``'s option checks and shares one sink per label (the common case:
    Megatron's ``forward_data_store``); anything else goes through :func:`guard`.
    """
    if type(store) is list:
        sink = _shared_sinks.get(label)
        if sink is None:
            sink = _shared_sinks.setdefault(label, _Sink(label, None, None))
        return _GuardedList(store, sink)
    return guard(store, name=label)


_shared_sinks: dict[str, _Sink] = {}


def unwrap(store: S) -> S:
    """The object a guarded store wraps; any other object is returned as it is."""
    return store.__wrapped__ if isinstance(store, _Guarded) else store
