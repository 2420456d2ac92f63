"""Cyclic garbage: whether the old graphs a signal sees are only waiting for the collector.

A correct program can keep each step's graph alive past its step without holding it: a caught exception
kept in a local (its traceback holds the frame, the frame the exception), a dict that refers to itself,
a collector the program disables and runs by hand every N steps. Until the collector runs, such a graph
is old by the constant-time signal, and no holder is found for it by a search of the heap: a heap search
per request would be a cost storm. So before an ``old`` request becomes an audit, the thread asks the
collector first:

- with the collector enabled, it collects the two young generations itself (what the interpreter would
  do within a few hundred allocations anyway, at the cost of a few young objects' traversal) and looks
  at the signal again: a graph that died was garbage, and no audit runs;
- with the collector disabled (the program collects by hand), it waits for the program's next
  collection, then looks again.

The start-up check that reads the young generations collects the youngest first (when the collector
is enabled). A collection of its own is charged to the governor and rationed to
:data:`COLLECT_SHARE` of the wall time by the governor's one rate rule (:class:`~gradguard._watch.governor.Ration`),
the first one at once; while it is rationed, or while a disabled collector has not run, the request is
declined (the signal asks again at the next boundary, in constant time).
"""

from __future__ import annotations

import gc
from collections.abc import Callable

from .governor import Governor, Ration
from .tuning import COLLECT_SHARE

__all__ = ["COLLECT_SHARE", "Collector"]


def _collections() -> int:
    """How many collections of any generation ran so far in the process."""
    return sum(generation["collections"] for generation in gc.get_stats())


class Collector:
    """One thread's questions to the collector about its old graphs.

    Args:
        governor: The watcher's account (each collection is charged to it).
        clock: The clock, in seconds (the governor's by default).
        collect: Collects the young generations (tests inject one).
        enabled: Whether the collector runs by itself (tests inject one).
        collections: How many collections ran so far (tests inject one).
    """

    __slots__ = (
        "_clock",
        "_collect",
        "_collections",
        "_enabled",
        "_governor",
        "collected",
        "freed",
        "ration",
        "seen",
        "waited",
        "waiting",
    )

    def __init__(
        self,
        governor: Governor,
        clock: Callable[[], float] | None = None,
        collect: Callable[[], object] = lambda: gc.collect(1),
        enabled: Callable[[], bool] = gc.isenabled,
        collections: Callable[[], int] = _collections,
    ) -> None:
        self._governor = governor
        self._clock = clock or governor.clock
        self._collect = collect
        self._enabled = enabled
        self._collections = collections
        self.ration = Ration(COLLECT_SHARE)
        """When a collection of its own is affordable next (the first at once); its ``seconds``: what they
        all took."""
        self.collected = 0
        """Collections of its own."""
        self.waiting: int | None = None
        """With the collector disabled: the collections count when an old request first waited for the
        program's next collection (``None`` while none waits)."""
        self.seen = 0
        """The last boundary that saw that count."""
        self.waited = 0
        """Requests that waited for the program's collection."""
        self.freed = 0
        """Requests whose old graphs a collection freed: cyclic garbage."""

    def young(self) -> None:
        """Before a start-up check that reads the young generations: collect the youngest, when the
        collector is enabled (the check's own time, charged with it). Only the youngest: what survives
        moves to the middle one, which the check still reads; collecting both would move what the
        first step kept to the oldest, out of the check's sight."""
        if self._enabled():
            gc.collect(0)

    def garbage(self, oldest: Callable[[], int | None], boundary: int) -> bool | None:
        """Whether an ``old`` request at ``boundary`` is for graphs that are only waiting for the collector.

        Args:
            oldest: Reads the signal again: the earliest epoch of an old graph still alive, or ``None``.
            boundary: The boundary's number.

        Returns:
            ``True``: they were garbage (a collection freed them), or they may be and the collector has
            not run since they were made (the request waits); ``False``: a graph outlived a collection,
            the request stands; ``None``: no collection could be afforded now (the request is declined,
            asked again later).
        """
        if not self._enabled():
            count = self._collections()
            if self.waiting is None or count == self.waiting:
                self.waiting, self.seen = count, boundary
                self.waited += 1
                return True
            # It ran after the boundary that last saw the count unchanged: a graph made before that
            # boundary (its epoch below it) was there when it ran.
            epoch = oldest()
            if epoch is None or epoch >= self.seen:
                self.waiting, self.seen = count, boundary
                self.waited += epoch is not None
                self.freed += 1
                return True
            return False
        self.waiting = None
        start = self._clock()
        if start < self.ration.next:
            return None
        self._collect()
        end = self._clock()
        self.ration.ran(start, end)
        self.collected += 1
        self._governor.charge(end - start)
        if oldest() is not None:
            return False
        self.freed += 1
        return True
