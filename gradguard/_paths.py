"""Paths from a root to an object: :class:`Edge`, reading and repairing along one, and spelling one
the way Python reads it (``mypkg.train:HISTORY[3]['loss']``, ``model.layers[0].attn.max_logits``,
``train.py:42 in step: metrics['loss_sum']``). :mod:`gradguard._holders` finds the paths.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

from torch import nn

from ._errors import GradGuardError

__all__ = [
    "ROOT_KINDS",
    "Edge",
    "Path",
    "frame_locals",
    "frame_where",
    "holder_key",
    "is_a",
    "read",
    "spell",
    "spell_steps",
    "writable",
    "write",
]

ROOT_KINDS = frozenset({"global", "local", "cell", "named"})  # named: gradguard._roots (issue 18)
MODULE_STATE = ("_modules", "_parameters", "_buffers")
_CO_OPTIMIZED = 0x0001  # inspect.CO_OPTIMIZED: a function frame, whose f_locals is a snapshot (< 3.13)
_SNAPSHOT_LOCALS = sys.version_info < (3, 13)  # 3.13 (PEP 667): f_locals is a proxy that holds nothing


@dataclasses.dataclass(frozen=True, eq=False)
class Edge:
    """One step of a path: ``owner`` holds the next object, as ``kind`` with ``key`` says.

    ==========  ================================================  =====================================
    kind        owner / key                                        the next object
    ==========  ================================================  =====================================
    ``global``  a module / the global's name (a root)              ``vars(owner)[key]``
    ``local``   a frame / the local's name: a thread's running      the frame local ``key`` (a cell
                frame (a root), a suspended generator's or          variable: the cell's contents)
                coroutine's (the path is named from it), a
                finished one a traceback holds (mid-path)
    ``cell``    a function / the free variable's name (the path    that closure cell's contents
                is named from it)
    ``named``   a :class:`gradguard._roots.NamedRoot` / its name    the object it names (a root,
                (``self``), spelled after its label                 preferred over module globals)
    ``class``   a class / the attribute's name                     ``vars(owner)[key]``
    ``attr``    an object / the attribute's name                   ``vars(owner)[key]``; for an
                                                                   ``nn.Module`` also its
                                                                   ``_modules``/``_parameters``/
                                                                   ``_buffers[key]``
    ``slot``    an object / the ``__slots__`` name                 the slot's value
    ``item``    a list, deque or tuple / an index;                 ``owner[key]``
                a dict / the dict key itself
    ``key``     a dict / the key's position                        the key object itself
    ``member``  a set or frozenset / ``None``                      one of its elements
    ``ref``     anything else / a description (``"__self__"``,    a reference Python cannot name
                ``"tb_frame"``, ``"__defaults__"``)
    ==========  ================================================  =====================================

    The first edge of a path is a root kind (:data:`ROOT_KINDS`). Identity, not equality: two edges
    are equal only when they are the same object, so an owner's ``__eq__`` is never called.
    """

    owner: Any
    kind: str
    key: Any


Path = tuple[Edge, ...]


def is_a(obj: Any, kinds: type | tuple[type, ...]) -> bool:
    """``isinstance`` by the real type: a proxy's ``__class__`` is never asked."""
    return issubclass(type(obj), kinds)


def frame_locals(frame: types.FrameType) -> list[tuple[str, Any]]:
    """``(name, value)`` of ``frame``'s locals (cell variables dereferenced), leaving nothing behind.

    Before Python 3.13 reading ``f_locals`` of a function frame fills a snapshot dict that the frame
    keeps until it exits and that would pin what it holds (say, the previous step's loss): it is
    emptied again here. Not while a Python trace function (``sys.settrace``: a debugger) traces the
    frame: it refreshes the snapshot at its next event, and writes the snapshot back into the frame
    after each one, so an emptied snapshot would delete the frame's locals when the audit runs from
    a debugger prompt. A
    module or class body's ``f_locals`` is its real namespace: left alone. (A ``locals()`` dict the
    frame's own code keeps is that same snapshot: it is emptied too.)
    """
    namespace = frame.f_locals
    items = list(namespace.items())
    traced = is_a(frame.f_trace, (types.FunctionType, types.MethodType))  # sys.settrace: pdb, not coverage's C tracer
    if _SNAPSHOT_LOCALS and frame.f_code.co_flags & _CO_OPTIMIZED and type(namespace) is dict and not traced:
        namespace.clear()
    return items


def frame_where(frame: types.FrameType, *, line: bool = True) -> str:
    """``train.py:42 in train_step``: the file (relative to the working directory when under it), the
    current line, the function's qualified name."""
    code = frame.f_code
    filename = code.co_filename
    try:
        relative = os.path.relpath(filename)
        if not relative.startswith(os.pardir):
            filename = relative
    except ValueError:  # another drive on Windows
        pass
    name = getattr(code, "co_qualname", code.co_name)
    return f"{filename}:{frame.f_lineno} in {name}" if line else f"{filename} in {name}"


# --------------------------------------------------------------------------------------------------
# Reading, repairing, spelling
# --------------------------------------------------------------------------------------------------


