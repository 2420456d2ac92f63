"""What to do about a holder: the fix an audit offers, only where the user can apply it.

A graph kept in the program's own state gets a guard (a list, dict or deque it can name, or
``enforce(stores=...)`` for an argument), checked to release the graph, or the place to detach. One
kept in an installed package's state (or torch's, or the standard library's) is not the program's
to change: the fix names the package and its version, the program's object or line of code through
which the value reached it, says that ``detach`` does not repair it, and ends with upgrading or
reporting upstream. Whose state an object is: :mod:`gradguard._heap.ownership`.
"""

from __future__ import annotations

import collections
import types

import torch

from .._errors import GradGuardError
from .._heap.installed import package_version, program_frame
from .._heap.ownership import Owner, path_owners
from .._heap.paths import Path, frame_where, module_dict, reaches, read, spell_steps
from .._tree.walk import detach_tree

__all__ = ["fix"]

_STORES: dict[type, str] = {
    list: "[]",
    dict: "{}",
    collections.deque: "collections.deque()",
    collections.OrderedDict: "collections.OrderedDict()",
}
_NAMING = ("global", "class", "local", "cell", "named", "attr", "slot")  # named: gradguard._heap.roots


def fix(path: Path, tensor: torch.Tensor) -> str:
    """What to do about the holder at ``path`` (live edges) of ``tensor``, first that applies:

    * the graph is kept by an exception's traceback: clear it;
    * it sits in a library's state (an installed package's, torch's, the standard library's): where
      the value entered that state from the program, that ``detach`` does not repair it, and to upgrade
      or report upstream;
    * ``enforce(stores=...)`` when the store is an argument of the running function, and guarding
      the nearest list, dict or deque the program owns and can name, that holds it as an item —
      each only when guarding would release it (the item, detached as a guard detaches what is
      stored, no longer reaches the tensor);
    * else detaching it before it is stored there.
    """
    owners = path_owners(path)
    if any(edge.kind == "ref" and edge.key in ("__traceback__", "tb_frame") for edge in path):
        return (
            "an exception's traceback keeps the frame's locals: keep the exception without it "
            "(e.with_traceback(None)) or str(e), or call traceback.clear_frames(e.__traceback__)"
        )
    start = 0  # the program's own state starts here: after the last library object on the path
    for j, owner in enumerate(owners):
        if not owner.program:
            start = j + 1
    if start >= len(path):
        return _library_fix(path, owners)
    first = path[start]
    argument = start == 0 and first.kind == "local" and len(path) > 1 and _is_argument(first.owner, first.key)
    if argument and path[1].kind == "item" and _releases(path, 1, tensor):
        frame = first.owner
        module = frame.f_globals.get("__name__")
        qualname = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        if isinstance(module, str) and "<" not in qualname:
            return f'gradguard.enforce(stores={{"{module}:{qualname}": "{first.key}"}})'
    reached = [e.owner for e in path[1:]]  # reached[j]: what edge j leads to (the last one: the tensor)
    for j in range(len(reached) - 1, start - 1, -1):
        store = _STORES.get(type(reached[j]))
        named = all(e.kind in _NAMING or (e.kind == "item" and isinstance(e.key, str)) for e in path[start : j + 1])
        if store is not None and named and path[j + 1].kind == "item" and _releases(path, j + 1, tensor):
            return f"{_spelled(path, start, j + 1, owners)} = gradguard.guard({store}) ({_where(path, start)})"
    for j in range(len(path) - 1, start - 1, -1):
        kind = path[j].kind
        if kind in ("key", "member"):
            where = "the keys of" if kind == "key" else "the set"
            return (
                f"put a detached value (t.detach() or t.item()) in {where} {_spelled(path, start, j, owners) or 'it'}: "
                "a tensor kept as a dict key or a set member keeps its graph"
            )
    if any(not o.program for o in owners[start:]):
        return _library_fix(path, owners)
    return f"detach before storing into {_spelled(path, start, len(path), owners)} ({_where(path, start)})"


def _library_fix(path: Path, owners: list[Owner]) -> str:
    """The fix for a graph in a library's state (see the module documentation)."""
    first = next(j for j, owner in enumerate(owners) if not owner.program)
    holder = next(owner for owner in reversed(owners) if not owner.program)
    package = _package(holder.label or "")
    entered = ""
    if first > 0:  # the program's object that holds the library's: what it hands over ends up there
        entered = f"it reached that state through your {_spelled(path, 0, first, owners)}"
    elif path[0].kind == "local":
        caller = program_frame(path[0].owner.f_back)
        if caller is not None:
            entered = f"it reached that state from your call at {frame_where(caller)}"
    key = next((e.key for e in reversed(path[first:]) if e.kind == "item" and isinstance(e.key, str)), None)
    handed = f" (here the value under {key!r})" if key is not None else ""
    steps = [f"{package} keeps it in {holder.what}, which gradguard does not repair (not the program's state)"]
    if entered:
        steps.append(f"{entered}: detach what you hand it (t.detach() or t.item()){handed}")
    if holder.label not in ("the standard library", None):
        steps.append(f"else upgrade {holder.label} or report it upstream")
    return "; ".join(steps)


def _package(label: str) -> str:
    """``transformers 3.1.0``: the library and its installed version, where one is known."""
    version = package_version(label)
    return f"{label} {version}" if version else label


def _spelled(path: Path, start: int, end: int, owners: list[Owner]) -> str:
    """``path[start:end]`` as the program names it: from its first edge's own name (``HISTORY``,
    ``trainer.metrics``), or, when the path starts inside a library's state, from the program's object
    there (``self.training_step_outputs``)."""
    if start == 0:
        return _name(path[:end]) if end else ""
    what = "self" if path[start].kind in ("attr", "slot") else f"<{owners[start].what}>"
    return what + spell_steps(path[start:end])


def _releases(path: Path, j: int, tensor: torch.Tensor) -> bool:
    """Whether guarding the container of edge ``j`` would release ``tensor``: the value stored there,
    detached as a guarded store detaches what it stores, no longer reaches it."""
    try:
        value = read(path[j])
    except (LookupError, AttributeError, IndexError, TypeError, ValueError):
        return False
    try:
        detached = detach_tree(value)
    except GradGuardError:  # a record that cannot be rebuilt: a guard would refuse it
        return False
    return not reaches(detached, tensor)


def _is_argument(frame: types.FrameType, name: str) -> bool:
    code = frame.f_code
    return name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]


def _name(path: Path) -> str:
    """``path`` spelled from its first edge's own name on: ``HISTORY``, ``Trainer.cache``, ``trainer.metrics``."""
    first = path[0]
    head = str(first.key) if first.kind in _NAMING else ""
    return head + spell_steps(path[1:]) if head else spell_steps(path).lstrip(".")


def _where(path: Path, start: int) -> str:
    edge = path[start]
    if start:
        owner = edge.owner
        return f"in a {type(owner).__qualname__}"
    if edge.kind == "local":
        return f"in {frame_where(edge.owner)}"
    if edge.kind == "cell":
        return f"closure of {edge.owner.__module__}:{edge.owner.__qualname__}"
    if edge.kind == "named":  # gradguard._heap.roots: "in actor Trainer"
        return f"in {edge.owner.label}"
    return f"in {module_dict(edge.owner).get('__name__')}"
