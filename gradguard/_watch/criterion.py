"""The watch's leak criterion: which holders of the graphs alive at a step boundary leak, which are bounded.

A graph's age comes from its stamps (:mod:`gradguard._graph.stamps`): the earliest epoch of a stamp
in it, or, when a later backward started from its root again, that backward's (it is in use). It
has *survived* the boundaries of the judging optimizer made since then. A holder **leaks** when one
of its graphs survived two of them, or when it is a sequence (or a dict keyed by step) that holds
graphs of different steps, one of which survived a boundary: both grow. A holder whose one
graph survived exactly one boundary (``self.last_loss = loss`` after ``optimizer.step()``), or that is
bounded by construction (a ``deque`` whose ``maxlen`` is at most :data:`CAPPED`), is **bounded**: listed
with what it pins, never acted on. The rule does not depend on where the assignment sits; plain variables
are not listed as bounded (``loss = train_step(batch)`` keeps the previous step's loss while the next one
runs). Which optimizers' boundaries count, other threads' frames, and graphs old only through another holder:
``docs/guide/finding-leaks.md``.
"""

from __future__ import annotations

import bisect
import collections
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch

from .._graph.liveness import Liveness
from .._graph.stamps import Ledger, epochs_below
from .._heap.holders import thread_frames
from .._heap.paths import Path
from .audit import Finding
from .tuning import CAPPED
from .tuning import KEPT_BOUNDARIES as _KEPT

__all__ = ["Age", "Clock", "Leak", "Verdicts", "ages", "capped", "judge", "store", "variable"]


class Clock:
    """One thread's step boundaries: their count (the *epoch* a stamp is placed at), and, per source
    (an optimizer, or direct :meth:`Watcher.boundary` calls), at which of them it stepped."""

    __slots__ = ("audited", "boundaries", "sources")

    def __init__(self) -> None:
        self.boundaries = 0
        self.audited = 0  # the boundary of the last audit
        self.sources: collections.OrderedDict[Hashable, collections.deque[int]] = collections.OrderedDict()

    def tick(self, source: Hashable) -> int:
        """A boundary of ``source``: its number in the thread, from 1."""
        self.boundaries = boundaries = self.boundaries + 1
        steps = self.sources.get(source)
        if steps is None:
            self.also(source)
        else:
            steps.append(boundaries)
        return boundaries

    def also(self, source: Hashable) -> None:
        """``source`` stepped at the current boundary too (two optimizers over one backward)."""
        steps = self.sources.get(source)
        if steps is None:
            steps = self.sources[source] = collections.deque(maxlen=_KEPT)
            while len(self.sources) > 16:  # the optimizers seen first are forgotten first
                self.sources.popitem(last=False)
        if not steps or steps[-1] != self.boundaries:
            steps.append(self.boundaries)

    def survived(self, source: Hashable, epoch: int) -> int:
        """Boundaries of ``source`` a graph stamped at ``epoch`` has lived through, the current one not
        counted (a stamp at epoch ``e`` was placed after boundary ``e``)."""
        steps = self.sources.get(source)
        if not steps:
            return 0
        now = self.boundaries
        later = len(steps) - bisect.bisect_right(steps, epoch)
        return later - (1 if steps[-1] == now else 0)


class Age(NamedTuple):
    """A held graph's earliest stamp epoch, whether that stamp is its root's own, and whether its graph holds
    stamps of several epochs (it was built over several steps)."""

    born: int
    own: bool
    mixed: bool = False


def ages(tensors: Sequence[torch.Tensor], ledger: Ledger, model: set[Any] | None = None) -> dict[int, Age]:
    """For each tensor (by id) whose graph holds a stamp of ``ledger``, its :class:`Age`. The walks do not
    go into ``model``'s nodes (views of parameters: they live as long as the model, in every step's graph)."""
    roots = [t.grad_fn for t in tensors]
    epochs = epochs_below(roots, ledger, stop=model)
    found: dict[int, Age] = {}
    for t, root in zip(tensors, roots):
        span = epochs.get(root)
        if span is None:
            continue
        born, first, last = span
        stamp = ledger.stamp(root)
        if last > first:  # built over several steps: as old as its oldest part, in use or not
            found[id(t)] = Age(first, stamp is not None and ledger.first(root, stamp) == first, True)
        elif stamp is not None and stamp.used:  # backwarded again since: the whole graph is in use now
            found[id(t)] = Age(stamp.epoch, True)
        else:
            found[id(t)] = Age(born, stamp is not None and stamp.epoch == born)
        del stamp
    return found


def _other_threads_frames() -> set[int]:
    """ids of the frames on every other thread's stack now."""
    return set(map(id, thread_frames(others=True)))


def variable(path: Path) -> bool:
    """A variable of a frame or of the program's ``__main__``, or a container in one (``loss``,
    ``out[0]``, ``HISTORY[3]['loss']``): not an object's state (no attribute on the way)."""
    if not path or not all(edge.kind == "item" for edge in path[1:]):
        return False
    root = path[0]
    return root.kind == "local" or (root.kind == "global" and root.owner is sys.modules.get("__main__"))


