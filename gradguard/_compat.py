"""Version facts: every private torch or CPython internal gradguard leans on, read in one place.

Each accessor says which versions it was checked on and what it does elsewhere; none crashes and
none is a silent no-op on a version that lacks the internal (``docs/support.md`` has the table and
the degraded modes). Checked on CPython 3.10.13, 3.11.7, 3.12.1 and 3.13.0 with torch 2.13.0, and
on CPython 3.11.7 with torch 2.4.1 (the declared floor) and 2.14.1. The ``ctypes`` reader of frame
locals keeps its own layout check (``gradguard._heap.frames``): it reads nothing where the layout
does not match.

Facts that are not accessors: :data:`SAVED_TENSORS_READABLE` (torch >= 2.13 shows a saved tensor's
packed data and unpack hook without unpacking it), :data:`PYTHON_HAS_QUALNAME` (3.11 added
``co_qualname``), :func:`untraversable` (modules whose ``tp_traverse`` a CPython release breaks).
"""

from __future__ import annotations

import gc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._C import _functorch
from torch.utils import _pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._errors import GradGuardWarning

__all__ = [
    "PYTHON_HAS_QUALNAME",
    "SAVED_TENSORS_READABLE",
    "TORCH_VERSION",
    "UNKNOWN",
    "code_qualname",
    "degraded",
    "current_sequence_nr",
    "execution_engine",
    "functorch_interpreter",
    "functorch_unwrapped",
    "is_traceable_wrapper_subclass",
    "node_metadata",
    "pytree_keystr",
    "pytree_nodes",
    "register_pytree_node",
    "sequence_nr",
    "is_namedtuple_class",
    "is_structseq_class",
    "referrers",
    "saved_tensor_parts",
    "untraversable",
    "warning_module_globals",
]

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])  # type: ignore[assignment]
PYTHON_HAS_QUALNAME = sys.version_info >= (3, 11)

UNKNOWN: Any = object()
"""What :func:`saved_tensor_parts` returns for a saved tensor this torch cannot show without unpacking."""

_Py_TPFLAGS_BASETYPE = 1 << 10


# --------------------------------------------------------------------------------------------------
# torch.utils._pytree: the tuple-kind predicates exist from torch 2.8; the same tests elsewhere
# --------------------------------------------------------------------------------------------------


def _is_structseq_class(cls: type) -> bool:
    return (
        isinstance(cls, type)
        and cls.__bases__ == (tuple,)
        and isinstance(getattr(cls, "n_fields", None), int)
        and isinstance(getattr(cls, "n_sequence_fields", None), int)
        and isinstance(getattr(cls, "n_unnamed_fields", None), int)
        and not bool(cls.__flags__ & _Py_TPFLAGS_BASETYPE)
    )


def _is_namedtuple_class(cls: type) -> bool:
    fields = getattr(cls, "_fields", None)
    return (
        isinstance(cls, type)
        and issubclass(cls, tuple)
        and isinstance(fields, tuple)
        and all(type(f) is str for f in fields)
        and callable(getattr(cls, "_make", None))
        and callable(getattr(cls, "_asdict", None))
    )


is_structseq_class: Callable[[type], bool] = getattr(_pytree, "is_structseq_class", _is_structseq_class)
"""Whether ``cls`` is a structseq (``torch.return_types.*``, ``os.stat_result``): torch's test from
2.8, the same test written here before."""

is_namedtuple_class: Callable[[type], bool] = getattr(_pytree, "is_namedtuple_class", _is_namedtuple_class)
"""Whether ``cls`` is a ``collections.namedtuple``/``typing.NamedTuple`` class: torch's test from 2.8,
the same test written here before."""


# --------------------------------------------------------------------------------------------------
# Saved tensors: their packed data and unpack hook are readable without unpacking from torch 2.13
# --------------------------------------------------------------------------------------------------

