"""Who holds a tensor: a reverse reference search from the graph tensors to the roots that keep them alive.

The search climbs level by level from all its targets together (one heap pass per level for the
whole frontier, never one per tensor) until a named root or a module global holds every target; a
holder deeper than :data:`_REVERSE_LEVELS` is found by one sweep down from the roots instead. A
thread's frame local is the weakest root: it names a target only where no heap root reaches it.
Which roots, the order of preference, and what is never part of a path: ``docs/how-it-works.md``
(*The audit*).

A path is a tuple of :class:`~gradguard._heap.paths.Edge`, root first. Its owners are live objects:
a path is meant to be used (read, repaired, spelled) while the scan that found it runs, then
dropped; nothing here keeps any of them after the caller lets go.
"""

from __future__ import annotations

import collections
import gc
import os
import sys
import threading
import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .._compat import referrers, untraversable
from .census import live_tensors
from .describe import describe
from .frames import frame_locals
from .installed import library_of_module
from .paths import Path, is_a, leaf_grad, module_dict
from .roots import NamedRoot, live_roots

__all__ = ["find_paths", "other_threads_locals", "own_code", "running_thread", "thread_frames"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(sys.modules[__name__.partition(".")[0]].__file__ or "")) + os.sep
_REVERSE_LEVELS = 32  # past this many levels up, one forward sweep from the roots finds the rest (see _Search.run)
_SWEEP_FROM = 256  # frontiers this large are looked up with a sweep (see _Search.referrers)
_SWEEP_CHUNK = 1024
_FRAMES_TRAVERSE_LOCALS = sys.version_info < (3, 11)  # before 3.11 a running frame is a referrer of its locals

_SEQUENCES = (list, collections.deque)
_CO_OPTIMIZED = 0x0001  # inspect.CO_OPTIMIZED: a function's frame (a module or class body's is not)
_GENERATORS = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)
_HEAP_ROOTS = ("named", "global")  # roots that hold a target for good, by preference (named: gradguard._heap.roots)


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


def other_threads_locals() -> set[int]:
    """ids of what the function frames on the other threads' stacks hold in their locals, and of the items
    of the lists, tuples and dicts among them: what a thread in the middle of its step holds for now
    (module and class bodies aside: their locals are a namespace that outlives any step)."""
    ids: set[int] = set()
    for frame in thread_frames(others=True):
        if frame.f_code.co_flags & _CO_OPTIMIZED:
            for _, value in frame_locals(frame) or ():
                ids.add(id(value))
                if type(value) in (list, tuple):
                    ids.update(map(id, value))
                elif type(value) is dict:
                    ids.update(map(id, list(value.values())))
    return ids


def thread_frames(*, others: bool = False) -> list[types.FrameType]:
    """Every frame of every thread (``others``: of every thread but the calling one), innermost first,
    gradguard's own excluded.

    Nothing here outlives the call: the stack tops include this function's own frame, and a local
    left pointing at it would be a cycle (the frame holds the local), keeping the frames and what
    they hold alive until the cycle collector runs; 3.12 keeps such a frame where 3.11 freed it.
    """
    found: list[types.FrameType] = []
    current = sys._current_frames()
    if others:
        del current[threading.get_ident()]
    tops = list(current.values())
    current.clear()
    frame: types.FrameType | None = None
    for frame in tops:
        while frame is not None:
            if not own_code(frame.f_code):
                found.append(frame)
            frame = frame.f_back
    tops.clear()
    frame = None
    return found


# --------------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------------


