"""Stamps: a small object in an autograd node's ``metadata`` that lives exactly as long as the node.

torch creates a node's ``metadata`` dict on first read and frees it with the node, so an object put
there dies when the node dies, whatever holds the node (a list, a running sum's next node, C++ code).
A :class:`Ledger` counts its live stamps by *epoch* (the step boundary count at which a stamp was
placed): reading how many stamps of an old epoch are still alive costs the same on any heap, which
is how the watch learns that a graph outlived its step without searching the heap for it
(``docs/how-it-works.md``).

A stamp holds its ledger and its epoch, nothing of the graph. Its death may come from any thread (an
autograd worker, a garbage collection): it only appends to a deque (atomic), and the ledger applies
the deaths when it is read.
"""

from __future__ import annotations

import collections
import itertools
import threading
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

    __slots__ = ("counted", "epoch", "key", "ledger", "used")

    def __init__(self, ledger: Ledger, epoch: int, key: Key) -> None:
        self.ledger: Ledger | None = ledger
        self.epoch = epoch
        self.key = key
        self.counted = True
        self.used = False  # a later backward started from this node again: its graph is in use

    def __del__(self) -> None:
        ledger = self.ledger
        if ledger is not None:
            try:
                ledger._deaths.append((self.epoch if self.counted else None, self.key))
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to count
                pass

    def __repr__(self) -> str:
        return f"<gradguard stamp epoch={self.epoch}{'' if self.counted else ' explained'}>"


class Ledger:
    """The live stamps one watcher placed in one thread, counted by epoch.

    :meth:`place` stamps a node (once; ``refresh=True`` moves an existing stamp to a later epoch: the
    node was used again). :meth:`oldest` is the earliest epoch with a counted stamp alive, in time
    independent of the heap. :meth:`explain` stops counting a stamp whose node the caller judged.
    Thread-safe, except that a node must be held by the caller while it is placed or explained.
    """

    __slots__ = ("_deaths", "_index", "_live", "_lock", "key", "placed")

    def __init__(self) -> None:
        self.key = f"gradguard.stamp.{next(_serial)}"
        """The key of this ledger's stamps in a node's ``metadata``."""
        self._live: dict[int, int] = {}  # epoch -> counted stamps alive
        self._index: dict[Key, int] = {}  # node key -> stamps alive: a walk reads only these nodes' metadata
        self._deaths: collections.deque[tuple[int | None, Key]] = collections.deque()
        self._lock = threading.Lock()
        self.placed = 0
        """Stamps placed so far."""

    def stamp(self, node: Any) -> Stamp | None:
        """This ledger's stamp on ``node``, or ``None`` (reads ``metadata`` only where one may be)."""
        key = node_key(node)
        if key is None or key not in self._index:
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
            with self._lock:
                if found.counted:
                    self._count(found.epoch, -1)
                    self._count(epoch, 1)
                found.epoch = epoch
                found.used = True
            return True
        stamp = Stamp(self, epoch, key)
        with self._lock:
            self._count(epoch, 1)
            self._index[key] = self._index.get(key, 0) + 1
            self.placed += 1
        metadata[self.key] = stamp
        return True

    def explain(self, node: Any) -> None:
        """Stop counting ``node``'s stamp (its graph was judged); it keeps its epoch."""
        found = self.stamp(node)
        if found is None or not found.counted:
            return
        with self._lock:
            found.counted = False
            self._count(found.epoch, -1)

    def oldest(self, after: int = -1) -> int | None:
        """The earliest epoch later than ``after`` that has a counted stamp alive, or ``None``."""
        with self._lock:
            if self._deaths:
                self._drain()
            live = self._live
            if not live:
                return None
            return min((epoch for epoch in live if epoch > after), default=None)

    def alive(self, through: int) -> int:
        """How many counted stamps of epochs up to ``through`` are alive."""
        with self._lock:
            self._drain()
            return sum(n for epoch, n in self._live.items() if epoch <= through)

    def _drain(self) -> None:
        deaths, index = self._deaths, self._index
        while deaths:
            epoch, key = deaths.popleft()
            if epoch is not None:
                self._count(epoch, -1)
            left = index.get(key, 0) - 1
            if left > 0:
                index[key] = left
            else:
                index.pop(key, None)

    def _count(self, epoch: int, delta: int) -> None:
        left = self._live.get(epoch, 0) + delta
        if left > 0:
            self._live[epoch] = left
        else:
            self._live.pop(epoch, None)


def oldest_below(
    roots: Iterable[Any], ledger: Ledger, stop: set[Any] | None = None, collect: list[Any] | None = None
) -> dict[Any, int]:
    """For each root node, the earliest epoch of a stamp of ``ledger`` in its graph (the root's own
    included); roots whose graph holds none are left out. The walk does not go into ``stop``'s nodes;
    ``collect``, when given, receives every node met that carries a stamp of ``ledger``. Each node is
    visited once for all the roots (the graphs are DAGs)."""
    with ledger._lock:
        ledger._drain()
    memo: dict[Any, int | None] = {}
    found: dict[Any, int] = {}
    for root in roots:
        if root is None:
            continue
        if root not in memo:
            _walk(root, ledger, memo, stop, collect)
        epoch = memo[root]
        if epoch is not None:
            found[root] = epoch
    return found


def _walk(
    root: Any, ledger: Ledger, memo: dict[Any, int | None], stop: set[Any] | None, collect: list[Any] | None
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
        own = ledger.stamp(node)
        best = None if own is None else own.epoch
        if own is not None and collect is not None:
            collect.append(node)
        for child, _ in node.next_functions:
            epoch = memo.get(child) if child is not None else None
            if epoch is not None and (best is None or epoch < best):
                best = epoch
        memo[node] = best
