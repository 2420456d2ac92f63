"""Every backward the process starts, seen with its roots: where the watch stamps the graphs it will age,
and, once a backward returned, the micro-batch boundary it is.

torch runs every backward through ``Variable._execution_engine.run_backward``: ``Tensor.backward``,
``torch.autograd.backward`` and ``torch.autograd.grad`` call it, and so do engines that drive the
autograd engine themselves (Megatron-core's ``custom_backward``). While a listener is registered,
that attribute is a ``wrapt.ObjectProxy`` of the engine whose ``run_backward`` calls each listener
with the root tensors and whether the backward is *nested* (started while another one runs in the same
thread: a reentrant checkpoint's recomputation), then the engine; everything else (``queue_callback``,
``is_checkpoint_valid``) goes to the engine untouched. A listener may return a callable: for a backward
that is not nested, it is called once the engine returned, in the same thread, so what it raises comes out
of ``backward()`` with the gradients already computed. A listener's exception is swallowed (seeing a
backward must never change it) and counted (:func:`failures`), for the watch's summary to say; so is
an exception of what it returned, but a :class:`~gradguard.GraphRetentionError` (the ``raise`` mode's
verdict), which propagates. When the last listener leaves, the engine object is put back exactly, unless
someone else replaced the attribute since (then the proxy stays, passing every call through).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import wrapt
from torch.autograd.variable import Variable

from .._errors import GraphRetentionError
from .._heap.hold import search_lock

__all__ = ["After", "Handle", "Listener", "failures", "listen", "listening"]

logger = logging.getLogger("gradguard")

After = Callable[[], None]
"""What a listener asks to run once a backward that is not nested returned."""

Listener = Callable[[Sequence[Any], bool], "After | None"]
"""Called with the root tensors of a backward and whether it is nested, in the thread that starts it,
before it runs."""

_lock = threading.Lock()
_listeners: tuple[Listener, ...] = ()  # replaced, never mutated: run_backward reads it without the lock
_installed: _Engine | None = None
_failures = 0  # listener calls that raised, in this process
_depth = threading.local()  # backwards running in this thread now


class _Engine(wrapt.ObjectProxy):  # type: ignore[misc]
    """The autograd engine, with the listeners told of each backward's roots first."""

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        listeners = _listeners
        if not listeners:
            return self.__wrapped__.run_backward(*args, **kwargs)
        roots = args[0] if args else kwargs.get("tensors", ())
        depth = getattr(_depth, "n", 0)
        after: list[After] = []
        for listener in listeners:
            try:
                then = listener(roots, depth > 0)
            except Exception:  # noqa: BLE001 - the backward must run as if nothing looked
                _failed()
            else:
                if then is not None and not depth:
                    after.append(then)
        _depth.n = depth + 1
        if not depth:
            search_lock.backward_starts()
        try:
            result = self.__wrapped__.run_backward(*args, **kwargs)
        finally:
            _depth.n = depth
            if not depth:
                search_lock.backward_ends()
        for then in after:
            try:
                then()
            except GraphRetentionError:
                raise
            except Exception:  # noqa: BLE001 - the backward ran: only the watch's verdict may come out of it
                _failed()
        return result


class Handle:
    """Removes one listener; idempotent."""

    def __init__(self, listener: Listener) -> None:
        self._listener: Listener | None = listener

    def remove(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            _remove(listener)


def listen(listener: Listener) -> Handle:
    """Call ``listener(roots, nested)`` at the start of every backward until the handle's ``remove()``; what it
    returns, if anything, once a backward that is not nested returned."""
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