class Leak(NamedTuple):
    """A leaking holder: the finding, the indices of its tensors that outlived a boundary, the most
    boundaries one survived, and for each of those tensors whether its graph can still be backwarded."""

    finding: Finding
    leaking: list[int]
    survived: int
    alive: list[bool]


class Verdicts(NamedTuple):
    """What :func:`judge` decided: the leaks, and the bounded holders (one step's graph, kept one boundary)."""

    leaks: list[Leak]
    bounded: list[Leak]


def judge(
    findings: list[Finding],
    born_at: dict[int, Age],
    survived: Callable[[int], int],
    own_age: Callable[[Any, set[Any]], int | None],
    liveness: Liveness,
    params: Callable[[], tuple[frozenset[int], frozenset[int]]] | None,
    watched: Callable[[Any], bool] | None = None,
) -> Verdicts:
    """The leaking and the bounded holders among ``findings`` at the current boundary.

    ``born_at``: :func:`ages`. ``survived(epoch)``: the judging source's boundaries lived through.
    ``own_age(root, others)``: the earliest stamp epoch in ``root``'s graph not counting the graphs
    of ``others``. ``params`` gives the ids of the parameters the judging optimizer updates and of
    those every live optimizer updates (``None``: a boundary of no optimizer, which judges every graph).
    ``watched(node)``: whether a graph that can still be backwarded was followed through a whole step
    for a backward using it (else it is followed from now on, and not judged yet): a graph a later
    backward runs through is as young as that backward, so one in use never becomes a leak. A graph
    built over several steps (a chain each step extends) is judged at once: in use or not, it grows.

    A new tensor whose graph is old only through another old tensor the program holds (``loss =
    out + self.ema``, where ``self.ema`` keeps last step's graph) is that tensor's leak, not its
    own. One that also holds old nodes nobody else holds (``total = total + loss`` while a list
    keeps each loss) is its own.
    """
    others = _other_threads_frames()
    held_old = {t.grad_fn for f in findings for t in f.tensors if id(t) in born_at}
    updated: tuple[frozenset[int], frozenset[int]] | None = None
    verdicts = Verdicts([], [])
    for finding in findings:
        kept: list[int] = []
        alive: list[bool] = []
        lives: list[int] = []
        single: list[bool] = []  # one step's graph (not built over several)
        epochs: set[int] = set()
        for i, (tensor, path) in enumerate(zip(finding.tensors, finding.paths)):
            age = born_at.get(id(tensor))
            if age is None or (path and path[0].kind == "local" and id(path[0].owner) in others):
                continue  # a new graph; or another thread's frame: that thread's boundaries judge it
            born = age.born
            if not age.own:
                root = tensor.grad_fn
                own = own_age(root, held_old - {root})
                if own is None:
                    continue  # old only through another holder's tensor: that holder's leak
                born = own
            epochs.add(born)
            lived = survived(born)
            if lived < 1:
                continue
            state = liveness.state(tensor.grad_fn)
            if params is not None:
                if updated is None:
                    updated = params()
                own_params, known = updated
                if own_params.isdisjoint(state.leaves) and not known.isdisjoint(state.leaves):
                    continue  # this optimizer does not train through it; another one does
            kept.append(i)
            alive.append(state.alive)
            lives.append(lived)
            single.append(not age.mixed)
        if not kept:
            continue
        if capped(finding):
            verdicts.bounded.append(Leak(finding, kept, max(lives), alive))
        elif max(lives) >= 2 or (len(epochs) > 1 and _grows(finding)):
            if watched is not None:
                # A graph that can still be backwarded is judged once it was followed through a whole step
                # for a backward using it (it is young again then); until then it is pending.
                keep = [k for k, (i, a, one) in enumerate(zip(kept, alive, single))
                        if not (a and one and not watched(finding.tensors[i].grad_fn))]  # fmt: skip
                if len(keep) < len(kept):
                    kept, alive, lives = [kept[k] for k in keep], [alive[k] for k in keep], [lives[k] for k in keep]
                    if not kept or (max(lives) < 2 and len({*epochs}) < 2):
                        continue
            verdicts.leaks.append(Leak(finding, kept, max(lives), alive))
        elif not all(variable(finding.paths[i]) for i in kept):
            verdicts.bounded.append(Leak(finding, kept, max(lives), alive))
    return verdicts


def _grows(finding: Finding) -> bool:
    """Whether the holder keeps one record per step: a sequence, or a dict keyed by step (``[*]``)."""
    return "[*]" in finding.key or "*'" in finding.key


def capped(finding: Finding) -> bool:
    """Whether the holder is bounded by construction: a ``deque`` with a ``maxlen`` of at most :data:`CAPPED`
    on the way to its tensors (it keeps the last few records, never more, on either clock; a longer one
    grows for as many boundaries as its ``maxlen``, and is judged as any store)."""
    for path in finding.paths:
        for edge in path:
            owner = edge.owner
            if type(owner) is collections.deque and owner.maxlen is not None and owner.maxlen <= CAPPED:
                return True
    return False


def store(finding: Finding) -> bool:
    """Whether the holder can keep one record per boundary and grow: a sequence or a dict keyed by step
    (``[*]``), not bounded by construction."""
    return _grows(finding) and not capped(finding)
