"""The watch's leak criterion: a graph is a leak when one of its autograd nodes was already alive at
the previous audited boundary of the same source (an optimizer, in one thread); a graph held only by
a frame's variable gets one boundary of grace (see :mod:`gradguard._watch`).

torch's autograd nodes take no weak reference and their Python objects come and go, so a node is
recognised by its ``metadata`` dict, which lives exactly as long as the node: holding the dict
cannot be confused with another node, and keeps no tensor alive.
"""

from __future__ import annotations

import collections
import sys
import threading
import types
from typing import Any

from ._audit import Finding
from ._paths import Path

__all__ = ["Leak", "Source", "judge"]

_NO_SEQUENCE = 2**64 - 1  # AccumulateGrad and a few others: never recorded, never looked up


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


def _born(root: Any, marks: _Marks, clean: set[Any]) -> int | None:
    """When the oldest recorded node nearest to ``root`` was first seen, or ``None``: a new graph.

    Breadth first, so the nearest recorded node answers. ``clean`` holds nodes whose whole graph
    below was walked at this boundary and holds no recorded node: they are not walked again.
    """
    if not marks:
        return None
    seen: set[Any] = set()
    queue = collections.deque([root])
    while queue:
        node = queue.popleft()
        if node in seen or node in clean:
            continue
        seen.add(node)
        candidates = marks.get(_key(node))  # type: ignore[arg-type]
        if candidates:
            metadata = _metadata(node)
            for mark in candidates:
                if mark.metadata is metadata:
                    return mark.born
        queue.extend(child for child, _ in node.next_functions if child is not None)
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


_LOCAL_GRACE = 1  # boundaries a frame's variable may keep a graph: `loss = train_step(batch)`'s previous result


def _variable(path: Path) -> bool:
    """A frame's variable, or a container in one (``loss``, ``out[0]``, ``outputs['logits']``): not
    an object's state (no attribute on the way)."""
    return bool(path) and path[0].kind == "local" and all(edge.kind == "item" for edge in path[1:])


Leak = tuple[Finding, list[int], int]  # the finding, the indices of its leaking tensors, boundaries survived


def judge(findings: list[Finding], state: Source) -> list[Leak]:
    """The leaking holders among ``findings``; records the judged graphs' roots in ``state``."""
    others = _other_threads_frames()
    now = state.boundaries
    marks: _Marks = {}
    clean: set[Any] = set()
    leaks: list[Leak] = []
    for finding in findings:
        leaking: list[int] = []
        oldest = now
        for i, (tensor, path) in enumerate(zip(finding.tensors, finding.paths)):
            if path and path[0].kind == "local" and id(path[0].owner) in others:
                continue  # another thread's frame: that thread's boundaries judge it
            node = tensor.grad_fn
            if node is None:
                continue
            born = _born(node, state.marks, clean)
            _record(marks, node, now if born is None else born)
            if born is not None and now - born > (_LOCAL_GRACE if _variable(path) else 0):
                leaking.append(i)
                oldest = min(oldest, born)
        if leaking:
            leaks.append((finding, leaking, now - oldest))
    state.marks = marks
    return leaks


class Source:
    """The boundaries of one optimizer (or of direct :meth:`Watcher.boundary` calls) in one thread:
    their count, and the nodes recorded at the last audited one."""

    __slots__ = ("boundaries", "marks")

    def __init__(self) -> None:
        self.boundaries = 0
        self.marks: _Marks = {}
