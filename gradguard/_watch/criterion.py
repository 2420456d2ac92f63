"""The watch's leak criterion: which of the graphs alive at a step boundary are leaks.

Age
    A graph is old at a boundary of a *source* (one optimizer, in one thread) when one of its autograd
    nodes was already alive at that source's previous audited boundary. torch's autograd nodes take
    no weak reference and their Python objects come and go, so a node is recognised by its
    ``metadata`` dict, which lives exactly as long as the node: holding the dict cannot be confused
    with another node, and keeps no tensor alive.

Grace
    A graph held only by a *variable* — a frame's local, or a module-level variable of the program
    being run (``__main__``: a script, ``python -c``, ``-m``, a notebook), directly or through items
    (``loss``, ``out[0]``, ``HISTORY[3]['loss']``) — is a leak only once it has survived two
    boundaries: ``loss = train_step(batch)`` keeps the previous step's loss while the next step runs.
    Object state (an attribute on the way) gets none.

Whose boundaries
    A graph is judged only at boundaries of optimizers that update a parameter it reaches: a WGAN
    critic's steps, or an inner loop's auxiliary optimizer, do not age the generator's or the
    encoder's forward (nor the outer loop's previous ``loss``, still a variable while the inner
    steps run). A graph that reaches no parameter of any live optimizer is judged at every boundary,
    and so is every graph at a boundary of no optimizer (a direct :meth:`Watcher.boundary` call).
    (The live optimizers are those that stepped under the watch and those its audits found in the
    heap, looked for at the first audit and then every ``OPTIMIZER_RESCAN`` seconds.)

Threads
    A graph that only another thread's frames hold is judged by that thread's boundaries (it may be
    mid-forward).
"""

from __future__ import annotations

import collections
import sys
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from .._graph.liveness import Liveness
from .._heap.paths import Path
from .audit import Finding

__all__ = ["Age", "Leak", "Source", "judge", "variable"]

_NO_SEQUENCE = 2**64 - 1  # AccumulateGrad and a few others: never recorded, never looked up
_GRACE = 1  # boundaries a variable may keep a graph: `loss = train_step(batch)`'s previous result


class _Mark:
    """A node seen at an audited boundary: its ``metadata`` dict (held: the dict's identity is the
    node's while it lives), and the boundary at which its graph was first seen."""

    __slots__ = ("metadata", "born")

    def __init__(self, metadata: dict[Any, Any], born: int) -> None:
        self.metadata, self.born = metadata, born


_Marks = dict[tuple[int, type], list[_Mark]]


def _key(node: Any) -> tuple[int, type] | None:
    try:
        sequence = node._sequence_nr()
    except (AttributeError, RuntimeError, TypeError):
        return None
    return None if sequence == _NO_SEQUENCE else (sequence, type(node))


def _metadata(node: Any) -> dict[Any, Any] | None:
    try:
        metadata = node.metadata
    except (AttributeError, RuntimeError):
        return None
    return metadata if type(metadata) is dict else None


class Source:
    """The boundaries of one optimizer (or of direct :meth:`Watcher.boundary` calls) in one thread:
    their count, and the nodes recorded at the last audited one."""

    __slots__ = ("boundaries", "marks", "previous")

    def __init__(self) -> None:
        self.boundaries = 0
        self.marks: _Marks = {}
        self.previous: _Marks = {}  # the marks the last age() compared with

    def age(self, tensors: Iterable[torch.Tensor]) -> dict[int, Age]:
        """For each tensor (by id) whose graph was alive at this source's last audited boundary, its
        :class:`Age`; and record every graph seen now."""
        born_at: dict[int, Age] = {}
        marks: _Marks = {}
        clean: set[Any] = set()
        now = self.boundaries
        for tensor in tensors:
            node = tensor.grad_fn
            if node is None:
                continue
            found = _born(node, self.marks, clean)
            _record(marks, node, now if found is None else found.born)
            if found is not None:
                born_at[id(tensor)] = found
        self.previous, self.marks = self.marks, marks
        return born_at

    def own_age(self, root: Any, others: set[Any]) -> Age | None:
        """The age of the graph from ``root`` without going into ``others`` (other held tensors' old
        nodes), against the marks of the last audited boundary before the current one."""
        return _born(root, self.previous, set(), stop=others)


class Age(NamedTuple):
    """When a graph was first seen, and whether its own root was (else: an older node inside it)."""

    born: int
    own: bool


