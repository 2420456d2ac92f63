"""Stamps: a shared token in an autograd node's ``metadata`` that tells, in constant time, whether a graph
of a given step is still alive.

torch creates a node's ``metadata`` dict on first read and frees it with the node, so an object put
there lives as long as the longest-lived node that holds it, whatever holds the node (a list, a
running sum's next node, C++ code). A :class:`Ledger` puts *one* :class:`Stamp` object per step
boundary count (the *epoch*) into every node it stamps at that epoch, and keeps one weak reference to
it: "is a graph of epoch ``e`` still alive" is whether that reference is, however many nodes were
stamped. A node stamped again when a later backward starts from it (or runs through it) gets the
current epoch's *used* stamp; a node whose graph was judged gets its epoch's *explained* stamp, which
is never counted. A stamp holds its epoch and the sequence numbers of its nodes, nothing of the graph.
The design: ``docs/how-it-works.md`` (*Stamps*).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterable
from typing import Any

__all__ = ["Ledger", "Stamp", "epochs_below", "metadata_of", "node_key", "oldest_below"]

_serial = itertools.count(1)

_NO_SEQUENCE = 2**64 - 1  # AccumulateGrad: one per leaf, alive as long as any graph uses the leaf

FRESH, USED, EXPLAINED = 0, 1, 2

Key = int


def node_key(node: Any) -> Key | None:
    """The sequence number of a node made by a forward; ``None`` for a leaf's ``AccumulateGrad`` (it lives
    as long as any graph of its leaf, so it has no age of its own) and for what is not a node."""
    try:
        sequence = node._sequence_nr()
    except (AttributeError, RuntimeError, TypeError):
        return None
    return None if sequence == _NO_SEQUENCE else sequence


def metadata_of(node: Any) -> dict[Any, Any] | None:
    """``node.metadata`` when it is a plain dict (it always is for torch's nodes), else ``None``."""
    try:
        metadata = node.metadata
    except (AttributeError, RuntimeError):
        return None
    return metadata if type(metadata) is dict else None


class Stamp:
    """The stamp of one epoch and kind in one ledger, shared by every node stamped so.

    Attributes:
        epoch: The step boundary count it was placed at.
        counted: Whether the ledger still counts it (a judged graph's nodes get an uncounted one).
        used: Whether its nodes were stamped when a later backward started from them or ran through them.
        sequences: The sequence numbers of the nodes it was put in (a filter: see :meth:`Ledger.keys`).
    """

    __slots__ = ("__weakref__", "counted", "epoch", "sequences", "used")

    def __init__(self, epoch: int, kind: int) -> None:
        self.epoch = epoch
        self.counted = kind != EXPLAINED
        self.used = kind == USED
        self.sequences: list[int] = []

    def __repr__(self) -> str:
        what = "explained" if not self.counted else "used" if self.used else "fresh"
        return f"<gradguard stamp epoch={self.epoch} {what}>"


class Ledger:
    """The stamps one watcher placed for one thread's boundaries, by epoch.

    :meth:`place` stamps a node (once; ``refresh=True`` moves it to a later epoch's *used* stamp);
    :meth:`stamp_roots` is the same for a backward's roots, on the hot path. :meth:`oldest_alive` gives the
    earliest epoch up to a boundary whose counted stamp is alive: each counted stamp's weak reference
    leaves the ledger's books when the stamp dies (its callback), so the books hold the epochs alive,
    earliest first, and the answer is their first entry: it costs the same on any heap and whatever the
    number of nodes. :meth:`judged` stops counting a node whose graph was judged. :meth:`settle` sets the
    horizon at or below which old stamps were looked at by an audit.
    """

    __slots__ = (
        "_current",
        "_gone",
        "_last",
        "_lock",
        "_open",
        "_ordered",
        "_settled",
        "_tokens",
        "first_key",
        "horizon",
        "key",
        "placed",
    )

    def __init__(self) -> None:
        self.key = f"gradguard.stamp.{next(_serial)}"
        """The key of this ledger's stamps in a node's ``metadata``."""
        self.first_key = self.key + ".first"
        """The key of the epoch a node was first stamped at, once a later use moved its stamp."""
        self._tokens: dict[tuple[int, int], weakref.ref[Stamp]] = {}
        # The counted stamps alive, by weak reference: above the horizon (earliest epoch first while
        # _ordered), and at or below it. Both dicts are mutated in place only: _gone refers to them.
        self._open: dict[weakref.ref[Stamp], int] = {}
        self._settled: dict[weakref.ref[Stamp], int] = {}
        self._ordered = True
        self._last = -1  # the latest epoch put in _open
        self._current: Stamp | None = None  # the newest epoch's fresh stamp, kept while that epoch is young
        self._lock = threading.Lock()
        self.horizon = -1
        """Stamps of epochs up to here were looked at by an audit."""
        self.placed = 0
        """Nodes stamped so far."""
        opened, settled = self._open, self._settled

        def gone(ref: weakref.ref[Stamp]) -> None:
            # A stamp died (its last node was freed, in whatever thread): one atomic pop each, no lock,
            # and no reference to the ledger (a stamp may die while the ledger holds its lock).
            if opened.pop(ref, None) is None:
                settled.pop(ref, None)

        self._gone = gone

    # --- placing ----------------------------------------------------------------------------------

    def _token(self, epoch: int, kind: int) -> Stamp:
        ref = self._tokens.get((epoch, kind))
        token = None if ref is None else ref()
        if token is None:
            token = Stamp(epoch, kind)
            if token.counted:
                ref = weakref.ref(token, self._gone)
                if epoch > self.horizon:
                    if epoch < self._last:
                        self._ordered = False
                    self._last = max(self._last, epoch)
                    self._open[ref] = epoch
                else:
                    self._settled[ref] = epoch
            else:
                ref = weakref.ref(token)
            self._tokens[(epoch, kind)] = ref
            if len(self._tokens) > 256 and len(self._tokens) > 4 * (len(self._open) + len(self._settled) + 16):
                self._tokens = {k: r for k, r in self._tokens.items() if r() is not None}
        return token

    def stamp_roots(self, roots: Iterable[Any], epoch: int) -> list[Any]:
        """A backward from ``roots`` (tensors, gradient edges or nodes) starts at ``epoch``: a root's node
        with no stamp gets the epoch's, one stamped at an earlier epoch gets the epoch's *used* one (its
        graph is in use again). Returns the nodes stamped for the first time."""
        token = self._current
        if token is None or token.epoch != epoch:
            token = self._current = self._token(epoch, FRESH)
        key = self.key
        new = []
        for root in roots:
            try:
                node = root.grad_fn
            except AttributeError:
                node = getattr(root, "node", root)  # a GradientEdge's node, or a node itself
            try:
                metadata = node.metadata
            except AttributeError:  # None (a root that needs no grad), or not a node
                continue
            found = metadata.get(key)
            if found is None:
                metadata[key] = token
                token.sequences.append(node._sequence_nr())
                new.append(node)
            elif found.epoch < epoch:
                self.used(metadata, found, epoch, node._sequence_nr())
        if new:
            self.placed += len(new)
        return new

    def place(self, node: Any, epoch: int, refresh: bool = False) -> bool:
        """Stamp ``node`` at ``epoch``; ``True`` when a stamp was placed or moved. ``refresh``: a node
        stamped at an earlier epoch moves to this one's *used* stamp. A leaf's ``AccumulateGrad`` is never
        stamped."""
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
            self.used(metadata, found, epoch, key)
            return True
        else:
            token = self._token(epoch, FRESH)
            self.placed += 1
        metadata[self.key] = token
        token.sequences.append(key)
        return True

    def used(self, metadata: dict[Any, Any], found: Stamp, epoch: int, sequence: int) -> None:
        """A node whose ``metadata`` holds ``found`` was used by a backward at ``epoch``: it gets that epoch's
        *used* stamp, and remembers the epoch it was first stamped at."""
        metadata.setdefault(self.first_key, found.epoch)
        token = self._token(epoch, USED)
        metadata[self.key] = token
        token.sequences.append(sequence)

    def first(self, node: Any, found: Stamp) -> int:
        """The epoch ``node`` (whose stamp is ``found``) was first stamped at."""
        metadata = metadata_of(node)
        first = None if metadata is None else metadata.get(self.first_key)
        return first if type(first) is int else found.epoch

    def judged(self, node: Any) -> None:
        """Stop counting ``node``'s stamp (its graph was judged); it keeps its epoch."""
        metadata = metadata_of(node)
        found = None if metadata is None else metadata.get(self.key)
        if type(found) is Stamp and found.counted:
            token = self._token(found.epoch, EXPLAINED)
            metadata[self.key] = token  # type: ignore[index]
            token.sequences.append(node_key(node) or 0)

    def epoch(self, node: Any) -> int | None:
        """The epoch of this ledger's stamp on ``node``, or ``None``."""
        found = self.stamp(node)
        return None if found is None else found.epoch

    def stamp(self, node: Any, keys: set[Key] | frozenset[Key] | None = None) -> Stamp | None:
        """This ledger's stamp on ``node``, or ``None``; ``keys`` (:meth:`keys`), when given, spares
        reading the ``metadata`` of nodes no stamp of this ledger can be on (reading it makes one). Keep
        no reference to it: a stamp held keeps its epoch's graphs looking alive."""
        if keys is not None and node_key(node) not in keys:
            return None
        metadata = metadata_of(node)
        found = None if metadata is None else metadata.get(self.key)
        return found if type(found) is Stamp else None

    # --- reading ----------------------------------------------------------------------------------

    def oldest_alive(self, through: int) -> int | None:
        """The earliest epoch in ``(horizon, through]`` whose counted stamp is alive, or ``None``."""
        current = self._current
        if current is not None and current.epoch <= through:
            self._current = None  # the ledger must not keep an old epoch's stamp alive
        opened = self._open
        if not opened:
            return None
        if not self._ordered:
            self._sort()
        while opened:
            try:
                ref, epoch = next(iter(opened.items()))
            except (RuntimeError, StopIteration):  # a stamp died in another thread meanwhile
                continue
            if epoch > through:
                return None
            if ref() is not None:
                return epoch
            opened.pop(ref, None)  # it died while the books were re-sorted or settled: its callback missed it
        return None

    def _sort(self) -> None:
        with self._lock:
            items = sorted(list(self._open.items()), key=lambda item: item[1])
            self._open.clear()
            self._open.update(items)
            self._ordered = True

    def settle(self, horizon: int) -> None:
        """Stamps of epochs up to ``horizon`` were looked at by an audit: :meth:`oldest_alive` no longer asks
        about them."""
        with self._lock:
            opened, settled = self._open, self._settled
            if horizon < self.horizon:
                back = [(r, e) for r, e in list(settled.items()) if e > horizon]
                for ref, _ in back:
                    settled.pop(ref, None)
                opened.update(back)
                self._ordered = False
            for ref, epoch in list(opened.items()):
                if epoch <= horizon and opened.pop(ref, None) is not None and ref() is not None:
                    settled[ref] = epoch
            self.horizon = horizon
        if not self._ordered:
            self._sort()

    def alive(self, through: int) -> int:
        """How many epochs up to ``through`` have a counted stamp alive (graphs of that many steps)."""
        refs = [*list(self._settled.items()), *list(self._open.items())]
        return len({e for r, e in refs if e <= through and r() is not None})

    def keys(self) -> frozenset[Key]:
        """The sequence numbers of every node a stamp alive was put in: a node whose number is not among
        them carries none of this ledger's stamps."""
        with self._lock:
            refs = [*self._tokens.values()]
        found: set[int] = set()
        for token in map(_deref, refs):
            if token is not None:
                found.update(token.sequences)
        return frozenset(found)


def _deref(ref: weakref.ref[Stamp]) -> Stamp | None:
    return ref()


def oldest_below(
    roots: Iterable[Any], ledger: Ledger, stop: set[Any] | None = None, collect: list[Any] | None = None
) -> dict[Any, int]:
    """For each root node, the earliest epoch of a stamp of ``ledger`` in its graph (the root's own
    included); roots whose graph holds none are left out. The walk does not go into ``stop``'s nodes;
    ``collect``, when given, receives every node met that carries a stamp of ``ledger``. Each node is
    visited once for all the roots (the graphs are DAGs)."""
    return {root: epochs[0] for root, epochs in epochs_below(roots, ledger, stop, collect).items()}


def epochs_below(
    roots: Iterable[Any], ledger: Ledger, stop: set[Any] | None = None, collect: list[Any] | None = None
) -> dict[Any, tuple[int, int, int]]:
    """As :func:`oldest_below`, with the earliest and the latest epoch its graph's nodes were *first*
    stamped at beside the earliest stamp: a graph whose nodes were first stamped at several epochs was
    built over several steps, however recently a backward used it."""
    keys = ledger.keys()
    memo: dict[Any, tuple[int, int, int] | None] = {}
    found: dict[Any, tuple[int, int, int]] = {}
    for root in roots:
        if root is None:
            continue
        if root not in memo:
            _walk(root, ledger, keys, memo, stop, collect)
        epochs = memo[root]
        if epochs is not None:
            found[root] = epochs
    return found


def _walk(
    root: Any,
    ledger: Ledger,
    keys: frozenset[Key],
    memo: dict[Any, tuple[int, int, int] | None],
    stop: set[Any] | None,
    collect: list[Any] | None,
) -> None:
    """Post-order over ``root``'s graph, without recursion: ``memo[node]`` is the earliest stamp epoch
    below, and the earliest and latest first-stamped epochs."""
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
        if own is None:
            low = first_low = first_high = None
        else:
            low = own.epoch
            first_low = first_high = ledger.first(node, own) if own.used else own.epoch
            if collect is not None:
                collect.append(node)
        del own
        for child, _ in node.next_functions:
            epochs = memo.get(child) if child is not None else None
            if epochs is not None:
                low = epochs[0] if low is None else min(low, epochs[0])
                first_low = epochs[1] if first_low is None else min(first_low, epochs[1])
                first_high = epochs[2] if first_high is None else max(first_high, epochs[2])
        memo[node] = None if low is None or first_low is None or first_high is None else (low, first_low, first_high)