SAVED_TENSORS_READABLE: bool = hasattr(torch._C._autograd.SavedTensor, "unpack_hook")
_hooks_seen = False  # before 2.13: saved-tensor hooks were set since gradguard was imported


def _seen(install: Callable[..., Any]) -> Callable[..., Any]:
    def seen(*args: Any, **kwargs: Any) -> Any:
        global _hooks_seen
        _hooks_seen = True
        return install(*args, **kwargs)

    seen.__wrapped__ = install  # type: ignore[attr-defined]
    return seen


if not SAVED_TENSORS_READABLE:
    # The only two ways a saved tensor gets hooks: default hooks pushed (saved_tensors_hooks, and so
    # checkpointing and offloading) and SavedTensor.register_hooks. Each is noted, then runs as it did.
    torch._C._autograd._push_saved_tensors_default_hooks = _seen(torch._C._autograd._push_saved_tensors_default_hooks)
    saved_tensor: Any = torch._C._autograd.SavedTensor  # its stubs lack register_hooks on some versions
    saved_tensor.register_hooks = _seen(saved_tensor.register_hooks)


def saved_tensor_parts(saved: Any) -> tuple[Any, Any]:
    """What a raw saved tensor (``node._raw_saved_self``) holds, read without unpacking it.

    Checked on torch 2.13 and 2.14 (``SavedTensor.data``, ``SavedTensor.unpack_hook``). Earlier torch
    builds (checked: 2.4 to 2.12) show neither: the data is :data:`UNKNOWN`, and so is the unpack hook
    once any saved-tensor hook was set since gradguard was imported (``saved_tensors_hooks``,
    checkpointing, offloading, ``register_hooks``). Until then no saved tensor has one, and unpacking
    it (``node._saved_self``) runs nothing but torch's own checks.

    Args:
        saved: A ``torch._C._autograd.SavedTensor``.

    Returns:
        ``(data, unpack_hook)``: the tensor, or the pack hook's result where a hook packed it, and the
        unpack hook or ``None``; ``UNKNOWN`` for what this torch cannot tell.
    """
    if not SAVED_TENSORS_READABLE:
        return UNKNOWN, (UNKNOWN if _hooks_seen else None)
    return getattr(saved, "data", None), saved.unpack_hook


_SAVED_TENSORS_DEGRADED = (
    "once a saved-tensor hook was set (saved_tensors_hooks, checkpointing, offloading), saved tensors are not "
    "counted in a graph's memory and a graph that still has them is judged alive"
)
_said: set[str] = set()


def degraded(feature: str) -> None:
    """Say once per process that ``feature`` runs in its degraded mode on this torch or Python.

    Args:
        feature: ``"saved tensors"``: :data:`SAVED_TENSORS_READABLE` is false and a hook was set.
    """
    if feature in _said:
        return
    _said.add(feature)
    if feature == "saved tensors":
        warnings.warn(
            f"gradguard: torch {torch.__version__} cannot show a saved tensor without unpacking it (torch >= 2.13 "
            f"can), and gradguard never unpacks one: {_SAVED_TENSORS_DEGRADED}. Install torch>=2.13 for both "
            "(see the support table in gradguard's documentation).",
            GradGuardWarning,
            stacklevel=2,
        )


def execution_engine() -> Any:
    """torch's autograd engine object (``torch.autograd.Variable._execution_engine``).

    Checked on torch 2.4 to 2.14 (``queue_callback`` included).

    Returns:
        The engine; its ``queue_callback(fn)`` runs ``fn`` when the running backward ends.
    """
    return torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]


def node_metadata(node: Any) -> dict[Any, Any] | None:
    """An autograd node's ``metadata`` dict (checked on torch 2.4 to 2.14); ``None`` where it has none.

    Args:
        node: An autograd node (``tensor.grad_fn``).

    Returns:
        The node's own dict, or ``None`` where the node has no such dict.
    """
    try:
        metadata = node.metadata
    except (AttributeError, RuntimeError):
        return None
    return metadata if type(metadata) is dict else None


