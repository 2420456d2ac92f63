"""Who holds a tensor: the live tensors that carry ``grad_fn``, and a reverse reference search from them to roots.

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
import functools
import gc
import itertools
import os
import sys
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ._paths import MODULE_STATE, Edge, Path, frame_locals, is_a
from ._roots import NamedRoot, live_roots

__all__ = ["find_paths", "live_graph_tensors", "own_code", "running_thread"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_MAX_LEVELS = 64  # deeper holders than this are left without a path
_SWEEP_FROM = 256  # frontiers this large are looked up with a sweep (see _Search.referrers)
_SWEEP_CHUNK = 1024
_FRAMES_TRAVERSE_LOCALS = sys.version_info < (3, 11)  # before 3.11 a running frame is a referrer of its locals

_GENERATORS = (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)
_HEAP_ROOTS = ("named", "global")  # roots that hold a target for good, by preference; gradguard._roots (issue 18)


# --------------------------------------------------------------------------------------------------
# The targets
# --------------------------------------------------------------------------------------------------


def live_graph_tensors(exclude_ids: set[int]) -> list[torch.Tensor]:
    """Every live tensor (subclasses included) that carries ``grad_fn``, in one ``gc.get_objects()`` pass.

    Never an ``nn.Parameter`` (a leaf holds no graph), never one whose id is in ``exclude_ids``. A
    tensor whose ``grad_fn`` cannot be read (a fake or functorch-wrapped tensor outside its mode)
    is skipped. Objects are told apart by their exact type (against every tensor subclass defined
    now), never through ``__class__``, so a proxy that claims to be a tensor is not one.
    """
    kinds = _tensor_types()
    objects = gc.get_objects()
    tensors = list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
    del objects  # it refers to every object: no search may run while it lives
    found = []
    for t in tensors:
        if id(t) in exclude_ids:
            continue
        try:
            if t.grad_fn is None:
                continue
        except Exception:  # noqa: BLE001 - a subclass whose grad_fn raises outside its mode holds nothing we can name
            continue
        found.append(t)
    return found


def _tensor_types() -> frozenset[type]:
    """``torch.Tensor`` and every subclass of it defined now, parameters' excluded."""
    found: set[type] = {torch.Tensor}
    stack: list[type] = [torch.Tensor]
    while stack:
        subclasses: list[type] = type.__subclasses__(stack.pop())
        for sub in subclasses:
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return frozenset(c for c in found if not issubclass(c, nn.Parameter))


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
        self.named: dict[int, NamedRoot] = {}  # gradguard._roots: id -> its root, a "named" root (issue 18)
        self.locals: dict[int, list[tuple[int, str]]] = {}  # id(value) -> [(frame index, name)]
        self.frames: list[types.FrameType] = []
        self.modules: dict[int, types.ModuleType] = {}  # id(module.__dict__) -> module
        self.held = 0  # targets a module global (not only a thread's frame local) reaches
        for name in ("objects", "children", "parents", "below", "roots", "locals", "frames", "modules", "named"):
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
        for table in (self.objects, self.locals, self.frames, self.modules, self.targets, self.roots, self.named):
            table.clear()

    def own(self, container: Any) -> Any:
        self.keep.append(container)
        self.mine.add(id(container))
        return container

    def setup(self) -> None:
        for module in list(sys.modules.values()):
            if not isinstance(module, types.ModuleType):
                continue
            namespace = module.__dict__
            module_name = getattr(module, "__name__", "")
            if isinstance(module_name, str) and (module_name == "gradguard" or module_name.startswith("gradguard.")):
                self.excluded.add(id(namespace))
            else:
                self.modules.setdefault(id(namespace), module)
        self.excluded.add(id(gc.garbage))
        for obj, root in self.own(live_roots()):  # gradguard._roots (issue 18): held by the list while we run
            self.named[id(obj)] = root
            self.excluded.add(id(root))
        for frame in _thread_frames():
            index = len(self.frames)
            self.frames.append(frame)
            if _FRAMES_TRAVERSE_LOCALS:
                self.excluded.add(id(frame))  # found through self.locals instead
            for name, value in frame_locals(frame):
                if gc.is_tracked(value):
                    self.keep.append(value)
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
        if oid in self.named:  # gradguard._roots (issue 18): a root, not climbed further
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
        for _ in range(_MAX_LEVELS):
            if not frontier or self.held == everything:
                return
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
            frontier = self.own(
                [r for r in new if self.roots.get(id(r)) not in _HEAP_ROOTS and self.below[id(r)] & ~self.held]
            )

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
        queue: collections.deque[int] = collections.deque()
        for first in _HEAP_ROOTS:  # gradguard._roots (issue 18): named roots first, then module globals
            for oid, kind in self.roots.items():
                if kind == first and oid not in via:
                    via[oid] = None
                    queue.append(oid)
            self._walk(queue, via)
        for oid, kind in self.roots.items():
            if kind == "local" and oid not in via:
                via[oid] = None
                queue.append(oid)
                self._walk(queue, via)
        result: list[list[Any] | None] = []
        for t in self.targets:
            node: int | None = id(t)
            if node not in via:
                result.append(None)
                continue
            chain = []
            while node is not None:
                chain.append(self.objects[node])
                node = via[node]
            result.append(chain[::-1])
        return result

    def _walk(self, queue: collections.deque[int], via: dict[int, int | None]) -> None:
        while queue:
            oid = queue.popleft()
            for kid in self.children[oid]:
                if kid not in via:
                    via[kid] = oid
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
                paths.append(None if chain is None else _describe(chain, search))
            except RuntimeError:  # another thread changed a container while it was read: no path this time
                paths.append(None)
        return paths
    finally:
        search.close()


