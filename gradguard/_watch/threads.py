"""One thread's boundaries: their clock, stamps and schedule, and the stamping of each backward.

Each thread that steps an optimizer has its own boundaries, so its own state. Every backward stamps
its roots (one shared stamp per epoch: see :mod:`gradguard._graph.stamps`) in the ledger of the
thread whose boundaries age it: its own, once it stepped; before that, the thread's that stepped last
(a backward run in a worker thread feeds the optimizer of the thread that steps). The nodes right below
each root are stamped at every backward (a loss scaled or divided before it), and on a share of the wall
time the nodes nearest below the roots (a record a program keeps is often a model output or a
log-probability a few nodes below the loss). Every graph an audit sees is *armed*: a hook
on its node moves its stamp to the current epoch's *used* one when a later backward runs through it,
so a graph in use is never a leak.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

from .._graph.held import HeldParameters
from .._graph.stamps import Ledger, Stamp, metadata_of, node_key, on_leaves
from .allocated import AllocatedReader
from .criterion import Clock
from .garbage import Collector
from .governor import Governor, Ration
from .schedule import Schedule
from .tuning import DEEP_NODES, DEEP_SHARE, PARAMETER_SAMPLE, READ_SHARE

__all__ = ["DEEP_NODES", "DEEP_SHARE", "ParameterCount", "ThreadState", "arm", "micro_pending", "stamp_backward"]


_clock = time.perf_counter


class ParameterCount:
    """One optimizer's parameters' reference count (:mod:`gradguard._graph.held`), as the schedule takes it:
    by name, and only when it changed (a count that does not move asks for nothing)."""

    __slots__ = ("_optimizers", "last", "name", "read")

    def __init__(self, optimizers: tuple[Any, ...]) -> None:
        self.read = HeldParameters(optimizers, PARAMETER_SAMPLE)
        self.name = "parameters of " + ", ".join(type(o).__name__ for o in optimizers)
        self.last: int | None = None
        self._optimizers = [weakref.ref(o) for o in optimizers]

    def optimizers(self) -> list[Any]:
        """The optimizers still alive."""
        return [o for o in (ref() for ref in self._optimizers) if o is not None]


class ThreadState:
    """One thread's boundaries: their clock, the schedule, the stamps, and the last boundary's step."""

    __slots__ = (
        "__weakref__",
        "backwards",
        "busy",
        "clock",
        "collector",
        "deep",
        "entry",
        "first",
        "followed",
        "following",
        "held",
        "ledger",
        "micro",
        "micro_backoff",
        "micro_collector",
        "owner",
        "reader",
        "partners",
        "promotions",
        "refilling",
        "repairing",
        "schedule",
        "sequence",
        "stepped",
        "unexplained",
        "unseen",
    )

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.collector = Collector(schedule.governor)
        self.clock = Clock()
        self.ledger = Ledger()
        self.unexplained = 0  # old graphs alive at the last audit that no holder was found for
        self.sequence: int | None = None  # torch's node counter of this thread at the end of the last boundary
        self.stepped: set[Hashable] = set()  # the sources already stepped since that counter last moved
        self.first: Hashable = None  # the source that ticked the last boundary
        self.partners: dict[Hashable, set[Hashable]] = {}  # per source, the others that stepped at its boundaries
        self.held: dict[Hashable, ParameterCount] = {}
        self.promotions: tuple[int, int] | None = None  # the collector's at the end of the last audit
        self.busy = False
        self.deep = Ration(DEEP_SHARE)  # when to stamp below the roots next
        self.backwards = 0  # backwards stamped into this ledger since its last boundary
        self.unseen = 0  # boundaries at which no backward had been seen since the one before
        self.entry = 0  # the watch's entries this thread's schedule has seen
        self.repairing: tuple[int, dict[str, int]] | None = None  # memory in use before repairs, their estimates
        self.refilling = False  # the last read of the holders repaired before repaired something
        self.micro = 0  # backwards stamped into this ledger (not nested): the micro-batch clock
        self.following: dict[str, Any] = {}  # holders the micro-batch clock reads by name (see micro.py)
        self.followed: set[str] = set()  # every holder it has followed
        self.micro_backoff: Any = None  # the micro-batch clock's requests (see micro.py)
        # its own questions to the collector: a ration of their own, so that a storm of cyclic garbage between
        # micro-batches never declines the step clock's requests
        self.micro_collector = Collector(schedule.governor)
        self.owner = threading.get_ident()  # the thread whose boundaries these are
        self.reader: AllocatedReader | None = (  # the memory figure at micro-batch boundaries, for the timeline
            None
            if schedule.reader is None
            else AllocatedReader(cpu=schedule.reader.cpu_source or "off", share=READ_SHARE)
        )


def micro_pending(state: ThreadState, now: float) -> tuple[bool, bool]:
    """What the micro-batch boundary of a backward of ``state``'s thread has to do at ``now``: whether its
    memory reading is due, and whether a graph of an earlier backward is still alive (or a holder is
    followed by name). Asked when the backward starts (a dead graph never comes back: nothing to do then
    means nothing to do after it) and again once it returned."""
    reader = state.reader
    due = reader is not None and now >= reader.next_due()
    return due, bool(state.following) or state.ledger.micro_old(state.micro) is not None


def stamp_backward(
    state: ThreadState, roots: Sequence[Any], governor: Governor, whole_graph: bool, start: float, nested: bool = False
) -> float:
    """At the start of a backward from ``roots`` (its root tensors, edges or nodes), which reached the watch
    at ``start`` (the clock's reading): a micro-batch boundary unless ``nested`` (started inside another
    backward of the thread), stamped with a stamp of its own; every root is stamped (one stamped before
    moves to now: its graph is in use again), and the nodes right below each new one; when due (see
    :data:`DEEP_SHARE`) the nodes nearest below them instead (the whole graph when ``whole_graph``: with
    ``every=N``). Returns the seconds the nodes below took, charged to ``governor.below`` (the caller
    charges the rest of its time to ``governor.stamping``)."""
    epoch = state.clock.boundaries
    if nested:
        micro = 0
    else:
        micro = state.micro = state.micro + 1
    # the start-up check's steps (after each entry of the watch) are stamped deep whatever it costs
    deep = whole_graph or epoch <= state.schedule.startup or start >= state.deep.next
    new = state.ledger.stamp_roots(roots, epoch, micro, not deep)
    state.backwards += 1
    governor.backwards += 1
    if not new or not deep:
        return 0.0
    now = _clock()
    _stamp_below(new, state.ledger, epoch, None if whole_graph else DEEP_NODES)
    end = _clock()
    state.deep.ran(now, end)
    governor.below += end - now
    return end - now


def arm(state: ThreadState, node: Any, boundary: int) -> bool:
    """Follow the use of an old graph that can still be backwarded: a hook on ``node`` moves its stamp to
    the current epoch's *used* one when a backward runs through it. Returns whether it was armed at an
    earlier boundary (a whole step went by in which a backward could have used it), arming it now if
    it was not. The hook refers to the node's ``metadata`` and, weakly, to ``state``: never to the node."""
    metadata = metadata_of(node)
    if metadata is None:
        return True  # a node that cannot be followed: judged as it is
    mark = state.ledger.key + ".armed"
    armed = metadata.get(mark)
    if type(armed) is int:
        return armed < boundary
    ref = weakref.ref(state)
    key = state.ledger.key

    def used(_grad_outputs: Any) -> None:
        owner = ref()
        found = metadata.get(key)
        if owner is not None and type(found) is Stamp:
            owner.ledger.used(metadata, found, owner.clock.boundaries, sequence)

    sequence = node_key(node) or 0
    try:
        node.register_prehook(used)
    except (AttributeError, RuntimeError, TypeError):
        return True
    metadata[mark] = boundary
    return False


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
            if on_leaves(child):
                continue
            ledger.place(child, epoch, current=True)
            placed += 1
            queue.append(child)