def read(edge: Edge) -> Any:
    """The object ``edge`` leads to, read without calling user code (``KeyError``/``LookupError`` if gone)."""
    owner, kind, key = edge.owner, edge.kind, edge.key
    if kind in ("global", "class"):
        return vars(owner)[key]
    if kind == "attr":
        if is_a(owner, nn.Module):
            for state in MODULE_STATE:
                table = owner.__dict__.get(state)
                if table is not None and key in table:
                    return table[key]
        return object.__getattribute__(owner, "__dict__")[key]
    if kind == "slot":
        for cls in type(owner).__mro__:
            descriptor = cls.__dict__.get(key)
            if type(descriptor) is types.MemberDescriptorType:
                return descriptor.__get__(owner, type(owner))
        raise LookupError(f"{type(owner).__qualname__} has no slot {key!r}")
    if kind == "item":
        if is_a(owner, dict):
            return dict.__getitem__(owner, key)
        if is_a(owner, list):
            return list.__getitem__(owner, key)
        if is_a(owner, tuple):
            return tuple.__getitem__(owner, key)
        return owner[key]
    if kind == "local":
        for name, value in frame_locals(owner):
            if name == key:
                return value
        raise LookupError(f"the frame has no local {key!r}")
    if kind == "cell":
        return owner.__closure__[owner.__code__.co_freevars.index(key)].cell_contents
    if kind == "key":
        return list(owner)[key]
    if kind == "named":  # gradguard._roots (issue 18)
        return owner.resolve()
    raise LookupError(f"an edge of kind {kind!r} cannot be read back")


def writable(edge: Edge) -> bool:
    """Whether :func:`write` can replace what ``edge`` leads to: a global, a class attribute, an
    attribute or slot, an item of a list, deque or dict. Not a frame local, a closure cell, a tuple
    item, a dict key, a set member or any other reference."""
    if edge.kind in ("global", "class", "attr", "slot"):
        return True
    return edge.kind == "item" and is_a(edge.owner, (list, dict, collections.deque))


def write(edge: Edge, value: Any) -> None:
    """Replace what ``edge`` leads to with ``value``, in place, without the owner's user-level
    ``__setitem__``/``__setattr__`` (an ``nn.Module`` attribute goes through ``setattr`` so that a
    buffer stays a buffer). :class:`GradGuardError` when not :func:`writable`."""
    owner, kind, key = edge.owner, edge.kind, edge.key
    if not writable(edge):
        raise GradGuardError(f"gradguard cannot replace a {kind} in place ({spell((edge,))}); detach it at the source")
    if kind == "global":
        vars(owner)[key] = value
    elif kind == "class":
        type.__setattr__(owner, key, value)
    elif kind == "attr":
        if is_a(owner, nn.Module):
            setattr(owner, key, value)
        else:
            object.__getattribute__(owner, "__dict__")[key] = value
    elif kind == "slot":
        for cls in type(owner).__mro__:
            descriptor = cls.__dict__.get(key)
            if type(descriptor) is types.MemberDescriptorType:
                descriptor.__set__(owner, value)
                return
    elif is_a(owner, dict):
        dict.__setitem__(owner, key, value)
    elif is_a(owner, list):
        list.__setitem__(owner, key, value)
    else:
        owner[key] = value


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value) if isinstance(value, (str, int, float, bool, bytes, type(None))) else f"<{type(value).__name__}>"
    text = text if text.isprintable() else ascii(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _spell_root(edge: Edge, wildcard: bool) -> str:
    owner, kind, key = edge.owner, edge.kind, edge.key
    if kind == "global":
        return f"{owner.__name__}:{key}"
    if kind == "cell":
        return f"closure of {owner.__module__}:{owner.__qualname__}: {key}"
    if kind == "local":
        return f"{frame_where(owner, line=not wildcard)}: {key}"
    if kind == "named":  # gradguard._roots (issue 18): "actor Trainer: self"
        return f"{owner.label}: {key}"
    return f"<{kind}>"


def _sequence(owner: Any) -> bool:
    return is_a(owner, (list, tuple, collections.deque, nn.ModuleList, nn.Sequential))


def _spell_step(edge: Edge, wildcard: bool) -> str:
    owner, kind, key = edge.owner, edge.kind, edge.key
    if kind in ("attr", "slot", "class"):
        if isinstance(key, str) and key.isidentifier():
            return f".{key}"
        if isinstance(key, str) and key.isdigit() and is_a(owner, nn.Module):  # ModuleList, Sequential
            return "[*]" if wildcard and _sequence(owner) else f"[{key}]"
        return f".__dict__[{_short(key)}]"
    if kind == "item":
        if wildcard and type(key) is int and (_sequence(owner) or is_a(owner, dict)):  # a list's, or a dict by step
            return "[*]"
        return f"[{_short(key)}]"
    if kind == "key":
        return ".keys()[*]" if wildcard else f".keys()[{key}]"
    if kind == "member":
        return "{…}"
    if kind == "local":
        return f".f_locals[{_short(key)}]"
    if kind == "ref":
        return f".{key}" if isinstance(key, str) and key.isidentifier() else f" {key}"
    return f".<{kind}>"


def spell(path: Sequence[Edge]) -> str:
    """``path`` as Python spells it: ``mypkg.train:HISTORY[3]['loss']``, ``model.layers[0].attn.max_logits``
    under its root (``train.py:42 in step: trainer.metrics['loss_sum']``); a set member is ``{…}``."""
    return _spell(path, wildcard=False)


def holder_key(path: Sequence[Edge]) -> str:
    """:func:`spell` with sequence indices, ``int`` dict keys and dict key positions as ``[*]``, and no
    line number: one string for all the records of one list (or of one dict keyed by step), stable
    from one step to the next."""
    return _spell(path, wildcard=True)


def spell_steps(edges: Sequence[Edge]) -> str:
    """The steps of ``edges`` spelled after a name already written: ``.metrics['loss_sum']``."""
    return "".join(_spell_step(e, False) for e in edges)


def _spell(path: Sequence[Edge], wildcard: bool) -> str:
    if not path:
        return ""
    first = path[0]
    text = _spell_root(first, wildcard) if first.kind in ROOT_KINDS else _spell_step(first, wildcard)
    return text + "".join(_spell_step(e, wildcard) for e in path[1:])