# --------------------------------------------------------------------------------------------------
# Describing a chain of objects as edges
# --------------------------------------------------------------------------------------------------


def _describe(chain: list[Any], search: _Search) -> Path | None:
    """The edges along ``chain`` (root first), collapsing dicts into the attributes they store and
    naming the path from the last suspended generator or closure on it; ``None`` when an object on
    it no longer holds the next one (another thread changed it meanwhile)."""
    edges: list[Edge] = []
    named = _named_from(chain)
    i = max(named, 0)
    owner = chain[i]
    if named >= 0 and is_a(owner, _GENERATORS):
        frame = _generator_frame(owner)
        if frame is None:
            return None
        if is_a(chain[i + 1], types.FrameType):  # before 3.11: generator -> its frame -> the local
            i += 1
        else:
            i += _frame_edge(frame, chain, i, edges)
            if edges[0].kind != "local":  # held on the generator's value stack, not by a named local
                edges[0] = Edge(frame, "local", "<stack>")
    elif named >= 0:  # a function -> its __closure__ -> a cell -> the contents
        free = _free_var(owner, chain[i + 2])
        if free is None:
            return None
        edges.append(Edge(owner, "cell", free))
        i += 3
    elif search.roots[id(owner)] == "named":  # gradguard._roots (issue 18): the path starts at the object
        root = search.named[id(owner)]
        edges.append(Edge(root, "named", root.name))
    elif search.roots[id(owner)] == "local":
        index, name = search.locals[id(owner)][0]
        edges.append(Edge(search.frames[index], "local", name))
    else:
        key = _dict_key(owner, chain[1])
        if key is _MISSING:
            return None
        edges.append(Edge(search.modules[id(owner)], "global", key))
        i = 1
    while i < len(chain) - 1:
        i += _step(chain, i, edges)
    return tuple(_collapse_module_state(edges))


def _named_from(chain: list[Any]) -> int:
    """Where the path is named from: the last suspended generator or coroutine on ``chain``, or the last
    function that holds the rest through its closure; else -1 (named from its root)."""
    for i in range(len(chain) - 2, -1, -1):
        obj = chain[i]
        if is_a(obj, _GENERATORS) and _generator_frame(obj) is not None:
            return i
        if (
            is_a(obj, types.FunctionType)
            and i + 3 < len(chain)
            and obj.__closure__ is not None
            and chain[i + 1] is obj.__closure__
            and is_a(chain[i + 2], types.CellType)
        ):
            return i
    return -1


def _generator_frame(gen: Any) -> types.FrameType | None:
    for name in ("gi_frame", "cr_frame", "ag_frame"):
        frame = getattr(gen, name, None)
        if frame is not None:
            return frame  # type: ignore[no-any-return]
    return None


def _frame_edge(frame: types.FrameType, chain: list[Any], i: int, edges: list[Edge]) -> int:
    """``chain[i]`` holds (a frame of) ``chain[i + 1]`` as a local; a cell variable's cell is skipped."""
    child = chain[i + 1]
    values = frame_locals(frame)
    for name, value in values:
        if value is child:
            edges.append(Edge(frame, "local", name))
            return 1
    if is_a(child, types.CellType) and i + 2 < len(chain):
        target = chain[i + 2]
        for name, value in values:
            if value is target:
                edges.append(Edge(frame, "local", name))
                return 2
    return _ref(chain[i], child, edges, "<frame stack>")


