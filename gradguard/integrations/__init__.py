"""Training-framework callbacks that run gradguard's step-boundary watch in the framework's own conventions.

- ``gradguard.integrations.lightning.GradGuardCallback``: a Lightning ``Callback``;
- ``gradguard.integrations.transformers.GradGuardCallback``: a Hugging Face ``TrainerCallback``.

Each module imports its framework when it is imported itself; ``import gradguard`` and
``import gradguard.integrations`` import neither. A framework that is not installed is a
:class:`MissingFrameworkError` (an ``ImportError`` too) naming the extra to install.
"""

from __future__ import annotations

import importlib
import logging
import types
from typing import Any

from .._errors import GradGuardError
from .._watch.audit import Ignore, RetentionReport
from .._watch.trigger import TriggerSettings
from .._watch.watcher import Watcher

__all__ = ["MissingFrameworkError", "WatchedRun", "import_framework"]

logger = logging.getLogger("gradguard")


class MissingFrameworkError(GradGuardError, ImportError):
    """A ``gradguard.integrations`` module was imported without its framework installed."""


MissingFrameworkError.__module__ = "gradguard.integrations"


def import_framework(module: str, distribution: str, extra: str) -> types.ModuleType:
    """``module`` imported, or the :class:`MissingFrameworkError` for ``gradguard.integrations.<extra>``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingFrameworkError(
            f"gradguard.integrations.{extra} needs {distribution}, but `import {module}` failed: {exc!r}. "
            f"Install it with `pip install 'gradguard[{extra}]'` (or `pip install {distribution}`), "
            "or drop the callback."
        ) from exc


class WatchedRun:
    """What both callbacks keep: one :class:`gradguard.Watcher` per training run, and gradguard's log lines.

    ``watcher`` is the run's watcher; ``last_report`` the most recent audit's report of leaks (``None``
    before the first audit). The options are the watch's own (``mode``, ``every``, ``ignore``,
    ``memory``, as :func:`gradguard.watch` takes them); a bad one is refused at construction.
    """

    def __init__(self, mode: str | None, every: int | str, ignore: Ignore, memory: bool | TriggerSettings) -> None:
        self._options: dict[str, Any] = {"mode": mode, "every": every, "ignore": ignore, "memory": memory}
        self.watcher = Watcher(**self._options)
        self.last_report: RetentionReport | None = None

    def restart(self) -> None:
        """A fresh watch: what survived a previous run's boundaries says nothing about this one."""
        self.watcher = Watcher(**self._options)
        self.last_report = None

    def boundary(self, step: int) -> tuple[float, float] | None:
        """One optimizer-step boundary: ``(holders, pinned bytes)`` of the leaks when it was audited."""
        report = self.watcher.boundary()
        if report is None:
            return None
        self.last_report = report
        holders, pinned = len(report), int(report.pinned_bytes)
        if holders:
            logger.info("step %d: %d holder(s) retain autograd graphs pinning %d bytes", step, holders, pinned)
        return float(holders), float(pinned)

    def finish(self) -> None:
        """The watch's summary to ``logging.getLogger("gradguard")``: a warning when a leak was found."""
        logger.log(logging.WARNING if self.watcher.history() else logging.INFO, "%s", self.watcher.summary())
