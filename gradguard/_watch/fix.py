"""What to do about a holder: the fix an audit offers, in the user's terms, only where the user can apply it.

A graph kept in the program's own state: detach (``t.detach()`` or ``t.item()``) what is stored there,
at the place that stores it; a list, dict or deque the program names (or ``enforce(stores=...)`` for
an argument) is offered second, as the alternative: a guarded store detaches what it is given, and in
``raise`` mode refuses it, so only the detach makes a ``--mode raise`` run pass. A graph kept in an installed
package's state (or torch's, or the standard library's) is not the program's to change: the fix names
the package and its version, the user's code that fed it (the object it was handed, the method of
theirs it calls, or the call that led there) with the smallest change there, and, for a leak of the
known-leak table (:mod:`gradguard._heap.known_leaks`), the release that fixed it; where nothing on the
user's side carries the graph it says so. Whether a mode repairs the holder is the mode's warning's
to say, not the fix's. Whose state an object is: :mod:`gradguard._heap.ownership`.
"""

from __future__ import annotations

import collections
import inspect
import os
import sys
import types

import torch

from .._errors import GradGuardError
from .._heap.installed import known_leak, library_of_module, package_version, program_frame, short_path
from .._heap.known_leaks import KnownLeak
from .._heap.ownership import Owner, path_owners
from .._heap.paths import Path, frame_qualname, module_dict, reaches, read, spell_steps
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
    * it sits in a library's state (an installed package's, torch's, the standard library's): the
      package and version, the user's code that fed it and the change there, the release that fixed
      it where the known-leak table has it (see the module documentation);
    * a tensor kept as a dict key or a set member: put a detached value there;
    * else detaching it before it is stored (``t.detach()`` or ``t.item()``), followed, when the store
      is an argument of the running function (``enforce(stores=...)``) or the nearest list, dict or
      deque the program owns and can name holds it as an item, by that guard as the alternative — only when
      guarding would release it (the item, detached as a guard detaches what is stored, no longer
      reaches the tensor).
    """
    owners = path_owners(path)
    if path and path[-1].kind == "grad":
        return (
            "a gradient keeps the graph backward(create_graph=True) built: clear the gradients at every step "
            "(optimizer.zero_grad()), or take a penalty's gradient with torch.autograd.grad(..., create_graph=True)"
        )
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
    detach = f"detach before storing into {_spelled(path, start, len(path), owners)} ({_where(path, start)}): {_DETACH}"
    net = _net(path, start, owners, tensor)
    return f"{detach}; or {net}, {_NET}" if net else detach


_DETACH = "t.detach() or t.item()"
_NET = "which detaches what is stored, or refuses it in raise mode"


def _net(path: Path, start: int, owners: list[Owner], tensor: torch.Tensor) -> str | None:
    """The guard that would release the holder (see :func:`fix`), or ``None``."""
    first = path[start]
    argument = start == 0 and first.kind == "local" and len(path) > 1 and _is_argument(first.owner, first.key)
    if argument and path[1].kind == "item" and _releases(path, 1, tensor):
        frame = first.owner
        module = frame.f_globals.get("__name__")
        qualname = frame_qualname(frame)
        if isinstance(module, str) and "<" not in qualname:
            return f'gradguard.enforce(stores={{"{module}:{qualname}": "{first.key}"}})'
    reached = [e.owner for e in path[1:]]  # reached[j]: what edge j leads to (the last one: the tensor)
    for j in range(len(reached) - 1, start - 1, -1):
        store = _STORES.get(type(reached[j]))
        named = all(e.kind in _NAMING or (e.kind == "item" and isinstance(e.key, str)) for e in path[start : j + 1])
        if store is not None and named and path[j + 1].kind == "item" and _releases(path, j + 1, tensor):
            return f"{_spelled(path, start, j + 1, owners)} = gradguard.guard({store})"
    return None


def _library_fix(path: Path, owners: list[Owner]) -> str:
    """The fix for a graph in a library's state (see the module documentation)."""
    first = next(j for j, owner in enumerate(owners) if not owner.program)
    holder = next(owner for owner in reversed(owners) if not owner.program)
    version = package_version(holder.label) if holder.label else None
    package = f"{holder.label} {version}" if version else holder.label or "a library"
    steps = [f"{package} keeps it in {holder.what} (its state, not your program's)"]
    known = _known(path, owners, holder, version)
    if known is not None:
        steps.append(_known_fix(known, path, first, owners))
        return "; ".join(steps)
    key = next((e.key for e in reversed(path[first:]) if e.kind == "item" and isinstance(e.key, str)), None)
    handed = f" (here the value under {key!r})" if key is not None else ""
    if first > 0:  # the program's object that holds the library's: what it hands over ends up there
        steps.append(f"it reached that state through your {_spelled(path, 0, first, owners)}: "
                     f"detach what you hand it ({_DETACH}){handed}")  # fmt: skip
    elif path[0].kind == "local":
        caller = program_frame(path[0].owner.f_back)
        if caller is not None:
            steps.append(
                f"it got there during your call at {_frame_where(caller)}: where a method of yours it calls "
                f"(a training_step, update or compute_loss) returns or passes the value, detach it there ({_DETACH})"
            )
    if holder.label not in ("the standard library", None):
        steps.append(f"else upgrade {holder.label} or report it upstream")
    return "; ".join(steps)


