"""One thread's boundaries: their clock, stamps and schedule, and the stamping of each backward it starts.

Each thread has its own boundaries (its ``optimizer.step()`` calls), so each has its own state; a
backward stamps its roots in the ledger of the thread that starts it, and, on a share of the wall
time, the nodes nearest below them (a record a program keeps is often a model output or a
log-probability a few nodes below the loss).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Hashable, Sequence
from typing import Any

from .._graph.held import HeldParameters
from .._graph.stamps import Ledger, node_key
from .criterion import Clock
from .schedule import Schedule

__all__ = ["DEEP_FIRST", "DEEP_NODES", "DEEP_SHARE", "REVISIT_SHARE", "Held", "ThreadState", "stamp_backward"]

DEEP_NODES = 32
"""Nodes stamped below a backward's roots when it is sampled (see :data:`DEEP_SHARE`); with ``every=N``
the whole graph is."""

DEEP_SHARE = 0.002
"""The most of the wall time stamping below the roots may take: a record the program keeps is often a
tensor a few nodes below the loss (a model output, a log-probability), which a root's stamp does not
reach. The backwards of a thread's first :data:`DEEP_FIRST` boundaries, and every backward with
``every=N``, are always stamped so."""

DEEP_FIRST = 3
"""Boundaries of a thread whose backwards are all stamped below their roots."""


REVISIT_SHARE = 0.05
"""``detach``: the most of a thread's wall time reading the holders it repaired before may take, to find
what the program put there since (no heap pass: by name). It keeps a leak the program keeps filling
bounded; it spends nothing in a program that never leaked."""

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
        "deep_at",
        "deep_costs",
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
        self.deep_at = 0.0  # when the last backward was stamped below its roots
        self.deep_costs: collections.deque[float] = collections.deque(maxlen=3)  # what the last ones took
        self.repairing: tuple[int, dict[str, int]] | None = None  # memory in use before repairs, their estimates
        self.revisit_cost = 0.0  # what the last read of the holders found before took
        self.revisit_spent = 0.0

    def revisit_due(self, now: float) -> bool:
        """Whether reading the holders found before again fits :data:`REVISIT_SHARE` of the thread's time."""
        started = self.schedule.started
        return started is not None and self.revisit_spent + self.revisit_cost <= REVISIT_SHARE * (now - started)

    def revisited(self, cost: float) -> None:
        self.revisit_cost = cost
        self.revisit_spent += cost



def stamp_backward(state: ThreadState, roots: Sequence[Any], *, hunting: bool) -> None:
    """Stamp a backward's roots (a root stamped before moves to now: its graph is in use again), and the
    nodes nearest below them when due: always in the thread's first :data:`DEEP_FIRST` boundaries and
    when ``hunting`` (the whole graph then), else when the cheapest of the last few stampings took at most
    :data:`DEEP_SHARE` of the time since the last one (one slow stamping does not stall the next)."""
    epoch = state.clock.boundaries
    ledger = state.ledger
    nodes = [node for node in (getattr(t, "grad_fn", None) for t in roots) if node is not None]
    for node in nodes:
        ledger.place(node, epoch, refresh=True)
    if not nodes:
        return
    if not (hunting or epoch < DEEP_FIRST or not state.deep_costs):
        if min(state.deep_costs) > DEEP_SHARE * (_clock() - state.deep_at):
            return
    start = _clock()
    _stamp_below(nodes, ledger, epoch, None if hunting else DEEP_NODES)
    state.deep_at = _clock()
    state.deep_costs.append(state.deep_at - start)


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
