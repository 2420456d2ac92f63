"""The idle look: a program that has run no backward and stepped no optimizer, looked at when its memory grows.

An evaluation loop in grad mode keeping its predictions, a simulation chaining ``state = step(state)``,
rollout post-processing without ``no_grad``: graphs pile up and neither clock ever ticks. One daemon thread
serves every watcher that has seen no boundary of either clock yet: every :data:`PERIOD` seconds it reads
the memory figure, and when the low-water rise rule fires (:mod:`gradguard._watch.trigger`), the watcher
looks: every graph tensor alive, and who holds it (:meth:`gradguard._watch.watcher.Watcher._idle_look`).
Once a look found holders, the next time the figure grows they are read by name first (no heap pass); a
look follows only when none of them grew.
What a look sees is only noted; the verdict comes when the watch ends (its scope's exit, the process's
exit), and only if no backward ran meanwhile: a holder whose graphs grew from one look to the next (more
graph tensors, or more graph nodes) kept graphs that nothing used. A first step's forwards (a GPipe
schedule's, a long forward) grow the same way, but a backward follows them and retires the look.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Protocol

from .allocated import AllocatedReader
from .audit import scan_lock
from .trigger import Trigger, TriggerSettings
from .tuning import IDLE_PERIOD

__all__ = ["PERIOD", "Looked", "follow", "following", "retire"]

PERIOD = IDLE_PERIOD

_ALONE = 3600.0  # seconds: longer than any look


class Looked(Protocol):
    """What the idle thread asks of a watcher (:class:`gradguard._watch.watcher.Watcher`)."""

    def ticked(self) -> bool: ...

    def _idle_read(self) -> bool: ...

    def _idle_look(self) -> bool: ...


_lock = threading.Lock()
_watchers: weakref.WeakKeyDictionary[Looked, _Figure] = weakref.WeakKeyDictionary()
_thread: threading.Thread | None = None
_wake = threading.Event()


class _Figure:
    """One watcher's memory figure and its rule, between looks."""

    __slots__ = ("reader", "trigger")

    def __init__(self) -> None:
        self.reader = AllocatedReader()
        self.trigger = Trigger(TriggerSettings())


def follow(watcher: Looked) -> None:
    """Look at ``watcher``'s process while it has seen no boundary (until it retires: see :func:`retire`)."""
    global _thread
    with _lock:
        if watcher in _watchers:
            return
        _watchers[watcher] = _Figure()
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="gradguard-idle", daemon=True)
            _thread.start()


def retire(watcher: Looked) -> None:
    """No more looks for ``watcher`` (it saw a boundary, or it closed)."""
    with _lock:
        _watchers.pop(watcher, None)


def following() -> int:
    """How many watchers are looked at now (tests: nothing left behind)."""
    with _lock:
        return len(_watchers)


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    """The program's threads wait while a look or a read runs (as they do for a collection): what the census
    listed must still be what the frames hold when the search reads them. Python switches threads only
    after this interval, and nothing a look runs releases the interpreter lock (the search's lock is taken
    before, without waiting)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(_ALONE)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def _run() -> None:
    global _thread
    while True:
        _wake.wait(PERIOD)
        with _lock:
            pairs = list(_watchers.items())
            if not pairs:
                _thread = None  # the next watcher to follow starts another
                return
        for watcher, figure in pairs:
            if watcher.ticked():
                retire(watcher)
                continue
            readings = figure.reader()
            if not readings or figure.trigger.observe(readings) is None:
                continue
            if not scan_lock.acquire(blocking=False):
                continue  # an audit runs now (it stamps what it sees): the next rise asks again
            try:
                with _alone():
                    found = watcher._idle_read() or watcher._idle_look()
            except Exception:  # noqa: BLE001 - a look must never end the program: it is only not taken
                found = False
            finally:
                scan_lock.release()
            figure.trigger.audited(found)
        del pairs, watcher, figure  # between looks, the thread keeps no watcher alive
