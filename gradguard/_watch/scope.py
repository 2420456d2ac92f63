"""The ways a watch is turned on: :class:`watch`, :class:`enforce` with ``audit=``, and ``GRADGUARD_AUDIT``.

Both are scopes of :mod:`gradguard._scope.enforce`; the watch is one more :class:`Install` of theirs
(:class:`WatchInstall`): torch's global optimizer step post hook, calling a :class:`Watcher`'s boundary
after every ``optimizer.step()``, registered while the scope is entered.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from .._errors import GradGuardError
from .._policy import validate
from .._scope.enforce import Install, Scope, engine_installs, store_installs
from .audit import Ignore
from .trigger import TriggerSettings
from .watcher import Watcher

__all__ = ["AUDIT_ENV", "WatchInstall", "enforce", "start_process_watch", "stop_process_watch", "watch"]

AUDIT_ENV = "GRADGUARD_AUDIT"


class WatchInstall(Install):
    """torch's global optimizer step post hook, calling one watcher's boundary after every step.

    Args:
        watcher: The watcher; started on install, closed on uninstall.
        key: Scopes whose watch installs have equal keys share one (:class:`Install`).
    """

    def __init__(self, watcher: Watcher, key: Hashable) -> None:
        self.watcher = watcher
        self.key = key
        self.handle: RemovableHandle | None = None

    def install(self) -> None:
        """Start the watcher and register the hook."""
        self.watcher.start()
        self.handle = register_optimizer_step_post_hook(self.watcher.stepped)

    def uninstall(self) -> None:
        """Remove the hook and close the watcher."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.watcher.close()


def _audit_installs(audit: int | str | None) -> list[Install]:
    """``enforce(audit=...)``'s watch: ``audit`` when given, else ``GRADGUARD_AUDIT`` unless the process
    watch already runs it; none for no watch. Scopes asking for the same ``every`` share one watcher (its
    mode is the scope's: ``None``)."""
    if audit is None:
        if _process_watch is not None:
            return []
        every = validate.audit(os.environ.get(AUDIT_ENV) or None, what=AUDIT_ENV)
    else:
        every = validate.audit(audit)
    if every is None:
        return []
    return [WatchInstall(Watcher(every=every), ("watch", f"audit={every}"))]


class enforce(Scope):
    """Guard engines and stores inside a ``with`` block, or around a decorated function.

    As a decorator it scopes the function's body: for a coroutine function while it runs, for a
    generator (or async generator) function each time it resumes, the installs held from its start to
    its end. Re-entrant, nestable, exception-safe; safe to enter from several threads at once.

    Args:
        mode: The mode inside: ``"off"``, ``"detach"``, ``"warn"``, ``"raise"`` (aliases as everywhere
            in gradguard); ``None`` keeps the enclosing one.
        engines: ``"auto"`` (every known adapter), ``"none"``, or names from ``gradguard.engines.KNOWN``.
        stores: ``{"pkg.module:function": "arg_name"}`` (``function`` may be ``Class.method``, or
            ``obj.method`` of a module-level object): that argument of every call is guarded, in place;
            a name the function is bound to elsewhere by ``from pkg.module import function`` is patched too.
        audit: Also run the step-boundary watch inside (:class:`watch` with this ``every``, in the
            scope's mode): a positive ``int`` or ``"auto"``; ``0`` or ``"off"``: none; ``None`` (the
            default): the ``GRADGUARD_AUDIT`` environment variable, read here. Scopes asking for the
            same ``every`` share one watch.

    Raises:
        GradGuardError: a bad argument (``GRADGUARD_AUDIT`` included), naming it and what is accepted;
            on entering, a ``stores`` target that cannot be resolved.
    """

    def __init__(
        self,
        mode: str | None = None,
        engines: str | Iterable[str] | None = "auto",
        stores: Mapping[str, str] | None = None,
        audit: int | str | None = None,
    ) -> None:
        super().__init__(mode, [*engine_installs(engines), *store_installs(stores), *_audit_installs(audit)])


_serial = itertools.count(1)


class watch(Scope):
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
        self.watcher = Watcher(every=every, mode=mode, ignore=ignore, memory=memory)
        super().__init__(None, [WatchInstall(self.watcher, ("watch", f"#{next(_serial)}"))])

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        error, self.watcher._idle_error = self.watcher._idle_error, None
        if error is not None and exc_info[0] is None:
            raise error  # the idle looks' verdict in raise mode: graphs that grew, which no backward used

    def __repr__(self) -> str:
        w = self.watcher
        return f"gradguard.watch(every={w.every!r}, mode={w.mode!r})"


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
        # Every step of the process comes through here: the watcher's own hook when it exists already.
        hook = self.watcher.stepped if self.watcher is not None else self._hook
        self.handle = register_optimizer_step_post_hook(hook)

    def _make(self) -> None:
        every = validate.audit(os.environ.get(AUDIT_ENV) or None, what=AUDIT_ENV)
        if every is None:
            self.off = True
        else:
            self.watcher = Watcher(every=every)
            self.watcher.start()

    def _hook(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
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
