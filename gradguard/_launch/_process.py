"""A process the bootstrap reached: gradguard set up in it, and its report kept current.

:func:`setup` runs once per process, from the bootstrap, right after the program's ``import torch``:

* ``enforce()`` is entered for the rest of the process (the engine adapters; the mode is the one in
  force, ``GRADGUARD`` unless the program says otherwise), and the watch with ``GRADGUARD_RUN_AUDIT``'s
  ``every`` (none for ``0``); a ``GRADGUARD_AUDIT`` process watch is stopped first, so there is one;
* the holder search starts at the Ray actor's instance when this process runs one (``_actor``);
* the watch's warnings and errors carry where they come from (``[rank 1/2, pid 4242 on node-3]``),
  except in the command ``gradguard run`` started, unless that one has a rank;
* the report is written at once (the process was reached), after each audit (before a ``raise``
  leaves ``optimizer.step()``) and at exit.

A forked child inherits all of it, already set up; at the fork it takes a report file of its own and
counts from the fork on, and it writes only once it has a boundary of its own (a DataLoader worker
never does); a multiprocessing fork child, which ends with ``os._exit``, writes at its end through
multiprocessing's own finalizers. A problem here is said on stderr and in the report, never raised into the program.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from .._errors import GradGuardError
from .._policy.modes import get_mode
from .._policy.site import set_origin
from .._policy.stats import SiteStats, stats
from .._scope.compile import skip_in_dynamo
from .._scope.enforce import Scope
from .._watch.scope import enforce, stop_process_watch, watch
from .._watch.summary import HolderHistory, WatchFigures
from .._watch.watcher import Watcher
from . import _actor
from ._identity import HOST, identify, started
from ._names import file_name
from ._report import Baseline, content, write
from ._settings import Settings

__all__ = ["setup", "retire"]

_lock = threading.Lock()
_TIMELINE_EVERY = 10.0  # seconds between two makings of the report's timeline
_current: _Process | None = None


def setup(environ: Mapping[str, str] | None = None) -> None:
    """Set this process up for the run (the module documentation says what); a second call does nothing.

    Args:
        environ: Where the run's settings are read (``os.environ`` by default).
    """
    global _current
    with _lock:
        if _current is None:
            _current = _Process(Settings(environ))
            _current.start()


def retire() -> None:
    """This process only launches (``gradguard run`` started inside a reached process): its report is
    removed and no longer written."""
    with _lock:
        if _current is not None:
            _current.retire()


class _Process:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.lock = threading.Lock()
        self.errors: list[str] = list(settings.errors)
        self.watcher: Watcher | None = None
        self.scopes: list[Scope] = []
        self.base = Baseline()
        self.forked = False  # a fork child: writes once it has a boundary of its own
        self.retired = False
        self.at_exit = False
        self.said: set[str] = set()
        # what the last report was made of, as the watcher and stats() gave it: a fork child's baseline
        self.last: tuple[WatchFigures | None, list[HolderHistory], dict[tuple[str, str], SiteStats]] = (None, [], {})
        self.started = started()
        self.path = os.path.join(settings.report_dir, file_name(settings.run, HOST, os.getpid()))
        self.timeline: tuple[float, dict[str, Any]] | None = None  # when the report's timeline was made, and it

    def start(self) -> None:
        skip_in_dynamo()  # as `import gradguard` does once the program uses it: compiled code calls gradguard eagerly
        stop_process_watch()
        try:
            self._enter(enforce(audit=0))
        except GradGuardError as exc:
            self.errors.append(f"enforce() was not entered: {exc}")
        if self.settings.every is not None:
            scope = watch(every=self.settings.every)
            self._enter(scope)
            self.watcher = scope.watcher
            self.watcher.on_audit(self._after_audit)
        _actor.provide_roots()
        set_origin(self.tag)
        try:
            os.makedirs(self.settings.report_dir, exist_ok=True)
        except OSError as exc:
            self.errors.append(f"cannot create the report folder: {exc}")
        for error in self.errors:
            self._say(f"gradguard: {error}")
        self.write()
        atexit.register(self._exiting)
        os.register_at_fork(after_in_child=self._forked)

    def _enter(self, scope: Scope) -> None:
        scope.__enter__()  # left only when the process ends
        self.scopes.append(scope)

    # ---------------------------------------------------------------------------------------------

    def top(self) -> bool:
        """Whether this is the command ``gradguard run`` started (its direct child)."""
        return self.settings.parent is not None and os.getppid() == self.settings.parent

    def tag(self) -> str | None:
        identity = identify()
        if self.top() and identity.rank is None and identity.actor is None:
            return None
        return identity.tag

    def write(self) -> None:
        with self.lock:
            if self.retired:
                return
            try:
                mode: str = get_mode()
            except GradGuardError as exc:
                mode = "?"
                if str(exc) not in self.errors:
                    self.errors.append(str(exc))
            watcher = self.watcher
            figures = None if watcher is None else watcher.figures()
            holders = [] if watcher is None else [*watcher.history(), *watcher.bounded()]
            counted = dict(stats())
            self.last = (figures, holders, counted)
            report = content(
                identify(),
                run=self.settings.run,
                started=self.started,
                top=self.top(),
                every=self.settings.every,
                mode=mode,
                figures=figures,
                holders=holders,
                stats=counted,
                base=self.base,
                at_exit=self.at_exit,
                error="; ".join(self.errors) or None,
                timeline=self._timeline(watcher),
            )
            try:
                write(self.path, report)
            except OSError as exc:
                self._say(f"gradguard: cannot write this process's report {self.path!r}: {exc}")

    def _timeline(self, watcher: Watcher | None) -> dict[str, Any] | None:
        """The watcher's timeline for the report, made again at most every ``_TIMELINE_EVERY`` seconds
        (and at exit): a full one takes milliseconds to make and to write, and audits may come often."""
        timeline = getattr(watcher, "timeline", None)
        if timeline is None:
            return None
        now = time.monotonic()
        if self.at_exit or self.timeline is None or now - self.timeline[0] >= _TIMELINE_EVERY:
            self.timeline = (now, timeline.to_dict())
        return self.timeline[1]

    def _say(self, line: str) -> None:
        if line not in self.said:
            self.said.add(line)
            print(line, file=sys.stderr, flush=True)

    # ---------------------------------------------------------------------------------------------

    def _after_audit(self, watcher: Watcher, error: BaseException | None) -> None:
        try:
            if isinstance(error, GradGuardError) and error.args and isinstance(error.args[0], str):
                tag = self.tag()
                if tag and not error.args[0].startswith(f"[{tag}]"):
                    error.args = (f"[{tag}] {error.args[0]}", *error.args[1:])
            self.forked = False  # it has an audit of its own now
            self.write()
        except Exception as exc:  # noqa: BLE001 - the report must never break the program's optimizer.step()
            self._say(f"gradguard: this process's report was not updated: {type(exc).__name__}: {exc}")

    def _exiting(self) -> None:
        self.at_exit = True
        watcher = self.watcher
        if watcher is not None:
            try:  # a process that ran no backward and stepped no optimizer: what its idle looks saw
                error = watcher.conclude()
            except Exception as exc:  # noqa: BLE001 - at exit: said, not raised
                error = None
                self._say(f"gradguard: the watch's last verdict failed: {type(exc).__name__}: {exc}")
            if error is not None:
                self._say(str(error))
        if self.forked and (watcher is None or watcher.boundaries == self.base.figures.boundaries):
            return  # a fork child that never stepped (a DataLoader worker): nothing of its own to say
        try:
            self.write()
        except Exception as exc:  # noqa: BLE001 - at exit: said, not raised
            self._say(f"gradguard: this process's report was not written at exit: {type(exc).__name__}: {exc}")

    def _forked(self) -> None:
        """In the child, right after the fork: nothing here takes a lock (see ``Baseline``)."""
        self.lock = threading.Lock()  # another thread may have held the parent's at the fork
        self.forked = True
        self.at_exit = False
        self.base = Baseline.of(self.watcher, *self.last)
        self.started = started()
        self.path = os.path.join(self.settings.report_dir, file_name(self.settings.run, HOST, os.getpid()))
        util = sys.modules.get("multiprocessing.util")
        if util is not None:
            # multiprocessing's fork children end with os._exit, after its finalizers, never atexit's: one that
            # writes at the end too, not only at the last audit (registered once multiprocessing has cleared
            # the finalizers the child inherited)
            util.register_after_fork(self, _Process._write_at_the_end)

    def _write_at_the_end(self) -> None:
        sys.modules["multiprocessing.util"].Finalize(None, self._exiting, exitpriority=0)

    def retire(self) -> None:
        with self.lock:
            self.retired = True
            try:
                os.remove(self.path)
            except OSError:
                pass
