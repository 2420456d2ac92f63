"""The watch's repair: a dead graph's tensor replaced, in place, by its detached self.

Only tensors whose graph is dead (:mod:`gradguard._graph.liveness`) are replaced, by their
``detach()`` (same storage, same subclass), at the deepest place on the path that Python can assign
and that is the program's own state (:mod:`gradguard._heap.ownership`); never through a class's own
``__setattr__``, never into an object whose hash is computed from its fields. A holder is
``repaired`` only when the value, read back after the write, no longer reaches the tensor. Where it
may write and the outcomes it reports: ``docs/guide/finding-leaks.md`` (*What is repaired*).
"""

from __future__ import annotations

import gc
import types
from typing import NamedTuple

import torch
from torch import nn

from .._compat import referrers, untraversable
from .._heap.ownership import Owner, path_owners
from .._heap.paths import Edge, Path, container, is_a, reaches, read, writable, write
from .._tree.walk import map_tensors

__all__ = ["Repair", "repair"]

LIVE = "live"
REPAIRED = "repaired"
PARTLY = "repaired in part"
STUCK = "not repairable"

_PLAIN_SETATTR = (object.__setattr__, types.SimpleNamespace.__setattr__)  # an instance dict, no side effect

_UNWRITABLE = {
    "local": "a frame local",
    "cell": "a closure cell",
    "key": "a dict key",
    "member": "a set member",
    "ref": "a reference Python cannot assign",
}


class Repair(NamedTuple):
    """What :func:`repair` did for one holder: its outcome, the tensors it detached (and released:
    no longer reached from where they were held), and why the rest could not be repaired."""

    outcome: str
    detached: int
    released: int
    why: str


def repair(paths: list[Path], tensors: list[torch.Tensor], alive: list[bool]) -> Repair:
    """Repair one holder's leaking tensors: ``paths[i]`` leads to ``tensors[i]``, whose graph is
    still usable for backward when ``alive[i]`` (see the module documentation)."""
    dead = {id(t) for t, a in zip(tensors, alive) if not a}
    if not dead:
        return Repair(LIVE, 0, 0, "")
    detached = 0
    reasons: list[str] = []
    plans: list[tuple[Path, int]] = []
    for path, is_alive in zip(paths, alive):
        if is_alive:
            continue
        j, why = _write_point(path)
        if j is None:
            reasons.append(why)
        else:
            plans.append((path, j))
    shared = _shared(plans)
    for path, j in plans:
        if id(path) in shared:
            reasons.append(shared[id(path)])
            continue
        if not _leads(path, j):
            continue  # replaced already, through another of this holder's paths
        old = read(path[j])
        new = map_tensors(old, lambda t: t.detach() if id(t) in dead else t)
        if new is not old:
            write(path[j], new)
            detached += 1
        del old, new
    released = sum(1 for path, t, a in zip(paths, tensors, alive) if not a and not _held_through(path, t))
    if released == len(dead) == len(tensors):
        outcome = REPAIRED
    elif released:
        outcome = PARTLY
    else:
        outcome = STUCK
    why = reasons[0] if reasons else ""
    return Repair(outcome, detached, released, why)


def _write_point(path: Path) -> tuple[int | None, str]:
    """The edge of ``path`` the repair writes, or ``None`` and why there is none: the edge that holds
    the tensor, or the nearest one above it when only immutable values (tuples, namedtuples) are in
    between, which are then rebuilt. Never above a mutable object or one the repair may not write:
    rebuilding those would hand the program a different object than the one it holds."""
    owners = path_owners(path)
    for j in range(len(path) - 1, -1, -1):
        edge = path[j]
        if writable(edge):
            refusal = _refusal(edge, owners[j])
            return (None, refusal) if refusal else (j, "")
        if not (edge.kind == "item" and is_a(edge.owner, tuple)):
            return None, _unwritable(edge)
    return None, "nothing on its path can be assigned"


def _unwritable(edge: Edge) -> str:
    if edge.kind == "ref":
        return f"the {edge.key} of a {type(edge.owner).__qualname__}, which Python cannot assign"
    if edge.kind == "item":
        return f"an item of a {type(edge.owner).__qualname__}"
    return _UNWRITABLE.get(edge.kind, f"a {edge.kind}")