def _known(path: Path, owners: list[Owner], holder: Owner, version: str | None) -> KnownLeak | None:
    """The known leak the holder at ``path`` matches (:func:`gradguard._heap.installed.known_leak`)."""
    if holder.label is None:
        return None
    shapes: set[str] = set()
    keys: set[str] = set()
    for edge, owner in zip(path, owners):
        if owner.label != holder.label:
            continue
        obj = edge.owner
        if edge.kind == "local" and isinstance(obj, types.FrameType):
            module = obj.f_globals.get("__name__")
            shapes.add(f"{module}.{frame_qualname(obj)}")
        else:
            cls = obj if isinstance(obj, type) else type(obj)
            shapes.update(f"{c.__module__}.{c.__qualname__}" for c in getattr(cls, "__mro__", ()))
        if isinstance(edge.key, str):
            keys.add(edge.key)
    return known_leak(holder.label, version, shapes, keys)


def _known_fix(known: KnownLeak, path: Path, first: int, owners: list[Owner]) -> str:
    """A known leak's fix: the user's side first (where they have one), then the release to upgrade to."""
    upgrade = f"upgrade to {known.distribution} {known.fixed}, which fixed this known leak ({known.reference})"
    if known.remedy is None:
        return f"it computes that value itself, nothing in your code can detach it: {upgrade}"
    where = ""
    if known.hook is not None:
        override = _override(known.hook)
        if override is not None:
            where = f"in your {override}: "
    elif first > 0:
        where = f"detach what reaches your {_spelled(path, 0, first, owners)}: "
    return f"{where}{known.remedy}; or {upgrade}"


def _override(hook: str) -> str | None:
    """``Regressor.training_step (train.py:27)``: the program's override of the library method ``hook``
    (``module.Class.method``), the one of the most derived class where several are; ``None`` when the
    program overrides it nowhere (or the class is not imported)."""
    module_name, _, rest = hook.rpartition(".")
    module_name, _, class_name = module_name.rpartition(".")
    module = sys.modules.get(module_name)
    base = getattr(module, class_name, None)
    if not isinstance(base, type):
        return None
    found = None
    todo: list[type] = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        method = cls.__dict__.get(rest)
        module_of = cls.__module__ if isinstance(cls.__module__, str) else ""
        if method is None or library_of_module(module_of) is not None:
            continue
        code = getattr(inspect.unwrap(method), "__code__", None)
        if code is not None:
            found = f"{cls.__qualname__}.{rest} ({_short(code.co_filename)}:{code.co_firstlineno})"
    return found


def _frame_where(frame: types.FrameType) -> str:
    """``train.py:42 in main``, the file named as :func:`_short` names it (``train.py in main`` for a frame
    stopped where it has no line: between two of its bytecodes that belong to none)."""
    code = frame.f_code
    line = "" if frame.f_lineno is None else f":{frame.f_lineno}"
    return f"{_short(code.co_filename)}{line} in {frame_qualname(frame)}"


def _short(filename: str) -> str:
    """A file as a message names it, never by a path of this machine: an installed package's relative to
    the folder it is installed in, another relative to the working directory when under it, else its name."""
    return short_path(filename) or os.path.basename(filename)


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
        return f"in {_frame_where(edge.owner)}"
    if edge.kind == "cell":
        return f"closure of {edge.owner.__module__}:{edge.owner.__qualname__}"
    if edge.kind == "named":  # gradguard._heap.roots: "in actor Trainer"
        return f"in {edge.owner.label}"
    return f"in {module_dict(edge.owner).get('__name__')}"
