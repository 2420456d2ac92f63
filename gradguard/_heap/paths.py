"""Paths from a root to an object: :class:`Edge`, reading and repairing along one, and spelling one
the way Python reads it (``mypkg.train:HISTORY[3]['loss']``, ``model.layers[0].attn.max_logits``,
``train.py:42 in step: metrics['loss_sum']``). :mod:`gradguard._heap.holders` finds the paths.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import re
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import _compat
from .._compat import UNKNOWN, code_qualname, untraversable
from .._errors import GradGuardError
from . import installed
from .frames import frame_locals

__all__ = [
    "ROOT_KINDS",
    "frame_qualname",
    "Edge",
    "Path",
    "frame_where",
    "class_dict",
    "container",
    "holder_key",
    "instance_dict",
    "is_a",
    "leaf_grad",
    "module_dict",
    "reaches",
    "read",
    "read_ref",
    "sequence_items",
    "spell",
    "spell_steps",
    "tensor_grad",
    "writable",
    "write",
]

_TENSOR = torch.Tensor
_GRAD: Any = vars(torch._C.TensorBase)["grad"]  # the getset descriptor torch stores a gradient through
_DIGITS = re.compile(r"\d+")
ROOT_KINDS = frozenset({"global", "local", "cell", "named"})  # named: gradguard._heap.roots
MODULE_STATE = ("_modules", "_parameters", "_buffers")


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
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
    ``named``   a :class:`gradguard._heap.roots.NamedRoot` / its name    the object it names (a root,
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
    ``grad``    a tensor / ``"grad"``                              its ``.grad`` (held by torch, not by
                                                                   a reference Python can see)
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


_MODULE_DICT = vars(types.ModuleType)["__dict__"].__get__
_CLASS_DICT = vars(type)["__dict__"].__get__


def module_dict(module: types.ModuleType) -> dict[str, Any]:
    """A module's namespace, read through the module type's own slot (a module subclass's
    ``__getattribute__`` never runs)."""
    return _MODULE_DICT(module)  # type: ignore[no-any-return]


def class_dict(cls: type) -> Any:
    """A class's own namespace (a mapping proxy), read without its metaclass's attribute lookup."""
    return _CLASS_DICT(cls)


def instance_dict(obj: Any) -> dict[str, Any] | None:
    """``obj.__dict__`` read through the slot CPython gives a class with instance dicts, never a
    ``__dict__`` property or ``__getattribute__`` of the class; ``None`` when it has none."""
    if is_a(obj, (type, types.ModuleType)):
        return None
    for cls in type(obj).__mro__:
        descriptor = class_dict(cls).get("__dict__")
        if descriptor is None:
            continue
        if type(descriptor) not in (types.GetSetDescriptorType, types.MemberDescriptorType):
            return None  # the class defines its own __dict__: reading it would run the class's code
        try:
            namespace = descriptor.__get__(obj, type(obj))
        except (AttributeError, TypeError):
            return None
        return namespace if type(namespace) is dict else None
    return None


def read_ref(owner: Any, base: type, name: str) -> Any:
    """The C-level field ``name`` of ``owner``, read through ``base``'s own descriptor (a builtin type
    such as ``functools.partial`` or ``BaseException``), never through a subclass's override."""
    descriptor = class_dict(base).get(name)
    if descriptor is None or not hasattr(type(descriptor), "__get__"):
        raise LookupError(f"{base.__qualname__} has no field {name!r}")
    return descriptor.__get__(owner, type(owner))


def sequence_items(owner: Any) -> Any:
    """``enumerate`` over a list, tuple or deque (or a subclass of one) at C level: a subclass's own
    ``__iter__`` never runs."""
    for base in (list, tuple, collections.deque):
        if is_a(owner, base):
            return enumerate(base.__iter__(owner))
    raise TypeError(f"not a sequence: {type(owner).__qualname__}")


def frame_where(frame: types.FrameType, *, line: bool = True) -> str:
    """``train.py:42 in train_step``: the file (an installed package's relative to its ``site-packages``,
    ``transformers/trainer.py``; another relative to the working directory when under it), the current
    line, the function's qualified name."""
    filename = frame.f_code.co_filename
    filename = installed.short_path(filename) or filename
    name = frame_qualname(frame)
    return f"{filename}:{frame.f_lineno} in {name}" if line else f"{filename} in {name}"


