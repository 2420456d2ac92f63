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

__all__ = ["GRAPH_NODES", "MEMORY", "PINNED_BYTES", "MissingFrameworkError", "WatchedRun", "import_framework"]

MEMORY = "gradguard/memory"
GRAPH_NODES = "gradguard/graph_nodes"
PINNED_BYTES = "gradguard/pinned_bytes"

logger = logging.getLogger("gradguard")


class MissingFrameworkError(GradGuardError, ImportError):
    """A ``gradguard.integrations`` module was imported without its framework installed."""


MissingFrameworkError.__module__ = "gradguard.integrations"


def import_framework(module: str, distribution: str, extra: str) -> types.ModuleType:
    """A training framework, imported for a callback module.

    Args:
        module: The module to import (``lightning.pytorch``).
        distribution: The package that provides it (``lightning``).
        extra: gradguard's extra that installs it (``lightning``).

    Returns:
        The module.

    Raises:
        MissingFrameworkError: it does not import; names the extra to install.
    """
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

    At the end of training the watcher's summary goes to ``logging.getLogger("gradguard")``: a warning
    when an audit found a leak, else at info level.

    Args:
        mode: ``"warn"``, ``"raise"``, ``"detach"``, ``"off"``, or ``None`` for gradguard's effective mode.
        every: ``"auto"`` or a positive ``int``, as for :func:`gradguard.watch`.
        ignore: Path prefixes or a predicate, for graphs kept on purpose (as for :func:`gradguard.audit`).
        memory: ``True`` reads the memory figure, a :class:`gradguard.TriggerSettings` sets its rule,
            ``False`` reads none (as for :func:`gradguard.watch`).

    Attributes:
        watcher: This training run's :class:`gradguard.Watcher` (its ``summary()``, ``history()``,
            ``boundaries`` and ``audits``); a new one at each start of training.
        last_report: The most recent audit's report of leaks (``None`` before the first audit).

    Raises:
        GradGuardError: a bad option, at construction, naming it and what is accepted.
    """

    def __init__(
        self,
        mode: str | None = None,
        every: int | str = "auto",
        ignore: Ignore = None,
        memory: bool | TriggerSettings = True,
    ) -> None:
        self._options: dict[str, Any] = {"mode": mode, "every": every, "ignore": ignore, "memory": memory}
        self.watcher = Watcher(**self._options)
        self.last_report: RetentionReport | None = None

    def restart(self) -> None:
        """A fresh watch: what survived a previous run's boundaries says nothing about this one."""
        self.watcher = Watcher(**self._options)
        self.last_report = None

    def boundary(self, step: int) -> tuple[float, float] | None:
        """One optimizer-step boundary of the run's watcher.

        Args:
            step: The framework's global step, for the log line.

        Returns:
            ``(holders, pinned bytes)`` of the leaks when the boundary was audited, else ``None``.
        """
        report = self.watcher.boundary()
        if report is None:
            return None
        self.last_report = report
        holders, pinned = len(report), int(report.pinned_bytes)
        if holders:
            logger.info("step %d: %d holder(s) retain autograd graphs pinning %d bytes", step, holders, pinned)
        return float(holders), float(pinned)

    def scalars(self) -> dict[str, float]:
        """The figures the callbacks log through the framework's own logger.

        Returns:
            ``gradguard/memory`` (bytes in use at the watch's latest boundary: CUDA's allocated bytes where
            CUDA is used, else the CPU figure), ``gradguard/graph_nodes`` (graph nodes alive then, else those
            of the leaking holders at their last audit) and ``gradguard/pinned_bytes`` (what the leaking
            holders' graphs pinned at their last audit); a figure that cannot be read is left out.
        """
        timeline = getattr(self.watcher, "timeline", None)
        latest = timeline.latest() if timeline is not None else None
        history = self.watcher.history()
        memory = latest["memory"] if latest is not None else None
        if memory is None:
            from .._watch.allocated import in_use

            memory = in_use()
        nodes = latest["nodes"] if latest is not None else None
        if nodes is None:
            nodes = sum(h.nodes for h in history)
        found = {GRAPH_NODES: float(nodes), PINNED_BYTES: float(sum(h.pinned_bytes for h in history))}
        if memory is not None:
            found[MEMORY] = float(memory)
        return found

    def finish(self) -> None:
        """The watch's summary to ``logging.getLogger("gradguard")``: a warning when a leak was found."""
        logger.log(logging.WARNING if self.watcher.history() else logging.INFO, "%s", self.watcher.summary())
