"""Who holds a tensor: a reverse reference search from the graph tensors to the roots that keep them alive.

The search goes up level by level from all its targets together: one heap pass per level for the
whole frontier (``gc.get_referrers``, or a referent sweep for a large frontier), never one per
tensor, until every target reached a module global or nothing is left to climb. Roots are what is
alive by definition:

* module globals: a module's ``__dict__`` in ``sys.modules`` (``mypkg.train:HISTORY``; a class
  attribute is a global's attribute, ``mypkg.train:Trainer.cache``);
* the frame locals of every thread (``train.py:42 in train_step: metrics['loss_sum']``).

A path that goes through a suspended generator or coroutine, or through a function's closure, is
named from there, the way one reads it: ``train.py:42 in train_steps: loss_sum`` (the generator's
frame), ``closure of mypkg.train:make.<locals>.add: total``. Such an object counts only when a root
reaches it: a generator, a closure or a class that is garbage names nothing.

A thread's frame local is the weakest root: an object held by one keeps being climbed, so that a
tensor that is both the current step's ``loss`` and an item of a global list is named by the list.
Objects that no root reaches (garbage cycles, tensors only C++ code holds) get no path. Frames of
gradguard's own code, gradguard's module globals, ``gc.garbage`` and the search's own containers
are never part of a path. An instance's reference to its class is not climbed (every instance of
a class would join the frontier): a class only its instances keep alive names nothing.

A path is a tuple of :class:`Edge`, root first. Its owners are live objects: a path is meant to be
used (read, repaired, spelled) while the scan that found it runs, then dropped; nothing here keeps
any of them after the caller lets go.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from .describe import describe
from .frames import frame_locals
from .installed import library_of_module
from .paths import Path, is_a, module_dict
from .roots import NamedRoot, live_roots

__all__ = ["find_paths", "own_code", "running_thread"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(sys.modules[__name__.partition(".")[0]].__file__ or "")) + os.sep
_REVERSE_LEVELS = 32  # past this many levels up, one forward sweep from the roots finds the rest (see _Search.run)
_SWEEP_FROM = 256  # frontiers this large are looked up with a sweep (see _Search.referrers)
_SWEEP_CHUNK = 1024
_FRAMES_TRAVERSE_LOCALS = sys.version_info < (3, 11)  # before 3.11 a running frame is a referrer of its locals

_SEQUENCES = (list, collections.deque)
_CO_OPTIMIZED = 0x0001  # inspect.CO_OPTIMIZED: a function's frame (a module or class body's is not)
_GENERATORS = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)
_HEAP_ROOTS = ("named", "global")  # roots that hold a target for good, by preference; gradguard._heap.roots (issue 18)


# --------------------------------------------------------------------------------------------------
# Frames
# --------------------------------------------------------------------------------------------------


def own_code(code: types.CodeType) -> bool:
    """Code of gradguard itself: its frames are never scanned."""
    return code.co_filename.startswith(_PACKAGE_DIR)


def running_thread(frame: Any) -> int | None:
    """The ident of the thread whose stack runs ``frame`` now; ``None`` for any other frame (a suspended
    generator's, a finished one) and for anything that is not a frame."""
    if not is_a(frame, types.FrameType):
        return None
    stacks = list(sys._current_frames().items())
    current: types.FrameType | None = None
    try:
        for ident, top in stacks:
            current = top
            while current is not None:
                if current is frame:
                    return ident
                current = current.f_back
        return None
    finally:
        stacks = top = current = None  # type: ignore[assignment]  # this frame is on a stack: no cycle with it


def _thread_frames() -> Iterator[types.FrameType]:
    """Every frame of every thread, innermost first, gradguard's own excluded."""
    for top in list(sys._current_frames().values()):
        frame: types.FrameType | None = top
        while frame is not None:
            if not own_code(frame.f_code):
                yield frame
            frame = frame.f_back


# --------------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------------


class _Search:
    """One reverse search. Every container it makes is kept in ``self.mine`` until it ends: they are
    referrers of what they hold, so their ids are excluded, and kept alive so that no id is reused."""

    def __init__(self, targets: Sequence[torch.Tensor], excluded: set[int]) -> None:
        self.keep: list[Any] = []  # every object met, alive while the search runs
        self.mine: set[int] = {id(self), id(self.keep), id(self.__dict__)}
        self.excluded = excluded
        self.objects: dict[int, Any] = {}  # id -> object, for every object met
        self.children: dict[int, list[int]] = {}  # id -> ids of the objects it holds (found below it)
        self.parents: dict[int, list[int]] = {}
        self.below: dict[int, int] = {}  # id -> bitmask of the targets it leads to
        self.roots: dict[int, str] = {}  # id -> "global" (a module's globals) or "local" (a thread's frame local)
        self.named: dict[int, NamedRoot] = {}  # gradguard._heap.roots: id -> its root, a "named" root (issue 18)
        self.locals: dict[int, list[tuple[int, str]]] = {}  # id(value) -> [(frame index, name)]
        self.local_values: dict[int, Any] = {}
        self.frames: list[types.FrameType] = []
        self.modules: dict[int, types.ModuleType] = {}  # id(module.__dict__) -> module
        self.held = 0  # targets a module global (not only a thread's frame local) reaches
        self.deep: dict[int, list[Any]] = {}  # target index -> chain, from the downward sweep
        self.named_roots: list[tuple[Any, NamedRoot]] = []
        for name in (
            "objects",
            "children",
            "parents",
            "below",
            "roots",
            "locals",
            "frames",
            "modules",
            "deep",
            "local_values",
            "named",
        ):
            self.mine.add(id(getattr(self, name)))
        self.targets = list(targets)
        self.own(self.targets)

    def close(self) -> None:
        """Let go of everything: the search's containers refer to each other (a referrer list holds
        the list that holds it), so without this they would wait for the cycle collector."""
        for container in self.keep:
            if isinstance(container, (list, dict, set)) and id(container) in self.mine:
                container.clear()
        self.keep.clear()
        tables = (self.objects, self.locals, self.local_values, self.frames, self.modules, self.targets, self.roots)
        for table in (*tables, self.deep, self.named):
            table.clear()

    def own(self, container: Any) -> Any:
        self.keep.append(container)
        self.mine.add(id(container))
        return container

    def setup(self) -> None:
        for module in list(sys.modules.values()):
            if not is_a(module, types.ModuleType):
                continue
            namespace = module_dict(module)
            module_name = namespace.get("__name__", "")
            if isinstance(module_name, str) and (module_name == "gradguard" or module_name.startswith("gradguard.")):
                self.excluded.add(id(namespace))
            else:
                self.modules.setdefault(id(namespace), module)
        self.excluded.add(id(gc.garbage))
        self.named_roots = self.own(live_roots())  # gradguard._heap.roots (issue 18): held by the list while we run
        for obj, root in self.named_roots:
            self.named[id(obj)] = root
            self.excluded.add(id(root))
        for frame in _thread_frames():
            index = len(self.frames)
            self.frames.append(frame)
            if _FRAMES_TRAVERSE_LOCALS:
                self.excluded.add(id(frame))  # found through self.locals instead
            if id(frame.f_globals) in self.modules and not frame.f_code.co_flags & _CO_OPTIMIZED:
                if frame.f_locals is frame.f_globals:
                    continue  # a module's top-level code: its locals are that module's globals, a root already
            for name, value in frame_locals(frame) or ():
                if gc.is_tracked(value):
                    self.keep.append(value)
                    self.local_values[id(value)] = value
                    self.locals.setdefault(id(value), []).append((index, name))
        if _FRAMES_TRAVERSE_LOCALS:  # gradguard's own frames are referrers of the search's state
            own: types.FrameType | None
            for own in list(sys._current_frames().values()):
                while own is not None:
                    if own_code(own.f_code):
                        self.excluded.add(id(own))
                    own = own.f_back

    def meet(self, obj: Any, bits: int) -> bool:
        """Record ``obj`` (new); ``True`` when it is a module's globals (a root not climbed further)."""
        oid = id(obj)
        self.objects[oid] = obj
        self.below[oid] = bits
        self.children[oid] = []  # ids only: these lists refer to nothing the search climbs
        self.parents[oid] = []
        if oid in self.named:  # gradguard._heap.roots (issue 18): a root, not climbed further
            self.roots[oid] = "named"
            return True
        if oid in self.modules:
            self.roots[oid] = "global"
            return True
        if oid in self.locals:
            self.roots[oid] = "local"
        return False

    def link(self, parent: int, child: int) -> None:
        self.children[parent].append(child)
        self.parents[child].append(parent)

    def spread(self, oid: int, bits: int) -> None:
        """``oid`` leads to ``bits`` too: so do all it was found under; roots count them as held."""
        stack = [(oid, bits)]
        while stack:
            node, new = stack.pop()
            new &= ~self.below[node]
            if not new:
                continue
            self.below[node] |= new
            if self.roots.get(node) in _HEAP_ROOTS:
                self.held |= new
            stack.extend((p, new) for p in self.parents[node])

    def run(self) -> None:
        self.setup()
        everything = 0
        for i, t in enumerate(self.targets):
            oid = id(t)
            if oid in self.objects:  # the same tensor twice
                continue
            self.keep.append(t)
            self.meet(t, 1 << i)
            everything |= 1 << i
        frontier = self.own([t for t in self.targets])
        for _ in range(_REVERSE_LEVELS):
            if not frontier or self.held == everything:
                return
            frontier = self.climb(frontier)
        if frontier and self.held != everything:
            self.deep = self.sweep(everything & ~self.held)

    def climb(self, frontier: list[Any]) -> list[Any]:
        """One level up: link every referrer of ``frontier``; the new objects worth climbing from."""
        frontier_ids = {id(o) for o in frontier}
        self.own(frontier_ids)
        found = self.own(self.referrers(frontier, frontier_ids))
        new = self.own([])
        for r in found:
            rid = id(r)
            if rid in self.mine or rid in self.excluded:
                continue
            if _FRAMES_TRAVERSE_LOCALS and is_a(r, types.FrameType) and own_code(r.f_code):
                continue  # before 3.11: a frame of this search, made after setup()
            cls = id(type(r))  # an instance's own class: not climbed (see the module docstring)
            kids = [id(c) for c in gc.get_referents(r) if id(c) in frontier_ids and id(c) != cls]
            if not kids:
                continue
            if rid not in self.objects:
                self.keep.append(r)
                self.meet(r, 0)
                new.append(r)
            for kid in kids:
                self.link(rid, kid)
                self.spread(rid, self.below[kid])
        return self.own([r for r in new if self.roots.get(id(r)) not in _HEAP_ROOTS and self.below[id(r)] & ~self.held])

    def sweep(self, wanted: int) -> dict[int, list[Any]]:
        """Chains, root first, to the targets in the bitmask ``wanted``, from one breadth-first walk
        down from the roots (module globals first, then thread locals).

        Climbing costs a heap pass per level: a holder hundreds of references deep (a linked list)
        would cost hundreds. Walking down from the roots costs one pass over what they reach, whatever
        the depth.
        """
        targets = {id(t): i for i, t in enumerate(self.targets) if wanted >> i & 1}
        parent: dict[int, int | None] = {}
        objects: dict[int, Any] = self.own({})
        found: dict[int, list[Any]] = {}
        globals_ = [module_dict(self.modules[oid]) for oid in self.modules if oid not in self.excluded]
        named = [obj for obj, _ in self.named_roots]  # gradguard._heap.roots (issue 18)
        # Named roots and module globals first, to the end: a thread's local names a target only where
        # nothing else reaches it.
        local = [self.local_values[oid] for oid in sorted(self.local_values, key=self._in_library)]
        for roots in (named, globals_, local):
            queue: collections.deque[Any] = self.own(collections.deque())
            for root in roots:
                if id(root) not in parent:
                    parent[id(root)], objects[id(root)] = None, root
                    queue.append(root)
            while queue and len(found) < len(targets):
                obj = queue.popleft()
                cls = type(obj)
                for child in gc.get_referents(obj):
                    cid = id(child)
                    if cid in parent or cid in self.mine or cid in self.excluded or child is cls:
                        continue
                    if cid in targets:
                        found[cid] = []
                    elif not gc.is_tracked(child):
                        continue
                    parent[cid], objects[cid] = id(obj), child
                    queue.append(child)
            queue.clear()
        chains: dict[int, list[Any]] = {}
        for cid in found:
            chain: list[Any] = []
            node: int | None = cid
            while node is not None:
                chain.append(objects[node])
                node = parent[node]
            chains[targets[cid]] = chain[::-1]
        objects.clear()
        queue.clear()
        return chains

    def referrers(self, frontier: list[Any], frontier_ids: set[int]) -> list[Any]:
        """The objects that refer to any of ``frontier``: one pass over the heap for all of them.

        ``gc.get_referrers`` compares each reference in the heap with every object of the frontier,
        so its cost grows with the frontier; past :data:`_SWEEP_FROM` objects a sweep that looks each
        reference up in a set, at a cost that does not, is faster.
        """
        if len(frontier) < _SWEEP_FROM:
            return gc.get_referrers(*frontier)
        objects = gc.get_objects()
        found: list[Any] = []
        referents, disjoint = gc.get_referents, frontier_ids.isdisjoint
        for start in range(0, len(objects), _SWEEP_CHUNK):
            chunk = objects[start : start + _SWEEP_CHUNK]
            if not disjoint(map(id, referents(*chunk))):
                found.extend(o for o in chunk if not disjoint(map(id, referents(o))))
        return found

    def chains(self) -> list[list[Any] | None]:
        """For each target, the objects from a root down to it: the nearest module global wins; a
        thread's frame local only where no global reaches."""
        via: dict[int, int | None] = {}
        order: list[int] = []  # breadth-first: parents before children
        queue: collections.deque[int] = collections.deque()
        for first in _HEAP_ROOTS:  # gradguard._heap.roots (issue 18): named roots first, then module globals
            for oid, kind in self.roots.items():
                if kind == first and oid not in via:
                    via[oid] = None
                    queue.append(oid)
            self._walk(queue, via, order)
        # Thread locals last: those of the program's own frames before those of libraries' frames (a
        # framework's loop holding the model is not where the program keeps it).
        local = [oid for oid, kind in self.roots.items() if kind == "local"]
        for oid in sorted(local, key=self._in_library):
            if oid not in via:
                via[oid] = None
                queue.append(oid)
                self._walk(queue, via, order)
        self._prefer_sequences(via, order)
        result: list[list[Any] | None] = []
        for i, t in enumerate(self.targets):
            node: int | None = id(t)
            if i in self.deep and (node not in via or self.roots.get(self._top(node, via)) != "global"):
                result.append(self.deep[i])
                continue
            if node not in via:
                result.append(None)
                continue
            chain = []
            while node is not None:
                chain.append(self.objects[node])
                node = via[node]
            result.append(self._rehome(chain[::-1], via))
        return result

    def _in_library(self, oid: int) -> bool:
        """Whether every frame whose local is ``oid`` runs a library's code."""
        for index, _ in self.locals.get(oid, ()):
            module = self.frames[index].f_globals.get("__name__")
            if not isinstance(module, str) or library_of_module(module) is None:
                return False
        return True

    def _top(self, node: int, via: dict[int, int | None]) -> int:
        up = via[node]
        while up is not None:
            node, up = up, via[up]
        return node

    def _rehome(self, chain: list[Any], via: dict[int, int | None]) -> list[Any]:
        """A chain whose root names its second object directly (``rec = {...}``, a variable) is named
        through a list or deque that also holds that object and that the climb stopped short of
        (``HISTORY.append(rec)``): the container that accumulates, not the alias of the latest record."""
        if len(chain) < 3 or is_a(chain[0], _SEQUENCES):
            return chain
        named = id(chain[1])
        for parent in self.parents.get(named, ()):
            owner = self.objects[parent]
            if parent in via or not is_a(owner, _SEQUENCES):
                continue
            for holder in gc.get_referrers(owner):  # one level more above it
                if id(holder) in self.modules and id(holder) not in self.excluded:
                    self.keep.append(owner)
                    return [holder, owner, *chain[1:]]
        return chain

    def _prefer_sequences(self, via: dict[int, int | None], order: list[int]) -> None:
        """Where an object is held both by a name (a variable, an attribute) and by a list or deque,
        name it through the list: ``self.last = rec; self.history.append(rec)`` is the history's leak.
        ``via`` stays a forest: an object is moved under a list only when the list's own chain does
        not go through it."""
        for oid in order:
            current = via.get(oid)
            if current is None or is_a(self.objects[current], _SEQUENCES):
                continue
            for parent in self.parents.get(oid, ()):
                if parent == current or parent not in via or not is_a(self.objects[parent], _SEQUENCES):
                    continue
                node: int | None = parent
                while node is not None and node != oid:
                    node = via[node]
                if node is None:
                    via[oid] = parent
                    break

    def _walk(self, queue: collections.deque[int], via: dict[int, int | None], order: list[int]) -> None:
        while queue:
            oid = queue.popleft()
            for kid in self.children[oid]:
                if kid not in via:
                    via[kid] = oid
                    order.append(kid)
                    queue.append(kid)


def find_paths(targets: Sequence[torch.Tensor], excluded: Iterable[int] = ()) -> list[Path | None]:
    """One path from a root to each of ``targets`` (``None`` where no root reaches it), in order.

    Objects whose ids are in ``excluded`` are never part of a path. The shortest path from a heap
    root wins; a thread's frame local is used only where no heap root reaches the target. Reading
    paths does not change the objects on them (an instance whose attributes live inline in the
    object, Python 3.11+, may get its ``__dict__`` materialised: its attributes stay as they are).
    """
    search = _Search(targets, set(excluded))
    try:
        search.run()
        paths: list[Path | None] = []
        for chain in search.chains():
            try:
                paths.append(None if chain is None else describe(chain, search))
            except RuntimeError:  # another thread changed a container while it was read: no path this time
                paths.append(None)
        return paths
    finally:
        search.close()


