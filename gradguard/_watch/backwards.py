"""Every backward the process starts, seen with its roots: where the watch stamps the graphs it will age.

torch runs every backward through ``Variable._execution_engine.run_backward``: ``Tensor.backward``,
``torch.autograd.backward`` and ``torch.autograd.grad`` call it, and so do engines that drive the
autograd engine themselves (Megatron-core's ``custom_backward``). While a listener is registered,
that attribute is a ``wrapt.ObjectProxy`` of the engine whose ``run_backward`` calls each listener
with the root tensors, then the engine; everything else (``queue_callback``,
``is_checkpoint_valid``) goes to the engine untouched. A listener's exception is swallowed (seeing a
backward must never change it) and counted (:func:`failures`), for the watch's summary to say. When
the last listener leaves, the engine object is put back exactly, unless someone else replaced the
attribute since (then the proxy stays, passing every call through).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import wrapt
from torch.autograd.variable import Variable

__all__ = ["Handle", "Listener", "failures", "listen", "listening"]

logger = logging.getLogger("gradguard")

Listener = Callable[[Sequence[Any]], None]
"""Called with the root tensors of a backward, in the thread that starts it, before it runs."""

_lock = threading.Lock()
_listeners: tuple[Listener, ...] = ()  # replaced, never mutated: run_backward reads it without the lock
_installed: _Engine | None = None
_failures = 0  # listener calls that raised, in this process


class _Engine(wrapt.ObjectProxy):  # type: ignore[misc]
    """The autograd engine, with the listeners told of each backward's roots first."""

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        listeners = _listeners
        if listeners:
            roots = args[0] if args else kwargs.get("tensors", ())
            for listener in listeners:
                try:
                    listener(roots)
                except Exception:  # noqa: BLE001 - the backward must run as if nothing looked
                    _failed()
        return self.__wrapped__.run_backward(*args, **kwargs)


class Handle:
    """Removes one listener; idempotent."""

    def __init__(self, listener: Listener) -> None:
        self._listener: Listener | None = listener

    def remove(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            _remove(listener)


def listen(listener: Listener) -> Handle:
    """Call ``listener(roots)`` at the start of every backward until the handle's ``remove()``."""
    global _listeners, _installed
    with _lock:
        _listeners = (*_listeners, listener)
        if _installed is None:
            engine = Variable._execution_engine
            _installed = engine if isinstance(engine, _Engine) else _Engine(engine)
            Variable._execution_engine = _installed  # type: ignore[assignment]
    return Handle(listener)


def _failed() -> None:
    global _failures
    _failures += 1
    logger.debug("gradguard: a backward listener failed", exc_info=True)


def failures() -> int:
    """How many listener calls raised so far in this process (each is counted, and logged at DEBUG)."""
    return _failures


def listening() -> int:
    """How many listeners are registered now (tests: nothing left behind)."""
    return len(_listeners)


def _remove(listener: Listener) -> None:
    global _listeners, _installed
    with _lock:
        kept = list(_listeners)
        if listener in kept:
            kept.remove(listener)
        _listeners = tuple(kept)
        if kept or _installed is None:
            return
        if Variable._execution_engine is _installed:
            Variable._execution_engine = _installed.__wrapped__
        else:
            logger.warning(
                "gradguard: torch.autograd.Variable._execution_engine was replaced by someone else; leaving it in place"
            )
        _installed = None