def frame_qualname(frame: types.FrameType) -> str:
    """The qualified name of the function ``frame`` runs (``Trainer.step``), on every Python.

    Before 3.11 the code object has no ``co_qualname``: the frame's first argument (``self``, ``cls``),
    read without writing anything (:func:`~gradguard._heap.frames.frame_locals`), and its globals
    say where the function is defined (:func:`gradguard._compat.code_qualname`).

    Args:
        frame: A frame.

    Returns:
        The qualified name; the bare name where the function cannot be found without running code.
    """
    code = frame.f_code
    if _compat.PYTHON_HAS_QUALNAME:
        return code_qualname(code)
    first: Any = UNKNOWN
    if code.co_argcount:
        for name, value in frame_locals(frame) or ():
            if name == code.co_varnames[0]:
                first = value
            break
    return code_qualname(code, first, frame.f_globals)


# --------------------------------------------------------------------------------------------------
# Reading, repairing, spelling
# --------------------------------------------------------------------------------------------------


def read(edge: Edge) -> Any:
    """The object ``edge`` leads to, read without calling user code (``LookupError`` if gone)."""
    owner, kind, key = edge.owner, edge.kind, edge.key
    if kind == "global":
        return module_dict(owner)[key]
    if kind == "class":
        return class_dict(owner)[key]
    if kind == "attr":
        return _attribute_table(owner, key)[key]
    if kind == "slot":
        return _slot(owner, key).__get__(owner, type(owner))
    if kind == "item":
        if is_a(owner, dict):
            return dict.__getitem__(owner, key)
        for base in (list, tuple, collections.deque):
            if is_a(owner, base):
                return base.__getitem__(owner, key)
        raise LookupError(f"an item of a {type(owner).__qualname__} cannot be read back")
    if kind == "local":
        for name, value in frame_locals(owner) or ():
            if name == key:
                return value
        raise LookupError(f"the frame has no local {key!r}")
    if kind == "cell":
        return owner.__closure__[owner.__code__.co_freevars.index(key)].cell_contents
    if kind == "key":
        return list(dict.keys(owner))[key]
    if kind == "named":  # gradguard._heap.roots
        return owner.resolve()
    if kind == "grad":
        return tensor_grad(owner)
    raise LookupError(f"an edge of kind {kind!r} cannot be read back")


def container(edge: Edge) -> Any:
    """The object that refers to what ``edge`` leads to where it is not the edge's owner: a module's globals,
    an instance's attribute table, a closure's cell; ``None`` where the owner refers to it itself, or the
    container cannot be read without the program's code."""
    owner, kind, key = edge.owner, edge.kind, edge.key
    try:
        if kind == "global":
            return module_dict(owner)
        if kind == "attr":
            return _attribute_table(owner, key)
        if kind == "cell":
            return owner.__closure__[owner.__code__.co_freevars.index(key)]
    except (LookupError, AttributeError, IndexError, TypeError, ValueError):
        return None
    return None


def tensor_grad(tensor: Any) -> Any:
    """``tensor.grad``, read as torch stores it (a subclass's own ``grad`` property is not called)."""
    return _GRAD.__get__(tensor, type(tensor))


def leaf_grad(tensor: Any) -> Any:
    """A leaf tensor's ``.grad`` as torch stores it; ``None`` for a tensor that is not a leaf and for one with
    no autograd state (the collector cleared it while something kept it alive: reading it raises)."""
    try:
        return tensor_grad(tensor) if tensor.is_leaf else None
    except RuntimeError:
        return None


def _attribute_table(owner: Any, key: str) -> dict[str, Any]:
    """The dict that holds attribute ``key`` of ``owner``: an ``nn.Module``'s parameter, buffer or
    submodule table when ``key`` is in one (so a buffer stays a buffer), else the instance dict.
    ``LookupError`` when the owner has no instance dict that can be read without its code."""
    namespace = instance_dict(owner)
    if namespace is None:
        raise LookupError(f"{type(owner).__qualname__} has no readable __dict__")
    if is_a(owner, nn.Module):
        for state in MODULE_STATE:
            table = namespace.get(state)
            if type(table) is dict and key in table:
                return table
    return namespace


def _slot(owner: Any, key: str) -> Any:
    """The member descriptor of slot ``key`` in ``owner``'s class hierarchy (``LookupError`` if none)."""
    for cls in type(owner).__mro__:
        descriptor = class_dict(cls).get(key)
        if type(descriptor) is types.MemberDescriptorType:
            return descriptor
    raise LookupError(f"{type(owner).__qualname__} has no slot {key!r}")


