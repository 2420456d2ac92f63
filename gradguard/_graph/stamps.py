"""Stamps: a shared token in an autograd node's ``metadata`` that tells, in constant time, whether a graph
of a given step is still alive.

torch creates a node's ``metadata`` dict on first read and frees it with the node, so an object put
there lives as long as the longest-lived node that holds it, whatever holds the node (a list, a
running sum's next node, C++ code). A :class:`Ledger` puts *one* :class:`Stamp` object per step
boundary count (the *epoch*) into every node it stamps at that epoch, and keeps one weak reference to
it: "is a graph of epoch ``e`` still alive" is whether that reference is, however many nodes were
stamped. Each backward that is not nested gets its own stamp (its *micro-batch* number beside its epoch),
so the same reference also tells whether a graph a given backward ran through is still alive: the
micro-batch clock's signal (:meth:`Ledger.micro_old`). A node stamped again when a later backward starts
from it (or runs through it) gets the current epoch's *used* stamp; a node whose graph was judged gets
its epoch's *explained* stamp, which is never counted. A stamp holds its epoch, its micro-batch and the
sequence numbers of its nodes, nothing of the graph. The design: ``docs/how-it-works.md`` (*Stamps*).
"""

from __future__ import annotations

import collections
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

__all__ = [
    "EXPLAINED",
    "FRESH",
    "USED",
    "Ledger",
    "Stamp",
    "epochs_below",
    "metadata_of",
    "micros_below",
    "node_key",
    "oldest_below",
    "on_leaves",
]

_serial = itertools.count(1)

_NO_SEQUENCE = 2**64 - 1  # AccumulateGrad: one per leaf, alive as long as any graph uses the leaf

FRESH, USED, EXPLAINED = 0, 1, 2

Key = int

_COMPACT = 256  # stamps the ledger's index holds before it first forgets the dead ones
_TRIM_AT = 64  # counted stamps in the books before a micro-batch boundary drops the dead from their front


def node_key(node: Any) -> Key | None:
    """The sequence number of a node made by a forward; ``None`` for a leaf's ``AccumulateGrad`` (it lives
    as long as any graph of its leaf, so it has no age of its own) and for what is not a node."""
    try:
        sequence = node._sequence_nr()
    except (AttributeError, RuntimeError, TypeError):
        return None
    return None if sequence == _NO_SEQUENCE else sequence


def on_leaves(node: Any) -> bool:
    """Whether every node right below ``node`` is a leaf's ``AccumulateGrad`` (and there is one): a node on
    parameters alone, such as a tied weight's view, is the model's, made once, not a step's."""
    below = False
    for child, _ in node.next_functions:
        if child is not None:
            if node_key(child) is not None:
                return False
            below = True
    return below


def metadata_of(node: Any) -> dict[Any, Any] | None:
    """``node.metadata`` when it is a plain dict (it always is for torch's nodes), else ``None``."""
    try:
        metadata = node.metadata
    except (AttributeError, RuntimeError):
        return None
    return metadata if type(metadata) is dict else None


class Stamp(list[int]):
    """The stamp of one epoch and kind in one ledger, shared by every node stamped so; as a list, the
    sequence numbers of the nodes it was put in (a filter: see :meth:`Ledger.keys`).

    A list, so that making one (once per epoch, on the hot path) runs no Python code; compared and hashed
    by identity all the same.

    Attributes:
        epoch: The step boundary count it was placed at.
        kind: ``FRESH``, ``USED`` (its nodes were stamped when a later backward started from them or ran
            through them) or ``EXPLAINED`` (a judged graph's nodes: never counted).
        micro: The number of the backward that placed it (from 1), or 0 for one an audit placed.
    """

    __slots__ = ("__weakref__", "epoch", "kind", "micro")

    epoch: int
    kind: int
    micro: int

    __hash__ = object.__hash__  # type: ignore[assignment]
    __eq__ = object.__eq__  # type: ignore[assignment]
    __ne__ = object.__ne__  # type: ignore[assignment]

    @property
    def used(self) -> bool:
        """Whether its nodes were stamped when a later backward started from them or ran through them."""
        return self.kind == USED

    def __repr__(self) -> str:
        what = "explained" if self.kind == EXPLAINED else "used" if self.kind == USED else "fresh"
        micro = f" micro={self.micro}" if self.micro else ""
        return f"<gradguard stamp epoch={self.epoch}{micro} {what}>"


_Entry = tuple[int, "weakref.ref[Stamp]"]