def _refusal(edge: Edge, owner: Owner) -> str:
    """Why the repair may not write ``edge`` (empty when it may)."""
    if not owner.program:
        return f"{owner.what} ({owner.label}'s state, which gradguard never writes)"
    obj = edge.owner
    if edge.kind in ("attr", "slot") and not is_a(obj, nn.Module):
        cls = type(obj)
        params = getattr(cls, "__dataclass_params__", None)
        if params is not None and getattr(params, "frozen", False):
            return f"a frozen dataclass ({cls.__qualname__})"
        if cls.__hash__ not in (object.__hash__, None):
            return f"a {cls.__qualname__}, whose hash may depend on its fields"
        if cls.__setattr__ not in _PLAIN_SETATTR:
            return f"a {cls.__qualname__}, whose class controls its attribute assignment"
    return ""


def _shared(plans: list[tuple[Path, int]]) -> dict[int, str]:
    """For each plan (a path, and the edge to write) that would change something the program can see
    besides the graph, why (keyed by ``id(path)``). Writing edge ``j`` rebuilds the objects below it
    on the path (a tuple, a namedtuple, a dataclass holding the tensor); when one of them is also
    held elsewhere (a record kept in a list *and* used as a dict key), the other holder would keep
    the old object and the program would find a different one (with a different hash) where it put
    it. One heap pass for all the plans."""
    objects: list[object] = []  # the only reference the bookkeeping keeps to them: skipped below
    expected: dict[int, set[int]] = {}  # id(object) -> ids of its holders on the paths
    users: dict[int, list[int]] = {}  # id(object) -> the plans that rebuild it
    for n, (path, j) in enumerate(plans):
        for i in range(j + 1, len(path)):
            obj = path[i].owner
            if id(obj) not in expected:
                objects.append(obj)
                expected[id(obj)], users[id(obj)] = set(), []
            above = path[i - 1]
            expected[id(obj)].add(id(above.owner))
            inner = container(above)  # a module's globals, an instance's attributes: they refer to it
            if inner is not None:
                expected[id(obj)].add(id(inner))
            users[id(obj)].append(n)
    if not objects:
        return {}
    found: dict[int, str] = {}
    skipped = untraversable()
    for holder in referrers(objects):
        if id(holder) in skipped:
            continue
        if holder is objects or is_a(holder, Edge) or _is_path(holder) or _own_frame(holder):
            continue
        for held in gc.get_referents(holder):
            if id(held) not in expected or id(holder) in expected[id(held)]:
                continue
            why = f"a {type(held).__qualname__} also held elsewhere (a copy would change what the program finds there)"
            for n in users[id(held)]:
                found.setdefault(id(plans[n][0]), why)
    del objects
    return found


def _own_frame(obj: object) -> bool:
    """Before 3.11 a running frame refers to its locals: this module's frames hold the objects too."""
    return is_a(obj, types.FrameType) and obj.f_code.co_filename == __file__  # type: ignore[attr-defined]


def _is_path(obj: object) -> bool:
    return is_a(obj, tuple) and bool(obj) and all(is_a(e, Edge) for e in obj)  # type: ignore[attr-defined]


def _leads(path: Path, j: int) -> bool:
    """Whether ``path`` still leads, edge by edge, to the owner of edge ``j``: ``False`` only where an
    edge reads back another object (an earlier repair or another thread replaced something on the
    way); an edge that cannot be read back cannot tell."""
    for i in range(j):
        try:
            now = read(path[i])
        except (LookupError, AttributeError, IndexError, TypeError, ValueError):
            continue
        if now is not path[i + 1].owner:
            return False
    return True


def _held_through(path: Path, tensor: torch.Tensor) -> bool:
    """Whether ``path``, read again from its root, still reaches ``tensor``. Where an edge now reads
    back another object (a repair replaced it), whether that object still reaches the tensor; an
    edge that cannot be read back cannot tell, and the reading goes on below it."""
    for i, edge in enumerate(path):
        try:
            now = read(edge)
        except (LookupError, AttributeError, IndexError, TypeError, ValueError):
            continue
        expected = path[i + 1].owner if i + 1 < len(path) else tensor
        if now is not expected:
            return reaches(now, tensor)
    return True