def sequence_nr(node: Any) -> int | None:
    """An autograd node's creation number in its thread (``node._sequence_nr()``, checked on torch 2.4 to 2.14).

    Args:
        node: An autograd node.

    Returns:
        The number, or ``None`` where the node has none.
    """
    read = getattr(node, "_sequence_nr", None)
    return read() if callable(read) else None


def current_sequence_nr() -> int:
    """The number the next autograd node of this thread gets (``torch.autograd._get_sequence_nr``, checked
    on torch 2.4 to 2.14).

    Returns:
        The number.
    """
    return int(torch.autograd._get_sequence_nr())  # type: ignore[attr-defined]


def functorch_interpreter() -> Any:
    """The innermost functorch transform running now (``vmap``, ``grad``), or ``None`` (checked on torch 2.4 to 2.14).

    Returns:
        torch's interpreter object, or ``None`` outside every transform.
    """
    return _functorch.peek_interpreter_stack()


def functorch_unwrapped(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor a functorch wrapper (``vmap``'s batched tensor) wraps; ``None`` for any other tensor
    (checked on torch 2.4 to 2.14).

    Args:
        t: A tensor.

    Returns:
        The wrapped tensor, or ``None``.
    """
    return _functorch.get_unwrapped(t) if _functorch.is_functorch_wrapped_tensor(t) else None


def pytree_nodes() -> dict[type, Any]:
    """The types registered with ``torch.utils._pytree`` and their node definitions (``flatten_fn``,
    ``unflatten_fn``, ``flatten_with_keys_fn``: checked on torch 2.4 to 2.14).

    Returns:
        torch's own table, to be read only.
    """
    return _pytree.SUPPORTED_NODES


def pytree_keystr(key: Any) -> str:
    """The path segment torch spells for one pytree key (``['a']``, ``[0]``, ``.x``; checked on torch 2.4 to 2.14).

    Args:
        key: A key from a node's ``flatten_with_keys_fn``.

    Returns:
        The segment.
    """
    return str(_pytree.keystr((key,)))


def register_pytree_node(cls: type, flatten: Callable[..., Any], unflatten: Callable[..., Any]) -> None:
    """Register ``cls`` with ``torch.utils._pytree`` (checked on torch 2.4 to 2.14).

    Args:
        cls: The class.
        flatten: ``obj -> (children, context)``.
        unflatten: ``(children, context) -> obj``.
    """
    _pytree.register_pytree_node(cls, flatten, unflatten)


# --------------------------------------------------------------------------------------------------
# CPython
# --------------------------------------------------------------------------------------------------


def code_qualname(code: types.CodeType, first_argument: Any = UNKNOWN, namespace: Any = None) -> str:
    """The qualified name of the function running ``code`` (``Trainer.step``).

    Python 3.11 and later keep it on the code object (``co_qualname``). On 3.10 the function is
    looked up without calling anything: in the class of ``first_argument`` (``self`` or ``cls``, its
    MRO's own dicts), in ``namespace`` (the frame's globals), then among the live functions that run
    ``code`` (a nested function's); where none is found the bare name is returned.

    Args:
        code: The code object.
        first_argument: The frame's first argument, where it has one (``UNKNOWN`` otherwise).
        namespace: The frame's globals, or ``None``.

    Returns:
        The qualified name, or ``code.co_name``.
    """
    if PYTHON_HAS_QUALNAME:
        return str(code.co_qualname)  # type: ignore[attr-defined]
    if first_argument is not UNKNOWN and code.co_argcount:
        cls = first_argument if issubclass(type(first_argument), type) else type(first_argument)
        for klass in type.__dict__["__mro__"].__get__(cls):
            found = _runs(type.__dict__["__dict__"].__get__(klass).get(code.co_name), code)
            if found is not None:
                return found
    if isinstance(namespace, dict):
        found = _runs(namespace.get(code.co_name), code)
        if found is not None:
            return found
    return _nested_qualname(code)


_nested: dict[types.CodeType, str] = {}


def _nested_qualname(code: types.CodeType) -> str:
    """A nested function's qualified name on 3.10: a function object running ``code`` found among its
    referrers (one heap pass, remembered per code object)."""
    name = _nested.get(code)
    if name is None:
        found = [r for r in gc.get_referrers(code) if type(r) is types.FunctionType and r.__code__ is code]
        name = found[0].__qualname__ if found else code.co_name
        if len(_nested) >= 1024:
            _nested.clear()
        _nested[code] = name
        found.clear()
    return name


def _runs(candidate: Any, code: types.CodeType) -> str | None:
    """``candidate``'s qualified name where it (or what a static/class method or property wraps) runs ``code``."""
    if isinstance(candidate, (staticmethod, classmethod)):
        candidate = candidate.__func__
    elif isinstance(candidate, property):
        candidate = next((f for f in (candidate.fget, candidate.fset, candidate.fdel) if _code_of(f) is code), None)
    if _code_of(candidate) is code:
        return str(candidate.__qualname__)  # type: ignore[union-attr]
    return None


def _code_of(fn: Any) -> Any:
    return fn.__code__ if isinstance(fn, types.FunctionType) else None


def referrers(objects: list[Any]) -> list[Any]:
    """``gc.get_referrers(*objects)`` without the call's own argument tuple.

    CPython 3.13 tracks the tuple ``*objects`` is passed in before the heap pass, and returns it as
    a referrer of every object (checked on 3.13.0); 3.10 to 3.12 do not. It is left out by identity.

    Args:
        objects: The objects whose referrers are wanted.

    Returns:
        Every object of the heap that refers to one of ``objects``, the argument tuple excepted.
    """
    args = tuple(objects)
    found = gc.get_referrers(*args)
    if sys.version_info >= (3, 13):
        found = [r for r in found if r is not args]
    return found


def untraversable() -> frozenset[int]:
    """Ids of the loaded modules whose referents this CPython must not be asked for.

    CPython 3.12.0 to 3.12.5: ``gc.get_referents(_asyncio)`` returns the module's free list of
    future iterators, raw memory taken for objects; holding them corrupts the heap and a later
    ``gc.get_referrers`` never returns (fixed in 3.12.6). A heap search leaves such a module out.

    Returns:
        The ``id`` of each such module that is loaded; empty on every other version.
    """
    if (3, 12) <= sys.version_info[:3] < (3, 12, 6):
        module = sys.modules.get("_asyncio")
        if module is not None:
            return frozenset({id(module)})
    return frozenset()


def warning_module_globals(namespace: dict[str, Any]) -> dict[str, Any] | None:
    """The globals ``warnings.warn_explicit`` may be given to read a warning's source line, or ``None``.

    From 3.12, ``warn_explicit(module_globals=g)`` reads ``g["__spec__"].loader`` and raises
    ``ValueError`` where a ``__spec__`` has none (``runpy.run_path``, as debuggers run a script), and
    a ``DeprecationWarning`` (an error under ``-W error``) where the loader is only in ``__loader__``.
    ``python -m pkg.mod``'s ``__main__`` has a loader that serves only ``pkg.mod``, and ``python -c``'s
    the builtin importer, which refuses to give source. Without globals the line is read from the file.

    Args:
        namespace: The warning site's module globals.

    Returns:
        ``namespace`` where every Python reads its source through it without raising; ``None`` otherwise.
    """
    spec = namespace.get("__spec__")
    loader = namespace.get("__loader__")
    if spec is None:  # a script's __main__ (python t.py, python -c)
        usable = loader is not None and loader is not importlib.machinery.BuiltinImporter
        return namespace if usable and sys.version_info < (3, 12) else None
    if getattr(spec, "name", None) != namespace.get("__name__"):
        return None
    spec_loader = getattr(spec, "loader", None)
    if spec_loader is None or spec_loader is importlib.machinery.BuiltinImporter or loader is not spec_loader:
        return None
    return namespace