class _Search:
    """One reverse search from ``targets`` up to the roots that keep them alive.

    Every container the search makes is registered by :meth:`own_container` until it ends: they are
    referrers of what they hold, so their ids (``own_ids``) are never climbed, and they are kept
    alive (``kept_alive``) so that no id is reused. A target is a bit of a bitmask (target ``i`` is
    ``1 << i``): ``leads_to`` says which targets each object met leads to.
    """

    def __init__(self, targets: Sequence[torch.Tensor], excluded: set[int]) -> None:
        self.kept_alive: list[Any] = []  # every object met, alive while the search runs
        self.own_ids: set[int] = {id(self), id(self.kept_alive), id(self.__dict__)}
        self.excluded = excluded
        self.objects: dict[int, Any] = {}  # id -> object, for every object met
        self.children: dict[int, list[int]] = {}  # id -> ids of the objects it holds (found below it)
        self.parents: dict[int, list[int]] = {}  # id -> ids of the objects that hold it (found above it)
        self.leads_to: dict[int, int] = {}  # id -> bitmask of the targets it leads to
        self.root_kind: dict[int, str] = {}  # id -> "global" (a module's globals), "local" (a frame local), "named"
        self.named_by_id: dict[int, NamedRoot] = {}  # id -> its root, for objects gradguard._heap.roots names
        self.local_names: dict[int, list[tuple[int, str]]] = {}  # id(value) -> [(frame index, name)]
        self.local_value: dict[int, Any] = {}  # id(value) -> value, for every frame local the collector tracks
        self.frames: list[types.FrameType] = []
        self.module_of_dict: dict[int, types.ModuleType] = {}  # id(module.__dict__) -> module
        self.heap_held = 0  # bitmask of the targets a named root or a module global (not only a frame local) reaches
        self.swept_chains: dict[int, list[Any]] = {}  # target index -> chain, from the downward sweep
        self.live_named: list[tuple[Any, NamedRoot]] = []  # the named roots of this search, held while it runs
        self.climbed: set[int] = set()  # ids of the objects whose referrers were asked for
        for name in (
            "climbed",
            "objects",
            "children",
            "parents",
            "leads_to",
            "root_kind",
            "local_names",
            "frames",
            "module_of_dict",
            "swept_chains",
            "local_value",
            "named_by_id",
        ):
            self.own_ids.add(id(getattr(self, name)))
        self.targets = list(targets)
        self.own_container(self.targets)

    def close(self) -> None:
        """Let go of everything: the search's containers refer to each other (a referrer list holds
        the list that holds it), so without this they would wait for the cycle collector."""
        for container in self.kept_alive:
            if isinstance(container, (list, dict, set)) and id(container) in self.own_ids:
                container.clear()
        self.kept_alive.clear()
        tables = (self.objects, self.local_names, self.local_value, self.frames, self.module_of_dict, self.targets)
        for table in (*tables, self.root_kind, self.swept_chains, self.named_by_id, self.climbed):
            table.clear()

    def own_container(self, container: Any) -> Any:
        """``container``, made by the search: kept alive and never climbed until the search ends."""
        self.kept_alive.append(container)
        self.own_ids.add(id(container))
        return container

    def find_roots(self) -> None:
        """The roots: module globals (gradguard's excluded), named roots, and every thread's frame locals."""
        for module in list(sys.modules.values()):
            if not is_a(module, types.ModuleType):
                continue
            namespace = module_dict(module)
            module_name = namespace.get("__name__", "")
            if isinstance(module_name, str) and (module_name == "gradguard" or module_name.startswith("gradguard.")):
                self.excluded.add(id(namespace))
            else:
                self.module_of_dict.setdefault(id(namespace), module)
        self.excluded.add(id(gc.garbage))
        self.excluded.update(untraversable())
        self.live_named = self.own_container(live_roots())  # held by the list while the search runs
        for obj, root in self.live_named:
            self.named_by_id[id(obj)] = root
            self.excluded.add(id(root))
        for frame in thread_frames():
            index = len(self.frames)
            self.frames.append(frame)
            if _FRAMES_TRAVERSE_LOCALS:
                self.excluded.add(id(frame))  # found through self.local_names instead
            if id(frame.f_globals) in self.module_of_dict and not frame.f_code.co_flags & _CO_OPTIMIZED:
                if frame.f_locals is frame.f_globals:
                    continue  # a module's top-level code: its locals are that module's globals, a root already
            for name, value in frame_locals(frame) or ():
                if gc.is_tracked(value):
                    self.kept_alive.append(value)
                    self.local_value[id(value)] = value
                    self.local_names.setdefault(id(value), []).append((index, name))
        if _FRAMES_TRAVERSE_LOCALS:  # gradguard's own frames are referrers of the search's state
            own: types.FrameType | None
            for own in list(sys._current_frames().values()):
                while own is not None:
                    if own_code(own.f_code):
                        self.excluded.add(id(own))
                    own = own.f_back

    def add_object(self, obj: Any, bits: int) -> bool:
        """Record ``obj``, met for the first time, leading to the targets ``bits``.

        Returns ``True`` when it is a root the climb stops at: a named root or a module's globals.
        """
        oid = id(obj)
        self.objects[oid] = obj
        self.leads_to[oid] = bits
        self.children[oid] = []  # ids only: these lists refer to nothing the search climbs
        self.parents[oid] = []
        if oid in self.named_by_id:
            self.root_kind[oid] = "named"
            return True
        if oid in self.module_of_dict:
            self.root_kind[oid] = "global"
            return True
        if oid in self.local_names:
            self.root_kind[oid] = "local"
        return False

    def link(self, parent: int, child: int) -> None:
        """``parent`` holds ``child`` (by id)."""
        self.children[parent].append(child)
        self.parents[child].append(parent)

    def propagate_up(self, oid: int, bits: int) -> None:
        """``oid`` leads to the targets ``bits`` too: so do all it was found under; heap roots count them as held."""
        stack = [(oid, bits)]
        while stack:
            node, added = stack.pop()
            added &= ~self.leads_to[node]
            if not added:
                continue
            self.leads_to[node] |= added
            if self.root_kind.get(node) in _HEAP_ROOTS:
                self.heap_held |= added
            stack.extend((p, added) for p in self.parents[node])

    def run(self) -> None:
        """Climb from the targets until a heap root holds every one; past :data:`_REVERSE_LEVELS`, sweep down."""
        self.find_roots()
        all_targets = 0
        for i, t in enumerate(self.targets):
            oid = id(t)
            if oid in self.objects:  # the same tensor twice
                continue
            self.kept_alive.append(t)
            self.add_object(t, 1 << i)
            all_targets |= 1 << i
        frontier = self.own_container([t for t in self.targets])
        for level in range(_REVERSE_LEVELS):
            if not frontier or self.heap_held == all_targets:
                return
            frontier = self.climb(frontier)
            if level == 0:
                frontier.extend(self.grad_owners())
        if frontier and self.heap_held != all_targets:
            self.swept_chains = self.sweep(all_targets & ~self.heap_held)

    def climb(self, frontier: list[Any]) -> list[Any]:
        """One level up: link every referrer of ``frontier``; the new objects worth climbing from."""
        frontier_ids = {id(o) for o in frontier}
        self.own_container(frontier_ids)
        self.climbed |= frontier_ids
        found = self.own_container(self.referrers(frontier, frontier_ids))
        met = self.own_container([])  # referrers to climb from next: met for the first time, or led further
        queued: set[int] = self.own_container(set())
        for r in found:
            rid = id(r)
            if rid in self.own_ids or rid in self.excluded:
                continue
            if _FRAMES_TRAVERSE_LOCALS and is_a(r, types.FrameType) and own_code(r.f_code):
                continue  # before 3.11: a frame of this search, made after find_roots()
            cls = id(type(r))  # an instance's own class: not climbed (every instance would join the frontier)
            held = [id(c) for c in gc.get_referents(r) if id(c) in frontier_ids and id(c) != cls]
            if not held:
                continue
            if rid not in self.objects:
                self.kept_alive.append(r)
                self.add_object(r, 0)
            before = self.leads_to[rid]
            for child in held:
                self.link(rid, child)
                self.propagate_up(rid, self.leads_to[child])
            # Met before and not climbed then (what it led to was held already), it leads to more targets now: a
            # list met from its newest record, which a global also holds, and reached from the older ones later.
            if rid not in self.climbed and rid not in queued and (not before or self.leads_to[rid] & ~before):
                queued.add(rid)
                met.append(r)
        unheld = ~self.heap_held
        return self.own_container(
            [r for r in met if self.root_kind.get(id(r)) not in _HEAP_ROOTS and self.leads_to[id(r)] & unheld]
        )

    def grad_owners(self) -> list[Any]:
        """The tensors whose ``.grad`` is a target no object refers to: torch holds a gradient for its
        tensor, out of the collector's sight (a ``backward(create_graph=True)`` leaves a graph there).
        One pass over the heap, only when such a target exists; the new objects worth climbing from."""
        # A frame's local is a root already: the program's current loss, held by its loop's variable alone, does
        # not cost a pass over the heap at every audit.
        orphans = {
            id(t)
            for t in self.targets
            if not self.parents[id(t)] and id(t) not in self.local_names and t.grad_fn is not None
        }
        if not orphans:
            return []
        met: list[Any] = self.own_container([])
        for obj in self.own_container(live_tensors()):
            if id(obj) in self.own_ids:
                continue
            grad = leaf_grad(obj)
            if grad is None or id(grad) not in orphans:
                continue
            oid = id(obj)
            if oid not in self.objects:
                self.kept_alive.append(obj)
                self.add_object(obj, 0)
                met.append(obj)
            self.link(oid, id(grad))
            self.propagate_up(oid, self.leads_to[id(grad)])
        return met

    def sweep(self, wanted: int) -> dict[int, list[Any]]:
        """Chains, root first, to the targets in the bitmask ``wanted``, from one breadth-first walk
        down from the roots (module globals first, then thread locals).

        Climbing costs a heap pass per level: a holder hundreds of references deep (a linked list)
        would cost hundreds. Walking down from the roots costs one pass over what they reach, whatever
        the depth.
        """
        targets = {id(t): i for i, t in enumerate(self.targets) if wanted >> i & 1}
        parent: dict[int, int | None] = {}
        objects: dict[int, Any] = self.own_container({})
        found: dict[int, list[Any]] = {}
        globals_ = [module_dict(self.module_of_dict[oid]) for oid in self.module_of_dict if oid not in self.excluded]
        named = [obj for obj, _ in self.live_named]
        # Named roots and module globals first, to the end: a thread's local names a target only where
        # nothing else reaches it.
        local = [self.local_value[oid] for oid in sorted(self.local_value, key=self._in_library)]
        for roots in (named, globals_, local):
            queue: collections.deque[Any] = self.own_container(collections.deque())
            for root in roots:
                if id(root) not in parent:
                    parent[id(root)], objects[id(root)] = None, root
                    queue.append(root)
            while queue and len(found) < len(targets):
                obj = queue.popleft()
                cls = type(obj)
                for child in gc.get_referents(obj):
                    cid = id(child)
                    if cid in parent or cid in self.own_ids or cid in self.excluded or child is cls:
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
            return referrers(frontier)
        objects = gc.get_objects()
        skipped = untraversable()
        if skipped:
            objects = [o for o in objects if id(o) not in skipped]
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
        for first in _HEAP_ROOTS:  # named roots first, then module globals
            for oid, kind in self.root_kind.items():
                if kind == first and oid not in via:
                    via[oid] = None
                    queue.append(oid)
            self._walk_down(queue, via, order)
        # Thread locals last: those of the program's own frames before those of libraries' frames (a
        # framework's loop holding the model is not where the program keeps it).
        local = [oid for oid, kind in self.root_kind.items() if kind == "local"]
        for oid in sorted(local, key=self._in_library):
            if oid not in via:
                via[oid] = None
                queue.append(oid)
                self._walk_down(queue, via, order)
        self._prefer_sequences(via, order)
        result: list[list[Any] | None] = []
        for i, t in enumerate(self.targets):
            node: int | None = id(t)
            if i in self.swept_chains and (node not in via or self.root_kind.get(self._root_of(node, via)) != "global"):
                result.append(self.swept_chains[i])
                continue
            if node not in via:
                result.append(None)
                continue
            chain = []
            while node is not None:
                chain.append(self.objects[node])
                node = via[node]
            result.append(self._through_sequence(chain[::-1], via))
        return result

    def _in_library(self, oid: int) -> bool:
        """Whether every frame whose local is ``oid`` runs a library's code."""
        for index, _ in self.local_names.get(oid, ()):
            module = self.frames[index].f_globals.get("__name__")
            if not isinstance(module, str) or library_of_module(module) is None:
                return False
        return True

    def _root_of(self, node: int, via: dict[int, int | None]) -> int:
        up = via[node]
        while up is not None:
            node, up = up, via[up]
        return node

    def _through_sequence(self, chain: list[Any], via: dict[int, int | None]) -> list[Any]:
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
            for holder in referrers([owner]):  # one level more above it
                if id(holder) in self.module_of_dict and id(holder) not in self.excluded:
                    self.kept_alive.append(owner)
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

    def _walk_down(self, queue: collections.deque[int], via: dict[int, int | None], order: list[int]) -> None:
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