def _born(root: Any, marks: _Marks, clean: set[Any], stop: set[Any] | None = None) -> Age | None:
    """When the oldest recorded node nearest to ``root`` was first seen, or ``None``: a new graph.

    Breadth first, so the nearest recorded node answers. ``clean`` holds nodes whose whole graph
    below was walked at this boundary and holds no recorded node: they are not walked again. The
    walk does not go into the nodes in ``stop``.
    """
    if not marks:
        return None
    seen: set[Any] = set()
    queue = collections.deque([root])
    while queue:
        node = queue.popleft()
        if node in seen or node in clean or (stop and node in stop):
            continue
        seen.add(node)
        candidates = marks.get(_key(node))  # type: ignore[arg-type]
        if candidates:
            metadata = _metadata(node)
            for mark in candidates:
                if mark.metadata is metadata:
                    return Age(mark.born, node is root)
        queue.extend(child for child, _ in node.next_functions if child is not None)
    if not stop:
        clean.update(seen)
    return None


def _record(marks: _Marks, node: Any, born: int) -> None:
    key = _key(node)
    if key is None:
        return
    metadata = _metadata(node)
    if metadata is None or "parent_" in metadata:  # anomaly mode's parent node: holding it would pin it
        return
    entries = marks.setdefault(key, [])
    for mark in entries:
        if mark.metadata is metadata:
            mark.born = min(mark.born, born)
            return
    entries.append(_Mark(metadata, born))


def _other_threads_frames() -> set[int]:
    """ids of the frames on every other thread's stack now."""
    tops = sys._current_frames()
    del tops[threading.get_ident()]  # this frame, which would then hold itself (and its callers) in a cycle
    ids: set[int] = set()
    for top in tops.values():
        frame: types.FrameType | None = top
        while frame is not None:
            ids.add(id(frame))
            frame = frame.f_back
    tops.clear()
    return ids


def variable(path: Path) -> bool:
    """A variable of a frame or of the program's ``__main__``, or a container in one (``loss``,
    ``out[0]``, ``HISTORY[3]['loss']``): not an object's state (no attribute on the way)."""
    if not path or not all(edge.kind == "item" for edge in path[1:]):
        return False
    root = path[0]
    return root.kind == "local" or (root.kind == "global" and root.owner is sys.modules.get("__main__"))


class Leak(NamedTuple):
    """A leaking holder: the finding, the indices of its leaking tensors, the boundaries the oldest
    survived, and for each leaking tensor whether its graph can still be backwarded."""

    finding: Finding
    leaking: list[int]
    survived: int
    alive: list[bool]


def judge(
    findings: list[Finding],
    born_at: dict[int, Age],
    source: Source,
    liveness: Liveness,
    params: Callable[[], tuple[frozenset[int], frozenset[int]]] | None,
) -> list[Leak]:
    """The leaking holders among ``findings`` at the current boundary of ``source``, whose graphs
    were first seen as ``born_at`` says (by tensor id, from :meth:`Source.age`). ``params`` gives the
    ids of the parameters the source's optimizer updates and of those every live optimizer updates
    (``None``: a boundary of no optimizer, which judges every graph).

    A new tensor whose graph is old only through another old tensor the program holds (``loss =
    out + self.ema``, where ``self.ema`` keeps last step's graph) is that tensor's leak, not its
    own. One that also holds old nodes nobody else holds (``total = total + loss`` while a list
    keeps each loss) is its own.
    """
    others = _other_threads_frames()
    now = source.boundaries
    held_old = {t.grad_fn for f in findings for t in f.tensors if id(t) in born_at}
    updated: tuple[frozenset[int], frozenset[int]] | None = None
    leaks: list[Leak] = []
    for finding in findings:
        leaking: list[int] = []
        alive: list[bool] = []
        oldest = now
        for i, (tensor, path) in enumerate(zip(finding.tensors, finding.paths)):
            age = born_at.get(id(tensor))
            if age is None or (path and path[0].kind == "local" and id(path[0].owner) in others):
                continue  # a new graph; or another thread's frame: that thread's boundaries judge it
            if not age.own:
                root = tensor.grad_fn
                age = source.own_age(root, held_old - {root})  # type: ignore[assignment]
                if age is None:
                    continue  # old only through another holder's tensor: that holder's leak
            if now - age.born <= (_GRACE if variable(path) else 0):
                continue
            state = liveness.state(tensor.grad_fn)
            if params is not None:
                if updated is None:
                    updated = params()
                own, known = updated
                if own.isdisjoint(state.leaves) and not known.isdisjoint(state.leaves):
                    continue  # this optimizer does not train through it; another one does
            leaking.append(i)
            alive.append(state.alive)
            oldest = min(oldest, age.born)
        if leaking:
            leaks.append(Leak(finding, leaking, now - oldest, alive))
    return leaks
