"""Where a leaking holder is, by name: read again at later boundaries without searching the heap.

A holder the watch found is often filled again by the program (a list that keeps every step's
record, while the program leaks); searching the whole heap for it at every audit costs more than
the step. A :class:`Recipe` remembers the holder's path by names only — its root (a module and
global, or a running function's local: the thread, the function's code and the local's name), then
attribute names and item keys, with ``*`` where the holder key has one (every item of a list, every
value of a dict keyed by step) — and keeps no object of the program alive. :meth:`Recipe.resolve`
walks it again from the root (a local from the innermost frame of that thread running that code),
reading every object the way the audit does (no code of the program runs), and returns the tensors it
reaches with their live paths; nothing once the function returned. A closure is not remembered.

Read with ``newer=True``, a list (or tuple, deque) under a wildcard is read from where its first
graph was at the previous such read, when it has not become shorter since: a list the program
appends a record to at every step, and whose repaired records stay, is not read whole at every
boundary. What this skips (a record put back in the middle) is found by the audits.
"""

from __future__ import annotations

import collections
import re
import sys
import types
import weakref
from typing import Any

import torch

from .._heap.holders import running_thread
from .._heap.paths import Edge, Path, holder_key, is_a, module_dict, read, sequence_items

__all__ = ["Recipe"]

_WILD: Any = object()
_DIGITS = re.compile(r"\d+")
_NAMED_STEPS = ("attr", "slot", "class", "item")


class Recipe:
    """A holder's path by names: its root (``module``, or ``frame``: a thread's ident and a weak
    reference to a function's code), then ``(kind, key)`` steps (``key`` may be a wildcard)."""

    __slots__ = ("_resume", "frame", "key", "module", "steps")

    def __init__(
        self,
        key: str,
        module: str,
        steps: tuple[tuple[str, Any], ...],
        frame: tuple[int, weakref.ref[types.CodeType]] | None = None,
    ) -> None:
        self.key, self.module, self.steps, self.frame = key, module, steps, frame
        # id(sequence) -> its length and where its first graph was, at the last newer read
        self._resume: dict[int, tuple[int, int]] = {}

    @property
    def local(self) -> bool:
        """Whether the path starts at a running function's local."""
        return self.frame is not None

    @classmethod
    def of(cls, path: Path) -> Recipe | None:
        """The recipe of ``path`` (root first, ending at a tensor), or ``None`` when it cannot be
        walked again by names (a closure, a suspended generator's local, a reference Python cannot name)."""
        if not path:
            return None
        frame: tuple[int, weakref.ref[types.CodeType]] | None = None
        root = path[0]
        if root.kind == "global":
            module = module_dict(root.owner).get("__name__")
            if not isinstance(module, str) or sys.modules.get(module) is not root.owner:
                return None
        elif root.kind == "local":
            thread = running_thread(root.owner)
            if thread is None:
                return None
            module, frame = "", (thread, weakref.ref(root.owner.f_code))
        else:
            return None
        steps: list[tuple[str, Any]] = [(root.kind, root.key)]
        for edge in path[1:]:
            if edge.kind not in _NAMED_STEPS:
                return None
            steps.append((edge.kind, _WILD if _wild(edge) else edge.key))
        return cls(holder_key(path), module, tuple(steps), frame)

    def resolve(self, newer: bool = False) -> list[tuple[torch.Tensor, Path]]:
        """Every graph tensor the recipe reaches now, with its live path whose holder key is the
        recipe's; nothing when a step is gone (or the function returned). ``newer``: sequences are read
        from where their first graph was at the previous ``newer`` read (see the module documentation)."""
        root = self._root()
        if root is None:
            return []
        found: list[tuple[torch.Tensor, Path]] = []
        resume: dict[int, tuple[int, int]] | None = {} if newer else None
        self._walk(root, 0, [], found, resume)
        del root
        if resume is not None:
            self._resume = resume
        return [(t, p) for t, p in found if holder_key(p) == self.key]

    def _root(self) -> Any:
        """The module, or the innermost frame of the recipe's thread running its code; ``None`` when gone."""
        if self.frame is None:
            module = sys.modules.get(self.module)
            return module if is_a(module, types.ModuleType) else None
        thread, code_ref = self.frame
        code = code_ref()
        frame = sys._current_frames().get(thread)
        while frame is not None and frame.f_code is not code:
            frame = frame.f_back
        return frame

    def _walk(
        self,
        owner: Any,
        i: int,
        edges: list[Edge],
        found: list[tuple[torch.Tensor, Path]],
        resume: dict[int, tuple[int, int]] | None,
    ) -> None:
        if i == len(self.steps):
            if is_a(owner, torch.Tensor) and owner.grad_fn is not None:
                found.append((owner, tuple(edges)))
            return
        kind, key = self.steps[i]
        start = 0
        incremental = resume is not None and key is _WILD and not is_a(owner, dict)
        if incremental:
            length, first = self._resume.get(id(owner), (0, 0))
            start = first if _length(owner) >= length else 0
        first_graph: int | None = None
        for edge in _edges(owner, kind, key, start):
            try:
                child = read(edge)
            except (LookupError, AttributeError, IndexError, TypeError, ValueError):
                continue
            edges.append(edge)
            before = len(found)
            self._walk(child, i + 1, edges, found, resume)
            edges.pop()
            if first_graph is None and len(found) > before:
                first_graph = edge.key
        if incremental and resume is not None:
            length = _length(owner)
            resume[id(owner)] = (length, length if first_graph is None else first_graph)


def _wild(edge: Edge) -> bool:
    """Whether the holder key spells this item's key as a wildcard (``[*]``, or ``['step*']``)."""
    if edge.kind != "item":
        return False
    if type(edge.key) is int:
        return True
    return type(edge.key) is str and _DIGITS.search(edge.key) is not None


def _edges(owner: Any, kind: str, key: Any, start: int = 0) -> list[Edge]:
    """The edges from ``owner`` that one step of a recipe stands for (a sequence's from item ``start``)."""
    if key is not _WILD:
        return [Edge(owner, kind, key)]
    if is_a(owner, dict):
        return [Edge(owner, "item", k) for k in list(dict.keys(owner))]
    if start:
        return [Edge(owner, "item", i) for i in range(start, _length(owner))]
    try:
        return [Edge(owner, "item", i) for i, _ in sequence_items(owner)]
    except TypeError:  # no longer a sequence: the holder changed
        return []


def _length(owner: Any) -> int:
    """A list's, tuple's or deque's length at C level (a subclass's ``__len__`` never runs); 0 otherwise."""
    for base in (list, tuple, collections.deque):
        if is_a(owner, base):
            return base.__len__(owner)
    return 0
