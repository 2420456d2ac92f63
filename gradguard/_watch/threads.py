"""One thread's boundaries: their clock, stamps and schedule, and the stamping of each backward it starts.

Each thread has its own boundaries (its ``optimizer.step()`` calls), so each has its own state; a
backward stamps its roots in the ledger of the thread that starts it, and, on a share of the wall
time, the nodes nearest below them (a record a program keeps is often a model output or a
log-probability a few nodes below the loss).
"""

from __future__ import annotations

import collections
import contextlib
import time
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

from .._graph.held import HeldParameters
from .._graph.stamps import Ledger, node_key
from .criterion import Clock
from .schedule import Schedule

__all__ = [
    "DEEP_NODES",
    "DEEP_SHARE",
    "REVISIT_SHARE",
    "STAMP_FIRST",
    "STAMP_SHARE",
    "Held",
    "ThreadState",
    "stamp_backward",
]

STAMP_SHARE = 0.005
"""The most of the wall time stamping backwards' roots may take. A stamp costs a few microseconds (a
node's ``metadata`` is made for it), a step of a small model on a CPU a fraction of a millisecond: a
backward's roots are stamped when the cheapest of the last few stampings took at most this share of the
time since the last one (one slow stamping does not stall the next), so a step of a millisecond or more
has every backward stamped, a shorter one one in a few. The backwards of a thread's first
:data:`STAMP_FIRST` boundaries, and every one with ``every=N``, always are."""

DEEP_SHARE = 0.002
"""The same for the nodes nearest below the roots of a backward whose roots were stamped (up to
:data:`DEEP_NODES`): a record a program keeps is often a tensor a few nodes below the loss (a model
output, a log-probability), which the root's stamp does not reach."""

STAMP_FIRST = 3
"""Boundaries of a thread whose backwards are all stamped, roots and below."""

DEEP_NODES = 32
"""Nodes stamped below the roots, nearest first; with ``every=N`` the whole graph is."""

REVISIT_SHARE = 0.05
"""``detach``: the most of a thread's wall time reading the holders found before may take, to find what
the program put there since (no heap pass: by name); it spends nothing in a program that never leaked.
While a holder it repaired keeps filling, every boundary reads that holder (its newest records) and
repairs what it took: a leak the program keeps filling stays at one step's records, at the cost of
repairing them, which is the leak's own."""

_clock = time.perf_counter


class Held:
    """One optimizer's sampled parameter reference count (:mod:`gradguard._graph.held`), as the schedule
    takes it: by name, and only when it changed (a count that does not move asks for nothing)."""

    __slots__ = ("last", "name", "read")

    def __init__(self, optimizers: tuple[Any, ...]) -> None:
        self.read = HeldParameters(optimizers)
        self.name = "parameters of " + ", ".join(type(o).__name__ for o in optimizers)
        self.last: int | None = None

    def changed(self) -> dict[str, int] | None:
        """The count by name when it moved since the last call, else ``None``."""
        count = self.read()
        if count is None or count == self.last:
            return None
        self.last = count
        return {self.name: count}


class ThreadState:
    """One thread's boundaries: their clock, the schedule, the stamps, and the last boundary's step."""

    __slots__ = (
        "busy",
        "clock",
        "deep",
        "roots",
        "stamp",
        "refilling",
        "repairing",
        "revisit_cost",
        "revisit_spent",
        "held",
        "horizon",
        "ledger",
        "schedule",
        "sequence",
        "stepped",
        "unexplained",
    )

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.clock = Clock()
        self.ledger = Ledger()
        self.horizon = -1  # stamps of epochs up to here were looked at by an audit
        self.unexplained = 0  # old graphs alive at the last audit that no holder was found for
        self.sequence: int | None = None  # torch's node counter of this thread at the end of the last boundary
        self.stepped: set[Hashable] = set()  # the sources already stepped since that counter last moved
        self.held: dict[Hashable, Held] = {}
        self.busy = False
        self.stamp = _Rate(STAMP_SHARE)  # when to stamp a backward's roots next
        self.deep = _Rate(DEEP_SHARE)  # when to stamp below them next
        self.roots: weakref.WeakSet[Any] = weakref.WeakSet()  # the tensors whose backward was stamped
        self.repairing: tuple[int, dict[str, int]] | None = None  # memory in use before repairs, their estimates
        self.refilling = False  # the last read of the holders repaired before repaired something
        self.revisit_cost = 0.0  # what the last read of the holders found before took
        self.revisit_spent = 0.0

    def revisit_due(self, now: float) -> bool:
        """Whether reading the holders found before again fits :data:`REVISIT_SHARE` of the thread's time."""
        started = self.schedule.started
        return started is not None and self.revisit_spent + self.revisit_cost <= REVISIT_SHARE * (now - started)

    def revisited(self, cost: float) -> None:
        self.revisit_cost = cost
        self.revisit_spent += cost


class _Rate:
    """When a job that should take at most ``share`` of the wall time may run next: once the cheapest of
    its last three runs is at most ``share`` of the time since the last one ended."""

    __slots__ = ("costs", "next", "share")

    def __init__(self, share: float) -> None:
        self.share = share
        self.costs: collections.deque[float] = collections.deque(maxlen=3)
        self.next = 0.0

    def ran(self, start: float, end: float) -> None:
        self.costs.append(end - start)
        self.next = end + min(self.costs) / self.share


def stamp_backward(state: ThreadState, roots: Sequence[Any], *, hunting: bool) -> None:
    """At the start of a backward from ``roots``: a root stamped before moves to now (its graph is in use
    again); and when due (see :data:`STAMP_SHARE` and :data:`DEEP_SHARE`), the roots and the nodes
    nearest below them are stamped (the whole graph when ``hunting``)."""
    epoch = state.clock.boundaries
    ledger = state.ledger
    stamped = state.roots
    for t in roots:
        try:
            again = t in stamped
        except TypeError:  # a tensor subclass without weak references
            again = False
        if again:
            ledger.place(t.grad_fn, epoch, refresh=True)
    always = hunting or epoch < STAMP_FIRST
    start = _clock()
    if not always and start < state.stamp.next:
        return
    nodes = []
    for t in roots:
        node = getattr(t, "grad_fn", None)
        if node is not None and ledger.place(node, epoch, refresh=True):
            nodes.append(node)
            with contextlib.suppress(TypeError):
                stamped.add(t)
    middle = _clock()
    state.stamp.ran(start, middle)
    if nodes and (always or middle >= state.deep.next):
        _stamp_below(nodes, ledger, epoch, None if hunting else DEEP_NODES)
        state.deep.ran(middle, _clock())


def _stamp_below(roots: Sequence[Any], ledger: Ledger, epoch: int, most: int | None) -> None:
    """Stamp up to ``most`` nodes nearest below ``roots`` (breadth first; ``None``: every one)."""
    seen: set[Any] = set(roots)
    queue = collections.deque(roots)
    placed = 0
    while queue and (most is None or placed < most):
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None or child in seen or node_key(child) is None:
                continue
            seen.add(child)
            below = [grand for grand, _ in child.next_functions if grand is not None]
            if below and all(node_key(grand) is None for grand in below):
                continue  # a node on parameters alone (a tied weight's view): the model, made once
            ledger.place(child, epoch)
            placed += 1
            queue.append(child)