def _ref(owner: Any, child: Any, edges: list[Edge], what: str | None = None) -> int:
    edges.append(Edge(owner, "ref", what or f"<{type(owner).__qualname__}>"))
    return 1


_MISSING: Any = object()


def _dict_key(d: Any, child: Any) -> Any:
    for k, v in dict.items(d):
        if v is child:
            return k
    return _MISSING


def _free_var(fn: types.FunctionType, cell: Any) -> str | None:
    for name, c in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        if c is cell:
            return name
    return None


_REFS: dict[type, tuple[str, ...]] = {
    types.MethodType: ("__self__", "__func__"),
    functools.partial: ("func", "args", "keywords"),
    types.TracebackType: ("tb_frame", "tb_next"),
    types.FunctionType: ("__defaults__", "__kwdefaults__", "__closure__", "__dict__"),
    property: ("fget", "fset", "fdel"),
    staticmethod: ("__func__",),
    classmethod: ("__func__",),
    types.CellType: ("cell_contents",),
    BaseException: ("__traceback__", "__context__", "__cause__", "args"),
}


def _step(chain: list[Any], i: int, edges: list[Edge]) -> int:
    """Describe ``chain[i]`` holding ``chain[i + 1]``; returns how many links of the chain it used."""
    owner, child = chain[i], chain[i + 1]
    if is_a(owner, types.FrameType):
        return _frame_edge(owner, chain, i, edges)
    if is_a(owner, _GENERATORS):
        frame = _generator_frame(owner)
        return _frame_edge(frame, chain, i, edges) if frame is not None else _ref(owner, child, edges)
    if is_a(owner, dict):
        for k, v in dict.items(owner):
            if v is child:
                edges.append(Edge(owner, "item", k))
                return 1
        for position, k in enumerate(owner):
            if k is child:
                edges.append(Edge(owner, "key", position))
                return 1
    elif is_a(owner, (list, tuple, collections.deque)):
        for index, v in enumerate(owner):
            if v is child:
                edges.append(Edge(owner, "item", index))
                return 1
    elif is_a(owner, (set, frozenset)):
        edges.append(Edge(owner, "member", None))
        return 1
    for cls in type(owner).__mro__:
        refs = _REFS.get(cls)
        if refs is not None:
            for name in refs:
                if getattr(owner, name, None) is child:
                    edges.append(Edge(owner, "ref", name))
                    return 1
            break
    if is_a(owner, type):  # a class -> its __dict__ -> the value: a class attribute
        key = _dict_key(child, chain[i + 2]) if type(child) is dict and i + 2 < len(chain) else _MISSING
        if key is not _MISSING and vars(owner).get(key) is chain[i + 2]:
            edges.append(Edge(owner, "class", key))
            return 2
        return _ref(owner, child, edges)
    namespace = _instance_dict(owner)
    if namespace is not None:
        if namespace is child and i + 2 < len(chain):  # owner -> its __dict__ -> value: one attribute
            key = _dict_key(namespace, chain[i + 2])
            if key is not _MISSING:
                edges.append(Edge(owner, "attr", key))
                return 2
        for k, v in dict.items(namespace):
            if v is child:
                edges.append(Edge(owner, "attr", k))
                return 1
    slot = _slot_name(owner, child)
    if slot is not None:
        edges.append(Edge(owner, "slot", slot))
        return 1
    return _ref(owner, child, edges)


def _instance_dict(obj: Any) -> dict[str, Any] | None:
    """``obj.__dict__`` read without its class's ``__getattribute__``; ``None`` when it has none."""
    if is_a(obj, (type, types.ModuleType)):
        return None
    try:
        namespace = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return namespace if type(namespace) is dict else None


def _slot_name(obj: Any, child: Any) -> str | None:
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            descriptor = cls.__dict__.get(name)
            if type(descriptor) is not types.MemberDescriptorType:
                continue
            try:
                if descriptor.__get__(obj, type(obj)) is child:
                    return str(name)
            except AttributeError:  # an unset slot
                continue
    return None


def _collapse_module_state(edges: list[Edge]) -> list[Edge]:
    """``module._modules['layers']`` becomes the attribute it is: ``module.layers``."""
    out: list[Edge] = []
    i = 0
    while i < len(edges):
        edge = edges[i]
        if (
            edge.kind == "attr"
            and edge.key in MODULE_STATE
            and is_a(edge.owner, nn.Module)
            and i + 1 < len(edges)
            and edges[i + 1].kind == "item"
            and type(edges[i + 1].key) is str
        ):
            out.append(Edge(edge.owner, "attr", edges[i + 1].key))
            i += 2
            continue
        out.append(edge)
        i += 1
    return out
