"""The idle look: a program that has run no backward and stepped no optimizer, looked at when its memory grows.

An evaluation loop in grad mode keeping its predictions, a simulation chaining ``state = step(state)``,
rollout post-processing without ``no_grad``: graphs pile up and neither clock ever ticks. One daemon thread
serves every watcher that has seen no boundary of either clock yet: every :data:`PERIOD` seconds it reads
the memory figure (nothing of the program's), and when the low-water rise rule fires
(:mod:`gradguard._watch.trigger`) it asks the **main thread** to look, as a signal handler would run there:
between two of its bytecodes, with the other threads held still. A census of the heap taken from the reading
thread itself would hold references to objects the program's thread is still building (a tuple being
filled cannot be resized while another reference holds it); taken in the program's own thread, every
reference it takes is dropped before that thread goes on.

A look: every graph tensor alive, and who holds it (:meth:`gradguard._watch.watcher.Watcher._idle_look`).
Once a look found holders, the next time the figure grows they are read by name first (no heap pass); a
look follows only when none of them grew. What a look sees is only noted; the verdict comes when the watch
ends (its scope's exit, the process's exit), and only if no backward ran meanwhile: a holder whose graphs
grew from one look to the next (more graph tensors, or more graph nodes) kept graphs that nothing used. A
first step's forwards (a GPipe schedule's, a long forward) grow the same way, but a backward follows them
and retires the look.

Only the main thread is looked at (signal handlers run there), only where the interpreter has the signal
this uses (``SIGURG``, ignored by default: a real one, which no program here is sent, is ignored as
before) and while nothing else handles it.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
import weakref
from types import FrameType
from typing import Protocol

from .._heap.hold import search_lock
from .allocated import AllocatedReader
from .trigger import Trigger, TriggerSettings
from .tuning import IDLE_PERIOD

__all__ = ["PERIOD", "Looked", "follow", "following", "retire"]

PERIOD = IDLE_PERIOD

_SIGNAL: signal.Signals | None = getattr(signal, "SIGURG", None)


class Looked(Protocol):
    """What the idle looks ask of a watcher (:class:`gradguard._watch.watcher.Watcher`)."""

    def ticked(self) -> bool: ...

    def _idle_read(self) -> bool: ...

    def _idle_look(self) -> bool: ...


class _Figure:
    """One watcher's memory figure and its rule, between looks; ``asked``: a look was asked of the main
    thread and has not run yet (the figure is not read meanwhile)."""

    __slots__ = ("asked", "reader", "trigger")

    def __init__(self) -> None:
        self.reader = AllocatedReader()
        self.trigger = Trigger(TriggerSettings())
        self.asked = False


_lock = threading.Lock()
_watchers: weakref.WeakKeyDictionary[Looked, _Figure] = weakref.WeakKeyDictionary()
_thread_running: threading.Thread | None = None
_wake = threading.Event()
_previous: object = None  # the signal's handler before this module's, put back when no watcher is followed


def follow(watcher: Looked) -> None:
    """Look at ``watcher``'s process while it has seen no boundary (until it retires: see :func:`retire`).
    Nothing happens unless this is the main thread and the signal is free."""
    global _thread_running
    if threading.current_thread() is not threading.main_thread():
        return
    with _lock:
        if watcher in _watchers or not _handle():
            return
        _watchers[watcher] = _Figure()
        if _thread_running is None or not _thread_running.is_alive():
            _thread_running = threading.Thread(target=_run, name="gradguard-idle", daemon=True)
            _thread_running.start()


def retire(watcher: Looked) -> None:
    """No more looks for ``watcher`` (it saw a boundary, or it closed). The signal's handler is put back once
    no watcher is followed, when this runs in the main thread (a handler can be set only there)."""
    with _lock:
        _watchers.pop(watcher, None)
        if not _watchers and threading.current_thread() is threading.main_thread():
            _unhandle()


def following() -> int:
    """How many watchers are looked at now (tests: nothing left behind)."""
    with _lock:
        return len(_watchers)


def _handle() -> bool:
    """Handle the signal (call with ``_lock``, in the main thread); whether it is this module's now."""
    global _previous
    if _SIGNAL is None:
        return False
    try:
        current = signal.getsignal(_SIGNAL)
        if current is _serve:
            if _previous is None:  # put back by the program after the watch let it go: it was the default
                _previous = signal.SIG_DFL
            return True
        if current is not signal.SIG_DFL:
            return False  # the program handles it: its handler is never replaced
        signal.signal(_SIGNAL, _serve)
        signal.siginterrupt(_SIGNAL, False)  # a real one restarts the system call it interrupted
    except (ValueError, OSError):  # not the main interpreter, or no such signal here
        return False
    _previous = current
    return True


def _unhandle() -> None:
    global _previous
    if _SIGNAL is None or _previous is None:
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(_SIGNAL) is _serve:
            signal.signal(_SIGNAL, _previous)  # type: ignore[arg-type]
    _previous = None


def _run() -> None:
    """The reading thread: the memory figure of each watcher followed; a rise asks the main thread to look."""
    global _thread_running
    while True:
        _wake.wait(PERIOD)
        with _lock:
            pairs = list(_watchers.items())
            if not pairs:
                _thread_running = None  # the next watcher to follow starts another
                return
        ask = False
        for watcher, figure in pairs:
            if watcher.ticked():
                retire(watcher)
                continue
            if figure.asked:
                continue
            readings = figure.reader()
            if readings and figure.trigger.observe(readings) is not None:
                figure.asked = ask = True
        del pairs, watcher, figure  # between looks, the thread keeps no watcher alive
        # Asked only while the handler is this module's: a program that took the signal over since gets none
        # of these (its own handler is never called by the watch).
        if ask and _SIGNAL is not None and signal.getsignal(_SIGNAL) is _serve:
            _thread.interrupt_main(_SIGNAL)


def _serve(signum: int, frame: FrameType | None) -> None:
    """The signal's handler, in the main thread: the looks asked for. It never raises into the program, and
    never waits for a lock: it runs between two bytecodes of the main thread, which may be inside gradguard
    itself holding one (then the look is not taken; the next rise asks again)."""
    try:
        pairs = [(w, f) for w, f in list(_watchers.items()) if f.asked]
    except RuntimeError:  # the table changed while it was copied: the next rise asks again
        return
    for watcher, figure in pairs:
        found = False
        # The search lock holds the program's other threads while the look runs (see gradguard._heap.hold).
        if not search_lock.owned() and search_lock.acquire(blocking=False):
            try:
                found = not watcher.ticked() and (watcher._idle_read() or watcher._idle_look())
            except Exception:  # noqa: BLE001 - a look must never end the program: it is only not taken
                found = False
            finally:
                search_lock.release()
        figure.trigger.audited(found)
        figure.asked = False
    del pairs
