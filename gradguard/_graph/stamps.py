"""Stamps: a small object in an autograd node's ``metadata`` that lives exactly as long as the node.

torch creates a node's ``metadata`` dict on first read and frees it with the node, so an object put
there dies when the node dies, whatever holds the node (a list, a running sum's next node, C++ code).
A :class:`Ledger` keeps a weak reference to each stamp it placed, by *epoch* (the step boundary count
at which it was placed), and looks at an epoch's stamps once, when that epoch becomes old: whether a
graph outlived its step is known without searching the heap for it (``docs/how-it-works.md``).
A stamp holds its epoch and its node's key, nothing of the graph.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterable
from typing import Any

__all__ = ["Ledger", "Stamp", "metadata_of", "node_key", "oldest_below"]

_serial = itertools.count(1)

_NO_SEQUENCE = 2**64 - 1  # AccumulateGrad: one per leaf, alive as long as any graph uses the leaf

Key = tuple[int, type]


def node_key(node: Any) -> Key | None:
    """``(sequence number, type)`` of a node made by a forward; ``None`` for a leaf's ``AccumulateGrad``
    (it lives as long as any graph of its leaf, so it has no age of its own) and for what is not a node."""
    try:
        sequence = node._sequence_nr()
    except (AttributeError, RuntimeError, TypeError):
        return None
    return None if sequence == _NO_SEQUENCE else (sequence, type(node))


def metadata_of(node: Any) -> dict[Any, Any] | None:
    """``node.metadata`` when it is a plain dict (it always is for torch's nodes), else ``None``."""
    try:
        metadata = node.metadata
    except (AttributeError, RuntimeError):
        return None
    return metadata if type(metadata) is dict else None


class Stamp:
    """One node's stamp in one ledger: its ``epoch``, its node's :func:`node_key`, whether the ledger
    still counts it (a stamp whose graph was judged keeps its age but is no longer counted), and whether
    a later backward started from its node again (``used``: its epoch is then that backward's)."""

    __slots__ = ("__weakref__", "counted", "epoch", "key", "used")

    def __init__(self, epoch: int, key: Key) -> None:
        self.epoch = epoch
        self.key = key
        self.counted = True
        self.used = False

    def __repr__(self) -> str:
        return f"<gradguard stamp epoch={self.epoch}{'' if self.counted else ' explained'}>"


class Ledger:
    """The stamps one watcher placed in one thread, by epoch.

    :meth:`place` stamps a node (once; ``refresh=True`` moves an existing stamp to a later epoch: the
    node was used again). :meth:`old` gives the earliest epoch up to a boundary that has a counted stamp
    alive: each stamp is looked at once when its epoch becomes old, then only while it stays alive, so
    it costs the same on any heap. :meth:`explain` stops counting a stamp whose node the caller judged.
    Meant for one thread (its boundaries and the backwards it starts); :meth:`alive` may be read from
    another. A node must be held by the caller while it is placed or explained.
    """

    __slots__ = ("_buckets", "_checked", "_lock", "_old", "key", "placed")

    def __init__(self) -> None:
        self.key = f"gradguard.stamp.{next(_serial)}"
        """The key of this ledger's stamps in a node's ``metadata``."""
        self._buckets: dict[int, list[weakref.ref[Stamp]]] = {}  # epoch -> the stamps placed there
        self._old: list[weakref.ref[Stamp]] = []  # stamps of epochs up to _checked, alive when last looked at
        self._checked = -1
        self._lock = threading.Lock()
        self.placed = 0
        """Stamps placed so far."""

    def stamp(self, node: Any, keys: set[Key] | frozenset[Key] | None = None) -> Stamp | None:
        """This ledger's stamp on ``node``, or ``None``; ``keys`` (:meth:`keys`), when given, spares
        reading the ``metadata`` of nodes no stamp of this ledger can be on."""
        if keys is not None and node_key(node) not in keys:
            return None
        metadata = metadata_of(node)
        found = None if metadata is None else metadata.get(self.key)
        return found if type(found) is Stamp else None

    def place(self, node: Any, epoch: int, refresh: bool = False) -> bool:
        """Stamp ``node`` at ``epoch``; ``True`` when a stamp was placed or moved. A leaf's
        ``AccumulateGrad`` is never stamped."""
        key = node_key(node)
        if key is None:
            return False
        metadata = metadata_of(node)
        if metadata is None:
            return False
        found = metadata.get(self.key)
        if type(found) is Stamp:
            if not refresh or found.epoch >= epoch:
                return False
            found.epoch, found.used = epoch, True
            self._buckets.setdefault(epoch, []).append(weakref.ref(found))
            return True
        stamp = metadata[self.key] = Stamp(epoch, key)
        self._buckets.setdefault(epoch, []).append(weakref.ref(stamp))
        self.placed += 1
        return True

    def explain(self, node: Any) -> None:
        """Stop counting ``node``'s stamp (its graph was judged); it keeps its epoch."""
        found = self.stamp(node)
        if found is not None:
            found.counted = False

    def due(self, through: int) -> bool:
        """Whether :meth:`old` has anything to look at up to ``through`` (else it would say ``None``)."""
        if self._old:
            return True
        buckets = self._buckets
        return bool(buckets) and next(iter(buckets)) <= through

    def old(self, through: int, after: int = -1) -> int | None:
        """The earliest epoch in ``(after, through]`` that has a counted stamp alive, or ``None``."""
        with self._lock:
            self._age(through)
            if not self._old:
                return None
            epochs = [s.epoch for s in map(_deref, self._old) if s is not None and s.counted and after < s.epoch]
        return min((e for e in epochs if e <= through), default=None)

    def alive(self, through: int) -> int:
        """How many counted stamps of epochs up to ``through`` are alive."""
        with self._lock:
            self._age(through)
            return sum(1 for s in map(_deref, self._old) if s is not None and s.counted and s.epoch <= through)

    def keys(self) -> frozenset[Key]:
        """The node keys of every stamp alive: a node whose key is not among them carries none."""
        with self._lock:
            refs = [*self._old, *(r for bucket in self._buckets.values() for r in bucket)]
        return frozenset(s.key for s in map(_deref, refs) if s is not None)

    def _age(self, through: int) -> None:
        """Move the stamps of the epochs up to ``through`` to the old ones (those alive and still of that
        epoch: a stamp moved to a later epoch is looked at there), and forget the dead."""
        for epoch in range(self._checked + 1, through + 1):
            for ref in self._buckets.pop(epoch, ()):
                stamp = ref()
                if stamp is not None and stamp.epoch == epoch:
                    self._old.append(ref)
        self._checked = max(self._checked, through)
        if self._old:
            self._old = [r for r in self._old if (s := r()) is not None and s.epoch <= self._checked]


def _deref(ref: weakref.ref[Stamp]) -> Stamp | None:
    return ref()


def oldest_below(
    roots: Iterable[Any], ledger: Ledger, stop: set[Any] | None = None, collect: list[Any] | None = None
) -> dict[Any, int]:
    """For each root node, the earliest epoch of a stamp of ``ledger`` in its graph (the root's own
    included); roots whose graph holds none are left out. The walk does not go into ``stop``'s nodes;
    ``collect``, when given, receives every node met that carries a stamp of ``ledger``. Each node is
    visited once for all the roots (the graphs are DAGs)."""
    keys = ledger.keys()
    memo: dict[Any, int | None] = {}
    found: dict[Any, int] = {}
    for root in roots:
        if root is None:
            continue
        if root not in memo:
            _walk(root, ledger, keys, memo, stop, collect)
        epoch = memo[root]
        if epoch is not None:
            found[root] = epoch
    return found


def _walk(
    root: Any,
    ledger: Ledger,
    keys: frozenset[Key],
    memo: dict[Any, int | None],
    stop: set[Any] | None,
    collect: list[Any] | None,
) -> None:
    """Post-order over ``root``'s graph, without recursion: ``memo[node]`` is the earliest epoch below."""
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if not expanded:
            if node in memo:
                continue
            memo[node] = None  # a placeholder until its children are done
            if stop and node in stop and node is not root:
                continue
            stack.append((node, True))
            stack.extend((child, False) for child, _ in node.next_functions if child is not None and child not in memo)
            continue
        own = ledger.stamp(node, keys)
        best = None if own is None else own.epoch
        if own is not None and collect is not None:
            collect.append(node)
        for child, _ in node.next_functions:
            epoch = memo.get(child) if child is not None else None
            if epoch is not None and (best is None or epoch < best):
                best = epoch
        memo[node] = best
