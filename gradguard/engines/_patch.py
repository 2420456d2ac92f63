"""Patching with wrapt, restored exactly: ``uninstall`` puts back the very object ``install`` replaced."""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

from .._wrapper import Wrapper, function_wrapper

__all__ = ["arg_index", "install", "is_installed", "replace_arg", "uninstall"]

logger = logging.getLogger("gradguard")
_lock = threading.RLock()
_patched: dict[tuple[int, str], tuple[Any, Any, Any]] = {}  # (id(owner), attr) -> (owner, original, wrapper)


_INHERITED = object()  # marks a class attribute that lived on a base class: uninstall deletes the override


def _current(owner: Any, attr: str) -> Any:
    # For classes read the class __dict__ (along the MRO): a staticmethod/classmethod descriptor
    # must come back as is.
    return inspect.getattr_static(owner, attr) if isinstance(owner, type) else getattr(owner, attr)


def install(owner: Any, attr: str, wrapper: Wrapper, direct: Wrapper | None = None) -> None:
    """Replace ``owner.attr`` with a ``wrapt.FunctionWrapper`` calling ``wrapper(wrapped, instance, args, kwargs)``.

    ``direct``, when given, serves the unbound calls of a plain function instead (one gradguard frame
    more between the caller and it: see :func:`gradguard._wrapper.function_wrapper`). A method a class
    inherits is wrapped on that class; ``uninstall`` then removes the override.
    """
    with _lock:
        if (id(owner), attr) in _patched:
            return
        current = _current(owner, attr)
        inherited = isinstance(owner, type) and attr not in vars(owner)
        replacement = function_wrapper(current, wrapper, direct)
        setattr(owner, attr, replacement)
        _patched[(id(owner), attr)] = (owner, _INHERITED if inherited else current, replacement)


def uninstall(owner: Any, attr: str) -> None:
    """Put back the original object; leaves a later patch by someone else in place (and says so)."""
    with _lock:
        entry = _patched.pop((id(owner), attr), None)
        if entry is None:
            return
        _, original, replacement = entry
        if _current(owner, attr) is replacement:
            if original is _INHERITED:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        else:
            logger.warning("gradguard: %r.%s was re-patched by someone else; leaving it in place", owner, attr)


def is_installed(owner: Any, attr: str) -> bool:
    with _lock:
        return (id(owner), attr) in _patched


def arg_index(func: Callable[..., Any], name: str) -> int:
    """Positional index of parameter ``name`` in ``func``'s signature (``ValueError`` if absent)."""
    names = list(inspect.signature(func).parameters)
    if name not in names:
        raise ValueError(f"{getattr(func, '__qualname__', func)} has no parameter {name!r} (it has {names})")
    return names.index(name)


def replace_arg(
    args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, fn: Callable[[Any], Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` with the argument at ``index`` / keyword ``name`` replaced by ``fn(value)``."""
    if name in kwargs:
        kwargs = {**kwargs, name: fn(kwargs[name])}
    elif index < len(args):
        args = (*args[:index], fn(args[index]), *args[index + 1 :])
    return args, kwargs
