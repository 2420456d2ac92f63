"""Every exception and warning gradguard raises or emits.

This module sits at the bottom of the package so that the pure layers (the tree walk, the graph
inspection) can raise gradguard errors without importing policy.
"""

from __future__ import annotations

__all__ = [
    "GradGuardError",
    "GradGuardWarning",
    "GraphRetentionError",
    "GraphRetentionWarning",
    "LossContractError",
    "LossContractWarning",
]


class GradGuardError(RuntimeError):
    """Base class of every error gradguard raises."""


class GraphRetentionError(GradGuardError):
    """An autograd graph is kept where ``raise`` mode forbids it.

    Raised by a guarded store or an engine adapter when a record that still carries a graph reaches
    it (the store is left exactly as it was before the refused call), and by the step-boundary watch
    (:class:`gradguard.Watcher`) when a holder kept a graph past the boundaries the criterion allows.

    Attributes:
        report (RetentionReport): Set only when the watch raised: every leak it found at that boundary.
    """


class LossContractError(GradGuardError):
    """The loss that will be back-propagated cannot produce the gradients training expects."""


class GradGuardWarning(UserWarning):
    """Base class of every warning gradguard emits."""


class GraphRetentionWarning(GradGuardWarning):
    """A record that still carried an autograd graph reached a guarded store in ``warn`` mode.

    The record was detached before it was stored; the warning is emitted once per call site.
    """


class LossContractWarning(GradGuardWarning):
    """A loss contract violation, or a check that could not decide, reported as a warning.

    Emitted where the loss check's graph walk cannot decide (:func:`gradguard.check_loss`), and, for a
    violation, by the engine adapters where the engine itself tolerates it (see
    :func:`gradguard.engines.megatron.configure`).
    """


for _cls in (
    GradGuardError,
    GraphRetentionError,
    LossContractError,
    GradGuardWarning,
    GraphRetentionWarning,
    LossContractWarning,
):
    _cls.__module__ = "gradguard"  # tracebacks show the public name: gradguard.GraphRetentionError
del _cls
