"""The call site: the first frame that is neither gradguard's nor wrapt's.

One rule serves every caller (stores, the decorator, the engine adapters, warnings): walk out from
the current frame past every frame whose code lives in gradguard's or wrapt's own files. No caller
counts frames, so adding a helper inside gradguard can never shift an attribution.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from collections.abc import Callable

import wrapt

from .._compat import warning_module_globals
from .._heap.installed import program_frame

__all__ = ["caller", "location", "set_origin", "user_frame", "warn_at"]

_origin: Callable[[], str | None] | None = None

_PACKAGE = sys.modules[__name__.partition(".")[0]]  # gradguard itself, whichever folder this module is in
_OWN = tuple(os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in (_PACKAGE, wrapt))


class _Internal(dict[str, bool]):
    """filename -> whether it is one of gradguard's or wrapt's files."""

    def __missing__(self, filename: str) -> bool:
        flag = self[filename] = os.path.abspath(filename).startswith(_OWN) if filename[:1] != "<" else False
        return flag


_internal = _Internal()


def caller() -> types.FrameType | None:
    """The frame that called into gradguard.

    Returns:
        The innermost frame outside gradguard and wrapt, or ``None`` when there is none (a call from C).
    """
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None and _internal[frame.f_code.co_filename]:
        frame = frame.f_back
    return frame


def user_frame() -> types.FrameType | None:
    """The frame of the program's own code that led here.

    Returns:
        The innermost frame outside gradguard, wrapt, torch, the standard library and installed packages
        (accelerate's or transformers' wrapper around ``optimizer.step()``); the innermost frame outside
        gradguard and wrapt when every frame is a library's; ``None`` without one.
    """
    first = caller()
    return program_frame(first) or first


def location(frame: types.FrameType | None) -> str:
    """Where a frame is.

    Args:
        frame: A frame, or ``None``.

    Returns:
        ``file:line`` of ``frame``; ``<unknown>`` without one.
    """
    return "<unknown>" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def set_origin(origin: Callable[[], str | None] | None) -> None:
    """Say where this process's warnings come from.

    ``gradguard run`` sets it in every process it reaches but the command's own.

    Args:
        origin: Read at each warning; a text it returns prefixes the message in brackets (``[rank 1/2,
            pid 4242 on node-3] gradguard: ...``). ``None`` (the default), or an empty text: no prefix.
    """
    global _origin
    _origin = origin


def warn_at(message: str, category: type[Warning], frame: types.FrameType | None) -> None:
    """``warnings.warn`` attributed to a frame, as a ``stacklevel`` pointing there would be.

    The frame's module registry is used, so ``"default"``/``"once"`` filters and pytest's capture
    behave as for any warning raised at that line.

    Args:
        message: The warning's text; prefixed by the origin, when one is set (:func:`set_origin`).
        category: The warning's class.
        frame: The frame it is attributed to (``None``: ``<unknown>``).
    """
    tag = None if _origin is None else _origin()
    if tag:
        message = f"[{tag}] {message}"
    if frame is None:
        warnings.warn_explicit(message, category, "<unknown>", 0)
        return
    namespace = frame.f_globals
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=namespace.get("__name__"),
        registry=namespace.setdefault("__warningregistry__", {}),
        module_globals=warning_module_globals(namespace),
    )