class Ledger:
    """The stamps one watcher placed for one thread's boundaries, by epoch.

    :meth:`place` stamps a node (once; ``refresh=True`` moves it to a later epoch's *used* stamp);
    :meth:`stamp_roots` is the same for a backward's roots, on the hot path. :meth:`oldest_alive` gives the
    earliest epoch up to a boundary whose counted stamp is alive: the ledger's books hold each counted
    stamp's weak reference in epoch order, and reading them drops the dead ones from the front, so the
    answer costs the same on any heap and whatever the number of nodes. :meth:`judged` stops counting a
    node whose graph was judged. :meth:`settle` sets the horizon at or below which old stamps were looked
    at by an audit. :meth:`micro_old` reads the backwards' own stamps as :meth:`oldest_alive` reads the books,
    from the front, for the micro-batch clock.
    """

    __slots__ = (
        "_compact_at",
        "_current",
        "_index",
        "_index_at",
        "_lock",
        "_micro",
        "_open",
        "_settled",
        "first_key",
        "horizon",
        "key",
        "micro_horizon",
        "placed",
    )

    def __init__(self) -> None:
        self.key = f"gradguard.stamp.{next(_serial)}"
        """The key of this ledger's stamps in a node's ``metadata``."""
        self.first_key = self.key + ".first"
        """The key of the epoch a node was first stamped at, once a later use moved its stamp."""
        # The stamps by (epoch, kind) (epoch * 4 + kind), weakly; not the backwards' own fresh ones.
        self._index: dict[int, weakref.ref[Stamp]] = {}
        self._index_at = _COMPACT
        # The counted stamps (epoch, weak reference): above the horizon, in epoch order; at or below it.
        # Dead ones stay until a read drops them.
        self._open: collections.deque[_Entry] = collections.deque()
        self._settled: list[_Entry] = []
        self._compact_at = _COMPACT
        self._current: Stamp | None = None  # the newest backward's stamp, kept while its epoch is young
        # The backwards' own stamps (micro-batch number, weak reference), in order; dropped from the front
        # once dead or at or below the micro horizon.
        self._micro: collections.deque[_Entry] = collections.deque()
        self.micro_horizon = 0
        """Backwards up to this one had their graphs looked at by an audit or a read: the micro-batch
        clock's signal no longer asks about them."""
        self._lock = threading.Lock()
        self.horizon = -1
        """Stamps of epochs up to here were looked at by an audit."""
        self.placed = 0
        """Nodes stamped so far."""

    # --- placing ----------------------------------------------------------------------------------

    def _token(self, epoch: int, kind: int) -> Stamp:
        """The stamp of ``epoch`` and ``kind``, made when there is none (findable by them later)."""
        ref = self._index.get(epoch * 4 + kind)
        token = None if ref is None else ref()
        if token is not None:
            return token
        token = Stamp()
        token.epoch, token.kind, token.micro = epoch, kind, 0
        ref = weakref.ref(token)
        found = self._index
        found[epoch * 4 + kind] = ref
        if len(found) > self._index_at:  # replaced, not mutated: a concurrent lookup sees one or the other
            self._index = found = {k: r for k, r in list(found.items()) if r() is not None}
            self._index_at = 2 * len(found) + _COMPACT
        if kind != EXPLAINED:
            self._count(epoch, ref)
        return token

    def _backward_token(self, epoch: int, micro: int) -> Stamp:
        """A new stamp for the backward number ``micro`` (0: none) at ``epoch``; :attr:`_current` finds it."""
        token = Stamp()
        token.epoch, token.kind, token.micro = epoch, FRESH, micro
        ref = weakref.ref(token)
        if micro:
            self._micro.append((micro, ref))
        self._count(epoch, ref)
        return token

    def _count(self, epoch: int, ref: weakref.ref[Stamp]) -> None:
        """Put a counted stamp's reference in the books, in epoch order."""
        entry = (epoch, ref)  # made before any lock: a collection it runs may run a finalizer that backwards
        if epoch <= self.horizon:
            with self._lock:
                self._settled.append(entry)
            return
        opened = self._open
        # Without a lock (this runs at backwards, in any thread): appending is atomic, and the thread
        # that reads the books only drops entries from the front or moves live ones to the back.
        if not opened or opened[-1][0] <= epoch:
            opened.append(entry)
        else:  # an audit stamps at an earlier epoch: kept in order
            with self._lock:
                at = len(opened)
                while at and opened[at - 1][0] > epoch:
                    at -= 1
                opened.insert(at, entry)

    def _compact(self) -> None:
        """Forget the dead stamps behind a live one at the front of the books (in the thread that reads
        them): each live entry is moved to the back in turn, so one appended meanwhile is never lost."""
        opened = self._open
        with self._lock:
            for _ in range(len(opened)):
                entry = opened.popleft()
                if entry[1]() is not None:
                    opened.append(entry)
            self._compact_at = 2 * len(opened) + _COMPACT

    def stamp_roots(self, roots: Iterable[Any], epoch: int, micro: int = 0, below: bool = False) -> list[Any]:
        """A backward from ``roots`` (tensors, gradient edges or nodes) starts at ``epoch``; ``micro`` is its
        number (0: a nested backward, stamped with the one it runs in): a root's node with no stamp gets
        the backward's, one stamped at an earlier epoch gets the epoch's *used* one (its graph is in use
        again). ``below``: the nodes right below each root stamped for the first time get the backward's
        stamp too, unless they have one or are the model's own (:func:`on_leaves`). Returns the roots'
        nodes stamped for the first time."""
        # Every backward of the process comes through here: the common path is kept short.
        token = self._current
        if token is None or token.epoch != epoch or (micro and token.micro != micro):
            token = self._current = self._backward_token(epoch, micro)
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
                token.append(node._sequence_nr())
                new.append(node)
            elif found.epoch < epoch:
                self.used(metadata, found, epoch, node._sequence_nr())
        if not new:
            return new
        placed = len(new)
        if below:
            # The nodes right below: what place(child, epoch, current=True) does for each, written out.
            for node in new:
                for child, _ in node.next_functions:
                    if child is None:
                        continue
                    sequence = node_key(child)
                    if sequence is None or on_leaves(child):
                        continue
                    try:
                        metadata = child.metadata
                    except (AttributeError, RuntimeError):
                        continue
                    if type(metadata) is not dict or type(metadata.get(key)) is Stamp:
                        continue
                    metadata[key] = token
                    token.append(sequence)
                    placed += 1
        self.placed += placed
        return new

    def place(self, node: Any, epoch: int, refresh: bool = False, current: bool = False) -> bool:
        """Stamp ``node`` at ``epoch``; ``True`` when a stamp was placed or moved. ``refresh``: a node
        stamped at an earlier epoch moves to this one's *used* stamp. ``current``: with the stamp of the
        backward that runs now (a node below its roots), else with the epoch's own (an audit's). A leaf's
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
            self.used(metadata, found, epoch, key)
            return True
        else:
            backward = self._current
            if current and backward is not None and backward.epoch == epoch:
                token = backward
            else:
                token = self._token(epoch, FRESH)
            self.placed += 1
        metadata[self.key] = token
        token.append(key)
        return True

    def used(self, metadata: dict[Any, Any], found: Stamp, epoch: int, sequence: int) -> None:
        """A node whose ``metadata`` holds ``found`` was used by a backward at ``epoch``: it gets that epoch's
        *used* stamp, and remembers the epoch it was first stamped at."""
        metadata.setdefault(self.first_key, found.epoch)
        token = self._token(epoch, USED)
        metadata[self.key] = token
        token.append(sequence)

    def first(self, node: Any, found: Stamp) -> int:
        """The epoch ``node`` (whose stamp is ``found``) was first stamped at."""
        metadata = metadata_of(node)
        first = None if metadata is None else metadata.get(self.first_key)
        return first if type(first) is int else found.epoch

    def judged(self, node: Any) -> None:
        """Stop counting ``node``'s stamp (its graph was judged); it keeps its epoch."""
        metadata = metadata_of(node)
        found = None if metadata is None else metadata.get(self.key)
        if type(found) is Stamp and found.kind != EXPLAINED:
            token = self._token(found.epoch, EXPLAINED)
            metadata[self.key] = token  # type: ignore[index]
            token.append(node_key(node) or 0)

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
        while True:
            try:
                epoch, ref = opened[0]
            except IndexError:
                return None
            if epoch > through:
                return None
            if ref() is not None:
                if len(opened) > self._compact_at:
                    self._compact()
                return epoch
            # Dead: dropped. Only this thread takes from the front; an audit's insert there meanwhile
            # (another thread's, under the lock) is put back.
            entry = opened.popleft()
            if entry[1] is not ref:
                opened.appendleft(entry)

    def micro_old(self, before: int) -> int | None:
        """The number of the earliest backward below ``before`` and above :attr:`micro_horizon` whose stamp is
        alive (a graph it ran through is still held), or ``None``. Call it in the thread that steps (or the
        only one that runs backwards): it drops what it passes from the front of its list, and the dead
        from the front of the books once they are long, as :meth:`oldest_alive` does."""
        if len(self._open) > _TRIM_AT:
            self.trim()
        found = self._micro
        horizon = self.micro_horizon
        while found:
            micro, ref = found[0]
            if micro >= before:
                return None
            if micro > horizon and ref() is not None:
                return micro
            found.popleft()
        return None

    def trim(self) -> None:
        """Drop the dead stamps from the front of the books (between boundaries, so that a program of
        many backwards and no optimizer step keeps them short)."""
        opened = self._open
        while opened:
            entry = opened[0]
            if entry[1]() is not None:
                if len(opened) > self._compact_at:
                    self._compact()
                return
            entry = opened.popleft()
            if entry[1]() is not None:  # another thread's insert at the front meanwhile: put back
                opened.appendleft(entry)
                return

    def settle(self, horizon: int) -> None:
        """Stamps of epochs up to ``horizon`` were looked at by an audit: :meth:`oldest_alive` no longer asks
        about them."""
        opened = self._open
        with self._lock:  # taken from the front, put back at the front: one appended meanwhile stays behind
            taken = [opened.popleft() for _ in range(len(opened))]
            entries = [entry for entry in (*self._settled, *taken) if entry[1]() is not None]
            entries.sort(key=_epoch_of)
            self._settled = [entry for entry in entries if entry[0] <= horizon]
            opened.extendleft(reversed([entry for entry in entries if entry[0] > horizon]))
            self.horizon = horizon
            self._compact_at = 2 * len(opened) + _COMPACT

    def alive(self, through: int) -> int:
        """How many epochs up to ``through`` have a counted stamp alive (graphs of that many steps)."""
        with self._lock:
            entries = [*self._settled, *self._open]
        return len({e for e, r in entries if e <= through and r() is not None})

    def keys(self) -> frozenset[Key]:
        """The sequence numbers of every node a stamp alive was put in: a node whose number is not among
        them carries none of this ledger's stamps."""
        with self._lock:
            refs = [*self._index.values(), *(r for _, r in self._open), *(r for _, r in self._settled)]
        found: set[int] = set()
        for token in map(_deref, refs):
            if token is not None:
                found.update(token)
        return frozenset(found)