def writable(edge: Edge) -> bool:
    """Whether :func:`write` can replace what ``edge`` leads to: a global, a class attribute, an
    attribute or slot, an item of a list, deque or dict. Not a frame local, a closure cell, a tuple
    item, a dict key, a set member or any other reference."""
    if edge.kind in ("global", "class", "attr", "slot", "grad"):
        return True
    return edge.kind == "item" and is_a(edge.owner, (list, dict, collections.deque))


def write(edge: Edge, value: Any) -> None:
    """Replace what ``edge`` leads to with ``value``, in place, without the owner's user-level
    ``__setitem__``/``__setattr__`` (an ``nn.Module``'s parameter, buffer or submodule table is written
    directly, so a buffer stays a buffer). :class:`GradGuardError` when not :func:`writable`."""
    owner, kind, key = edge.owner, edge.kind, edge.key
    if not writable(edge):
        raise GradGuardError(f"gradguard cannot replace a {kind} in place ({spell((edge,))}); detach it at the source")
    if kind == "global":
        module_dict(owner)[key] = value
    elif kind == "class":
        type.__setattr__(owner, key, value)
    elif kind == "attr":
        try:
            table = _attribute_table(owner, key)
        except LookupError as error:
            raise GradGuardError(f"gradguard cannot write the attributes of a {type(owner).__qualname__}") from error
        table[key] = value
    elif kind == "grad":
        _GRAD.__set__(owner, value)
    elif kind == "slot":
        try:
            descriptor = _slot(owner, key)
        except LookupError as error:
            raise GradGuardError(f"gradguard cannot write the slot {key!r} of a {type(owner).__qualname__}") from error
        descriptor.__set__(owner, value)
    elif is_a(owner, dict):
        dict.__setitem__(owner, key, value)
    elif is_a(owner, list):
        list.__setitem__(owner, key, value)
    else:
        collections.deque.__setitem__(owner, key, value)


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
    if kind == "named":  # gradguard._heap.roots: "actor Trainer: self"
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
        if wildcard and type(key) is str and is_a(owner, dict):  # metrics[f"step{n}"]: one holder, not one per key
            return f"[{_short(_DIGITS.sub('*', key))}]"
        return f"[{_short(key)}]"
    if kind == "grad":
        return ".grad"
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
    """:func:`spell` with sequence indices, ``int`` dict keys and dict key positions as ``[*]``, the
    digits of ``str`` dict keys as ``*`` (``metrics['step*']``), an attribute repeated along the path
    as one (``head(.next)*.value``), and no line number: one string for all the records of one list
    (or of one dict keyed by step, or of one linked list), stable from one step to the next."""
    return _spell(path, wildcard=True)


def spell_steps(edges: Sequence[Edge]) -> str:
    """The steps of ``edges`` spelled after a name already written: ``.metrics['loss_sum']``."""
    return "".join(_spell_step(e, False) for e in edges)


def _spell(path: Sequence[Edge], wildcard: bool) -> str:
    if not path:
        return ""
    first = path[0]
    text = _spell_root(first, wildcard) if first.kind in ROOT_KINDS else _spell_step(first, wildcard)
    steps = [_spell_step(e, wildcard) for e in path[1:]]
    if wildcard:  # a linked list (node.next.next...): one holder whatever the depth of each record
        runs: list[str] = []
        for step in steps:
            if runs and step.startswith(".") and runs[-1] in (step, f"({step})*"):
                runs[-1] = f"({step})*"
            else:
                runs.append(step)
        steps = runs
    return text + "".join(steps)


def reaches(value: Any, target: Any) -> bool:
    """Whether ``target`` is reachable from ``value`` through references (``gc.get_referents``: no code
    of the objects runs). Tensors are not looked into: a detached tensor no longer holds its graph."""
    if value is target:
        return True
    skipped = untraversable()
    if id(value) in skipped:
        return False
    seen = {id(value), *skipped}
    stack = [value]
    while stack:
        obj = stack.pop()
        if _is_tensor(obj):
            continue
        for child in gc.get_referents(obj):
            if child is target:
                return True
            if id(child) not in seen and gc.is_tracked(child):
                seen.add(id(child))
                stack.append(child)
    return False


def _is_tensor(obj: Any) -> bool:
    return is_a(obj, _TENSOR)
