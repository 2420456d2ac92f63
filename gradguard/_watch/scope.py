"""The ways a watch is turned on: :func:`watch`, ``enforce(audit=...)`` and ``GRADGUARD_AUDIT``.

Each registers torch's global optimizer step post hook, which calls a :class:`Watcher`'s boundary
after every ``optimizer.step()``; the watcher follows backwards while its scope is entered.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Hashable
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from .._errors import GradGuardError
from .._scope.enforce import _Install, enforce, register_audit_installer
from .audit import Ignore
from .options import EVERY_ACCEPTED, Every, parse_every
from .trigger import TriggerSettings
from .watcher import Watcher

__all__ = ["AUDIT_ENV", "audit_install", "parse_audit", "start_process_watch", "stop_process_watch", "watch"]

AUDIT_ENV = "GRADGUARD_AUDIT"
_AUDIT_ACCEPTED = f"{EVERY_ACCEPTED}, or 0/off (no watch)"
_OFF_WORDS = frozenset({"0", "off", "false", "no", "none"})


def parse_audit(value: object, *, what: str = "audit") -> Every | None:
    """An ``audit=`` / ``GRADGUARD_AUDIT`` setting: ``every``, or ``None`` for no watch (0, ``off``).

    Raises:
        GradGuardError: for anything else (an empty string included), naming ``what`` and what is accepted.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in _OFF_WORDS):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return None
    return parse_every(value, what=what, accepted=_AUDIT_ACCEPTED)


class _WatchInstall(_Install):
    """torch's global optimizer step post hook, calling one watcher's boundary after every step."""

    def __init__(self, watcher: Watcher, key: Hashable) -> None:
        self.watcher = watcher
        self.key = key
        self.handle: RemovableHandle | None = None

    def install(self) -> None:
        self.watcher.start()
        self.handle = register_optimizer_step_post_hook(self._hook)

    def uninstall(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.watcher.close()

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.watcher.boundary(optimizer)


_serial = itertools.count(1)


def audit_install(audit: object) -> _Install | None:
    """``enforce(audit=...)``'s install: ``audit`` when given, else ``GRADGUARD_AUDIT`` unless the
    process watch already runs it; ``None`` for no watch. Scopes asking for the same ``every`` share
    one watcher (its mode is the scope's: ``None``)."""
    if audit is None:
        if _process_watch is not None:
            return None
        every = parse_audit(os.environ.get(AUDIT_ENV) or None, what=AUDIT_ENV)
    else:
        every = parse_audit(audit)
    if every is None:
        return None
    return _WatchInstall(Watcher(every=every), ("watch", f"audit={every}"))


register_audit_installer(audit_install)


class _ProcessWatch:
    """``GRADGUARD_AUDIT`` set when gradguard was imported: the process's watch. Its value is read at
    the first ``optimizer.step()`` (a bad one is refused there, after the step), then every step is
    that watcher's boundary."""

    def __init__(self) -> None:
        self.watcher: Watcher | None = None
        self.off = False
        try:  # a good value starts following backwards now; a bad one is refused at the first step
            self._make()
        except GradGuardError:
            pass
        self.handle = register_optimizer_step_post_hook(self._hook)

    def _make(self) -> None:
        every = parse_audit(os.environ.get(AUDIT_ENV) or None, what=AUDIT_ENV)
        if every is None:
            self.off = True
        else:
            self.watcher = Watcher(every=every)
            self.watcher.start()

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.watcher is None and not self.off:
            self._make()
        if self.watcher is not None:
            self.watcher.boundary(optimizer)

    def stop(self) -> None:
        self.handle.remove()
        if self.watcher is not None:
            self.watcher.close()


_process_watch: _ProcessWatch | None = None


def start_process_watch() -> None:
    """At import: the process watch, when ``GRADGUARD_AUDIT`` is set (to anything: it is parsed at the
    first step)."""
    global _process_watch
    if _process_watch is None and os.environ.get(AUDIT_ENV, "").strip():
        _process_watch = _ProcessWatch()


def stop_process_watch() -> None:
    """``gradguard run`` runs its own watch from the same setting: the process watch stops."""
    global _process_watch
    if _process_watch is not None:
        _process_watch.stop()
        _process_watch = None


class watch(enforce):
    """Watch the optimizer steps of any ``torch.optim.Optimizer``, and act on leaks.

    A :class:`Watcher` whose boundary runs from torch's global optimizer step post hook, registered
    while the scope is entered: in a ``with`` block, or around a decorated function (for a coroutine
    function while it runs, for a generator or async generator function from its first resumption to
    its end). Nestable and re-entrant: each scope's hook is removed exactly when it leaves, the
    enclosing ones stay. In ``raise`` mode the :class:`GraphRetentionError` comes out of the
    ``optimizer.step()`` call, after the step completed.

    Args:
        every: ``"auto"`` or a positive ``int``, as for :class:`Watcher`.
        mode: ``"warn"``, ``"raise"``, ``"detach"``, ``"off"``, or ``None`` (the mode in force).
        ignore: Path prefixes or a predicate, as for :func:`gradguard.audit`.
        memory: ``True``, ``False`` or a :class:`TriggerSettings`, as for :class:`Watcher`.

    Attributes:
        watcher: The :class:`Watcher` (its :meth:`~Watcher.summary`, its :meth:`~Watcher.history`).

    Raises:
        GradGuardError: a bad argument, naming it and what is accepted.
    """

    def __init__(
        self,
        every: int | str = "auto",
        mode: str | None = None,
        ignore: Ignore = None,
        memory: bool | TriggerSettings | None = True,
    ) -> None:
        super().__init__(mode=None, engines="none", audit=0)
        self.watcher = Watcher(every=every, mode=mode, ignore=ignore, memory=memory)
        self._installs = [_WatchInstall(self.watcher, ("watch", f"#{next(_serial)}"))]

    def __enter__(self) -> watch:
        super().__enter__()
        return self

    def __repr__(self) -> str:
        w = self.watcher
        return f"gradguard.watch(every={w.every!r}, mode={w.mode!r})"
