"""The micro-batch clock: whether a store filled once per micro-batch keeps the graphs its backwards ran through.

Every backward that is not nested is a micro-batch boundary of the thread whose ledger it stamps (its own
stamp: :meth:`~gradguard._graph.stamps.Ledger.micro_old`). Once it returned, a graph an *earlier* backward
ran through should be gone: one still alive is the signal. What decides is growth, not age: a holder
**leaks on this clock** when two reads of it within one step (no optimizer step between them) find it
keeping more graphs that a backward already ran through and that no backward can use any more, and more
graph tensors in all. A holder bounded by construction (a ``deque(maxlen=...)``, a slot overwritten, the
last micro-batch's output in a local) never grows so; outputs kept for a backward still to come (GPipe,
1F1B, interleaved) were not backwarded; a ``retain_graph=True`` graph is still usable; one backward over
every micro-batch's summed losses stamps nothing before it. :func:`judge` is the rule; whether a boundary
reads or searches is :func:`gradguard._watch.decision.decide`'s; the reads and searches are the auditor's
(:meth:`gradguard._watch.auditing.Auditor.micro`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from .._graph.liveness import Liveness
from .._graph.stamps import Ledger
from .._heap.ownership import path_owners
from .audit import Finding
from .backoff import Backoff
from .criterion import store
from .recipes import Recipe
from .tuning import FOLLOW
from .tuning import MICRO_FREE as FREE

__all__ = [
    "FOLLOW",
    "FREE",
    "Searches",
    "Count",
    "Follow",
    "count",
    "forget_empty",
    "judge",
    "judged",
]


@dataclasses.dataclass
class Searches(Backoff):
    """The micro-batch signal's searches (see :class:`~gradguard._watch.backoff.Backoff`; its boundaries are
    micro-batch numbers), and the requests declined."""

    declined: int = 0  # requests the back-off or the budget declined
    searches: int = 0

    def searched(self, micro: int, cost: float, found: bool) -> None:
        """A search at micro-batch ``micro`` took ``cost`` seconds; ``found``: it found a holder to follow."""
        self.searches += 1
        self.handled(micro, cost, found, FREE)


@dataclasses.dataclass
class Follow:
    """A holder read by name at micro-batch boundaries: its recipe, what the last read counted (graphs a
    backward ran through that are dead, graph tensors in all), the step of that read, the reads since it
    last grew, and whether it was found leaking (then it is read for as long as it keeps filling)."""

    recipe: Recipe | None  # None: not walkable by names (a closure, a suspended generator): searches read it
    dead: int
    total: int
    step: int
    by_name: bool = False  # the last read was by name (a search may name a record through another holder)
    quiet: int = 0
    leaking: bool = False


class Count(NamedTuple):
    """One read of a holder: the indices of its tensors whose graph a backward before this boundary ran
    through and that no backward can use any more, and its graph tensors in all."""

    dead: list[int]
    total: int


def judged(finding: Finding) -> bool:
    """Whether the micro-batch clock judges this holder: a store (see
    :func:`~gradguard._watch.criterion.store`) that is not torch's own state (a pipelining schedule keeps
    each micro-batch's loss until its step returns them: torch's design, released by the engine adapter)."""
    if not store(finding):
        return False
    owners = path_owners(finding.paths[0])
    return not owners or owners[-1].label != "torch"


def count(finding: Finding, micros: dict[Any, int], before: int, liveness: Liveness, ledger: Ledger) -> Count:
    """What ``finding`` keeps that counts on this clock (``micros``: :func:`~gradguard._graph.stamps.micros_below`
    of its tensors' nodes; ``before``: this boundary's micro-batch number): graphs an earlier backward ran
    through that no backward can use any more, or that hang off one (a side branch made after it, whose own
    node no backward started from); not a graph kept with ``retain_graph=True``, usable whole."""
    dead = [
        i
        for i, t in enumerate(finding.tensors)
        if 0 < micros.get(t.grad_fn, 0) < before
        and (not liveness.state(t.grad_fn).alive or ledger.stamp(t.grad_fn) is None)
    ]
    return Count(dead, len(finding.tensors))


def judge(finding: Finding, counted: Count, following: dict[str, Follow], step: int, by_name: bool) -> bool:
    """Whether one holder read at a micro-batch boundary of step ``step`` leaks on this clock (see the module
    documentation): it grew since its last read of the same kind (``by_name``, or a search) within the step.
    Otherwise it is followed from now on, or no longer, once :data:`FOLLOW` reads found no growth; a holder
    found leaking is followed for as long as it keeps graphs (the auditor reads it, and ``detach`` repairs
    it, at each boundary)."""
    key = finding.key
    last = following.get(key)
    if last is None:
        if counted.dead:
            recipe = Recipe.of(finding.paths[counted.dead[0]])
            following[key] = Follow(recipe, len(counted.dead), counted.total, step, by_name)
        return False
    grew = (
        last.step == step and last.by_name == by_name and len(counted.dead) > last.dead and counted.total > last.total
    )
    last.by_name = by_name
    last.quiet = 0 if grew else last.quiet + 1
    last.dead, last.total, last.step = len(counted.dead), counted.total, step
    if grew and not last.leaking:
        last.leaking = True
        return True
    if not last.leaking and last.quiet >= FOLLOW:
        del following[key]
    return False


def forget_empty(key: str, following: dict[str, Follow], step: int) -> None:
    """A followed holder read by name keeps no graph now (emptied, or its function returned): its count is 0,
    and it is no longer followed once :data:`FOLLOW` reads found no growth."""
    last = following[key]
    last.quiet += 1
    last.dead, last.total, last.step, last.by_name = 0, 0, step, True
    if last.quiet >= FOLLOW:
        del following[key]
