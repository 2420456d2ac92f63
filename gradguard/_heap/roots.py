"""Named roots: objects the holder search treats as roots of their own, preferred over module globals.

Some objects are reached first through a framework's own tables: a Ray actor's instance is an item of
``ray._private.worker.global_worker.actors``, so the path to what the actor keeps would start in
Ray's module globals, and the fix would offer to replace Ray's table. Naming the instance as a root
(``name_root(instance, "actor Trainer")``) makes the search stop there and spell the path from the
label: ``actor Trainer: self.losses[*]``, fix ``self.losses = gradguard.guard([]) (in actor Trainer)``.

Two ways in: :func:`name_root` holds an object weakly (it names nothing once it is gone), and
:func:`add_provider` registers a callable asked at each search, for objects that exist only later or
that a framework owns (the current Ray actor). Neither keeps anything alive between searches.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from .._errors import GradGuardError

__all__ = ["NamedRoot", "add_provider", "forget_root", "live_roots", "name_root", "remove_provider"]

Provider = Callable[[], Iterable[tuple[Any, str, str]]]
"""Returns ``(object, label, name)`` triples, strongly, for the duration of one search."""


class NamedRoot:
    """The owner of a path's first edge when the path starts at a named root (``Edge(root, "named", name)``).

    ``label`` says where the object lives (``actor Trainer``), ``name`` how code there calls it
    (``self``); :meth:`resolve` gives the object while it lives, else raises ``LookupError``.
    """

    __slots__ = ("label", "name", "_ref", "_strong")

    def __init__(self, obj: Any, label: str, name: str, *, strong: bool = False) -> None:
        self.label, self.name = label, name
        self._strong = obj if strong else None
        self._ref = None if strong else weakref.ref(obj)

    def resolve(self) -> Any:
        obj = self._strong if self._ref is None else self._ref()
        if obj is None:
            raise LookupError(f"the object named {self.label}: {self.name} is gone")
        return obj

    def __repr__(self) -> str:
        return f"<named root {self.label}: {self.name}>"


_lock = threading.Lock()
_named: dict[int, NamedRoot] = {}
_providers: list[Provider] = []


def _check(label: object, name: object) -> None:
    for what, value in (("label", label), ("name", name)):
        if not isinstance(value, str) or not value or not value.isprintable():
            raise GradGuardError(
                f"name_root: {what}={value!r} is not accepted; give a non-empty printable str "
                "(label: where the object lives, 'actor Trainer'; name: how its code calls it, 'self')"
            )


def name_root(obj: Any, label: str, name: str = "self") -> None:
    """Make ``obj`` a root of the holder search, spelled ``f"{label}: {name}"``; held weakly.

    Naming the same object again replaces its label. An object that takes no weak reference
    (an instance of a class with ``__slots__`` and no ``__weakref__``) is refused with
    :class:`GradGuardError`: register an :func:`add_provider` callable instead.
    """
    _check(label, name)
    try:
        root = NamedRoot(obj, label, name)
    except TypeError:
        raise GradGuardError(
            f"name_root: a {type(obj).__qualname__} takes no weak reference, so it cannot be named without "
            "being kept alive; register a provider with gradguard._heap.roots.add_provider instead"
        ) from None
    key = id(obj)
    with _lock:
        _named[key] = root
    weakref.finalize(obj, _drop, key, root)


def _drop(key: int, root: NamedRoot) -> None:
    with _lock:
        if _named.get(key) is root:
            del _named[key]


def forget_root(obj: Any) -> None:
    """``obj`` is no longer a named root (nothing happens when it was not one)."""
    with _lock:
        root = _named.get(id(obj))
        if root is not None and root._ref is not None and root._ref() is obj:
            del _named[id(obj)]


def add_provider(provider: Provider) -> None:
    """Ask ``provider()`` at each search for ``(object, label, name)`` triples to treat as named roots.

    A provider that raises, or returns something else, names nothing for that search: the search
    itself must not fail because of it.
    """
    with _lock:
        if provider not in _providers:
            _providers.append(provider)


def remove_provider(provider: Provider) -> None:
    with _lock:
        if provider in _providers:
            _providers.remove(provider)


def live_roots() -> list[tuple[Any, NamedRoot]]:
    """Every named root alive now, as ``(object, root)``: the objects are held strongly by the list,
    for one search; a provider's objects come after the registered ones and do not replace them."""
    with _lock:
        registered = list(_named.values())
        providers = list(_providers)
    found: list[tuple[Any, NamedRoot]] = []
    seen: set[int] = set()
    for root in registered:
        obj = root._ref() if root._ref is not None else root._strong
        if obj is not None and id(obj) not in seen:
            seen.add(id(obj))
            found.append((obj, root))
    for provider in providers:
        try:
            triples = list(provider())
        except Exception:  # noqa: BLE001 - a provider must never fail the search (see add_provider)
            continue
        for triple in triples:
            if not (isinstance(triple, tuple) and len(triple) == 3):
                continue
            obj, label, name = triple
            if id(obj) in seen or not isinstance(label, str) or not isinstance(name, str):
                continue
            seen.add(id(obj))
            found.append((obj, NamedRoot(obj, label, name, strong=True)))
    return found
