"""Patching with wrapt, restored exactly: ``uninstall`` puts back the very object ``install`` replaced.

An attribute that lived on a base class or on the class of an instance (a method reached through an
instance) is patched as an override on ``owner`` and removed again on uninstall, so ``owner``'s own
namespace ends exactly as it began.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

from .wrapper import Wrapper, function_wrapper

__all__ = ["install", "installed", "is_installed", "uninstall"]

logger = logging.getLogger("gradguard")
_lock = threading.RLock()
_patched: dict[tuple[int, str], tuple[Any, Any, Any]] = {}  # (id(owner), attr) -> (owner, original, wrapper)
_INHERITED = object()  # the attribute was not in owner's own namespace: uninstall deletes the override


def _current(owner: Any, attr: str) -> Any:
    # For classes read the class __dict__ (along the MRO): a staticmethod/classmethod descriptor
    # must come back as is.
    return inspect.getattr_static(owner, attr) if isinstance(owner, type) else getattr(owner, attr)


def _own(owner: Any, attr: str) -> bool:
    namespace = getattr(owner, "__dict__", None)
    return namespace is not None and attr in namespace


def install(owner: Any, attr: str, wrapper: Wrapper) -> None:
    """Replace ``owner.attr`` with a ``wrapt.FunctionWrapper`` calling ``wrapper(wrapped, instance, args, kwargs)``."""
    with _lock:
        if (id(owner), attr) in _patched:
            return
        current = _current(owner, attr)
        original = current if _own(owner, attr) else _INHERITED
        replacement = function_wrapper(current, wrapper)
        setattr(owner, attr, replacement)
        _patched[(id(owner), attr)] = (owner, original, replacement)


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


def installed() -> set[tuple[str, str]]:
    """``(owner, attribute)`` names of every patch in place now (tests: nothing left behind)."""
    with _lock:
        entries = [(owner, attr) for (_, attr), (owner, _, _) in _patched.items()]
    return {(_name(owner), attr) for owner, attr in entries}


def _name(owner: Any) -> str:
    return str(getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or repr(owner))


def is_installed(owner: Any, attr: str) -> bool:
    """Whether ``owner.attr`` is currently gradguard's patch."""
    with _lock:
        return (id(owner), attr) in _patched
