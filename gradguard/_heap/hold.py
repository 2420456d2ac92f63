"""The heap search's lock: one search at a time in the process, with the program's other threads held.

A search lists every object of the collector and every referrer of the tensors it follows. Among them
may be a tuple another thread is still building (``tuple(generator)`` allocates it, then fills it while
the generator runs Python code, then resizes it, which CPython refuses, and may then corrupt memory,
when anything else holds a reference to it). So while a search holds such lists, no other thread of the
program may run Python code: Python switches threads only after its switch interval, which the lock
raises for as long as it is held, and nothing a search runs releases the interpreter lock (what it needs
from the operating system is read as the hold begins, before it holds anything: :func:`before_search`). Threads in
native code (a torch operator) go on; they wait for the search, as for a collection, only to run Python.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

__all__ = ["SearchLock", "before_search", "search_lock", "work_clock", "working_directory"]

_F = TypeVar("_F", bound=Callable[[], object])
_BEFORE: list[Callable[[], object]] = []

_HELD = 3600.0  # seconds: longer than any search
# Seconds a search waits for the backwards running in other threads: one that waits for something this thread
# holds (a lock the program took around its step) would never end; the search goes on after this.
_BACKWARDS = 1.0


class SearchLock:
    """A re-entrant lock whose holder runs alone: the switch interval is raised while it is held, and put
    back exactly as it was when the outermost hold ends; backwards told of (:meth:`backward_starts`) run
    before or after a search, never beside it."""

    __slots__ = ("_depth", "_gate", "_interval", "_lock", "_pending", "_running", "_waits", "cwd")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._interval = 0.0
        self._waits = threading.local()
        # Re-entrant: an idle look runs in a signal handler of the main thread, which may hold the gate then.
        self._gate = threading.Condition(threading.RLock())
        self._pending = 0  # searches waiting or running (written under the gate)
        self._running: dict[int, int] = {}  # the threads running a backward (each writes its own key only)
        self.cwd = ""
        """The working directory, read as the outermost hold began."""

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock (``blocking=False``: only if free now, or already this thread's).

        Args:
            blocking: Whether to wait for another thread's search to end.

        Returns:
            Whether it is held now.
        """
        start = time.perf_counter()
        outermost = not self.owned()
        if outermost:
            # What a search needs from the operating system is read now, before it holds anything: such a call
            # releases the interpreter lock, and the program's threads would run while it held their objects.
            cwd = os.getcwd()
            for fetch in _BEFORE:
                fetch()
            if not self._hold_backwards(blocking):
                return False
        if not self._lock.acquire(blocking):
            if outermost:
                self._let_backwards_go()
            return False
        self._depth += 1
        if outermost:
            self.cwd = cwd
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
        """Let one hold go; the outermost puts the switch interval back and lets the backwards start again."""
        self._depth -= 1
        outermost = self._depth == 0
        if outermost:
            sys.setswitchinterval(self._interval)
        self._lock.release()
        if outermost:
            self._let_backwards_go()

    def backward_starts(self) -> None:
        """An outermost backward starts in the calling thread: while another thread's search is pending or
        running, it waits for that search to end (the search reads the graphs' saved tensors, which the
        autograd engine frees as it runs, with no lock of theirs)."""
        ident = threading.get_ident()
        running = self._running
        while True:
            running[ident] = 1  # marked first: a search pending from now on waits for it, or sees it give way
            if not self._pending or self.owned():
                return
            del running[ident]
            with self._gate:
                self._gate.notify_all()
                while self._pending:
                    self._gate.wait()

    def backward_ends(self) -> None:
        """The calling thread's outermost backward ended."""
        self._running.pop(threading.get_ident(), None)
        if self._pending:
            with self._gate:
                self._gate.notify_all()

    def _hold_backwards(self, blocking: bool) -> bool:
        """Mark a search pending (backwards that start wait for it), then wait for those running in other
        threads to end, for up to :data:`_BACKWARDS` seconds; ``blocking=False``: give up at once if any
        runs. Returns whether the search may go on."""
        me = threading.get_ident()
        with self._gate:
            self._pending += 1
            deadline = time.perf_counter() + _BACKWARDS
            while any(ident != me for ident in list(self._running)):
                left = deadline - time.perf_counter()
                if not blocking:
                    self._pending -= 1
                    self._gate.notify_all()
                    return False
                if left <= 0:
                    break
                self._gate.wait(left)
        return True

    def _let_backwards_go(self) -> None:
        with self._gate:
            self._pending -= 1
            self._gate.notify_all()

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


def before_search(fetch: _F) -> _F:
    """Register ``fetch`` (a cached reading of the operating system's, such as the directories packages are
    installed in) to run as every search begins, before it holds anything; returns it unchanged.

    Args:
        fetch: A callable of no argument whose later calls read nothing from the operating system.

    Returns:
        ``fetch``.
    """
    _BEFORE.append(fetch)
    return fetch


def working_directory() -> str:
    """The working directory: while the calling thread holds the search lock, as it was when the hold began
    (reading it again would release the interpreter lock)."""
    return search_lock.cwd if search_lock.owned() else os.getcwd()