def _epoch_of(entry: _Entry) -> int:
    return entry[0]


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


Span = tuple[int, int, int]


def _walk(
    root: Any,
    ledger: Ledger,
    keys: frozenset[Key],
    memo: dict[Any, Span | None],
    stop: set[Any] | None,
    collect: list[Any] | None,
) -> None:
    """``memo[node]``: the earliest stamp epoch at or below it, and the earliest and latest first-stamped epochs."""

    def own(node: Any) -> Span | None:
        found = ledger.stamp(node, keys)
        if found is None:
            return None
        if collect is not None:
            collect.append(node)
        first = ledger.first(node, found) if found.used else found.epoch
        return found.epoch, first, first

    def merge(a: Span, b: Span) -> Span:
        return min(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2])

    _post_order(root, memo, stop, own, merge)


def _post_order(
    root: Any,
    memo: dict[Any, Any],
    stop: set[Any] | None,
    own: Callable[[Any], Any],
    merge: Callable[[Any, Any], Any],
) -> None:
    """Post-order over ``root``'s graph, without recursion: ``memo[node]`` is ``own(node)`` merged with what its
    children's are (``None`` where there is nothing); the walk does not go into ``stop``'s nodes."""
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
        value = own(node)
        for child, _ in node.next_functions:
            below = memo.get(child) if child is not None else None
            if below is not None:
                value = below if value is None else merge(value, below)
        memo[node] = value


def micros_below(roots: Iterable[Any], ledger: Ledger, stop: set[Any] | None = None) -> dict[Any, int]:
    """For each root node, the number of the earliest backward whose own stamp is in its graph (a backward
    ran through it); roots whose graph holds none are left out. The walk does not go into ``stop``'s nodes.
    Each node is visited once for all the roots."""
    keys = ledger.keys()
    memo: dict[Any, int | None] = {}

    def own(node: Any) -> int | None:
        found = ledger.stamp(node, keys)
        return found.micro or None if found is not None else None

    found: dict[Any, int] = {}
    for root in roots:
        if root is None:
            continue
        if root not in memo:
            _post_order(root, memo, stop, own, min)
        micro = memo[root]
        if micro:
            found[root] = micro
    return found
