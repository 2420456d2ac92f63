"""The heap search's lock: one search at a time in the process, with the program's other threads held.

A search lists every object of the collector and every referrer of the tensors it follows. Among them
may be a tuple another thread is still building (``tuple(generator)`` allocates it, then fills it while
the generator runs Python code, then resizes it, which CPython refuses, and may then corrupt memory,
when anything else holds a reference to it). So while a search holds such lists, no other thread of the
program may run Python code: Python switches threads only after its switch interval, which the lock
raises for as long as it is held, and nothing a search runs releases the interpreter lock. Threads in
native code (a torch operator) go on; they wait for the search, as for a collection, only to run Python.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType

__all__ = ["SearchLock", "search_lock", "work_clock"]

_HELD = 3600.0  # seconds: longer than any search


class SearchLock:
    """A re-entrant lock whose holder runs alone: the switch interval is raised while it is held, and put
    back exactly as it was when the outermost hold ends."""

    __slots__ = ("_depth", "_interval", "_lock", "_waits")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._interval = 0.0
        self._waits = threading.local()

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock (``blocking=False``: only if free now, or already this thread's).

        Args:
            blocking: Whether to wait for another thread's search to end.

        Returns:
            Whether it is held now.
        """
        start = time.perf_counter()
        if not self._lock.acquire(blocking):
            return False
        self._depth += 1
        if self._depth == 1:
            self._interval = interval = sys.getswitchinterval()
            sys.setswitchinterval(_HELD)
            if threading.active_count() > 1:
                _settle(interval)
            self._waits.seconds = self.waited() + time.perf_counter() - start
        return True

    def waited(self) -> float:
        """Seconds the calling thread waited in all to take the lock: for another thread's search, and for
        the hand-over before its own (the program's other threads run meanwhile)."""
        return getattr(self._waits, "seconds", 0.0)

    def release(self) -> None:
        """Let one hold go; the outermost puts the switch interval back."""
        self._depth -= 1
        if self._depth == 0:
            sys.setswitchinterval(self._interval)
        self._lock.release()

    def owned(self) -> bool:
        """Whether the calling thread holds it."""
        return self._lock._is_owned()  # type: ignore[attr-defined]

    def locked(self) -> bool:
        """Whether any thread holds it."""
        return self._depth > 0

    def __enter__(self) -> SearchLock:
        self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()


def _settle(interval: float) -> None:
    """Hand the interpreter lock over for ``interval`` (the one in force before): a thread already waiting
    for it waits under that interval and would ask for it back once that went by. Woken by this release,
    or seeing that another thread had the lock since it began waiting, it waits under the new one."""
    time.sleep(interval)


search_lock = SearchLock()
"""The process's one: a search running next to another would also see the other's tables (lists of every
object) as referrers, and slow down many times over."""


def work_clock() -> float:
    """The calling thread's clock for the watch's own work: the wall time less the time it waited for the
    search lock (another thread's search is that thread's work, charged once). Only spans measured in one
    thread compare."""
    return time.perf_counter() - search_lock.waited()
