"""gradguard: keep per-micro-batch records from pinning autograd graphs.

Training engines keep one record per micro-batch until the mini-batch ends. A tensor in such a
record that still carries ``grad_fn`` keeps that micro-batch's graph, and the leaves behind it, alive.
gradguard detaches what is published at that boundary, after the loss is computed, and checks that
the loss used for backward still requires grad.

The public names load on first use (``gradguard.watch``, ``from gradguard import guard``): importing
the package imports neither torch nor the rest of gradguard, so the ``gradguard`` command (whose
``gradguard run`` is part of every command it starts) pays for nothing it does not use. A program
that imports gradguard after torch, or with ``GRADGUARD_AUDIT`` set, gets the whole package at once.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from ._errors import (
    GradGuardError,
    GradGuardWarning,
    GraphRetentionError,
    GraphRetentionWarning,
    LossContractError,
    LossContractWarning,
)

if TYPE_CHECKING:
    from ._graph.memory import pinned_bytes
    from ._guards.contract import check_loss
    from ._guards.step import forward_step
    from ._guards.store import guard, unwrap
    from ._policy.modes import get_mode, set_mode
    from ._policy.stats import SiteStats, Stats, reset_stats, stats
    from ._tree.containers import register_container, unregister_container
    from ._tree.walk import GraphRecord, detach_tree, find_graphs
    from ._watch.audit import Retention, RetentionReport, audit
    from ._watch.scope import enforce, watch
    from ._watch.trigger import TriggerSettings
    from ._watch.watcher import Watcher

__version__ = "0.1.0"

_LAZY = {
    "pinned_bytes": "._graph.memory",
    "check_loss": "._guards.contract",
    "forward_step": "._guards.step",
    "guard": "._guards.store",
    "unwrap": "._guards.store",
    "get_mode": "._policy.modes",
    "set_mode": "._policy.modes",
    "SiteStats": "._policy.stats",
    "Stats": "._policy.stats",
    "reset_stats": "._policy.stats",
    "stats": "._policy.stats",
    "enforce": "._watch.scope",
    "register_container": "._tree.containers",
    "unregister_container": "._tree.containers",
    "GraphRecord": "._tree.walk",
    "detach_tree": "._tree.walk",
    "find_graphs": "._tree.walk",
    "Retention": "._watch.audit",
    "RetentionReport": "._watch.audit",
    "audit": "._watch.audit",
    "TriggerSettings": "._watch.trigger",
    "Watcher": "._watch.watcher",
    "watch": "._watch.scope",
}

__all__ = [
    "GradGuardError",
    "GradGuardWarning",
    "GraphRecord",
    "GraphRetentionError",
    "GraphRetentionWarning",
    "LossContractError",
    "LossContractWarning",
    "Retention",
    "RetentionReport",
    "SiteStats",
    "Stats",
    "TriggerSettings",
    "Watcher",
    "__version__",
    "audit",
    "check_loss",
    "detach_tree",
    "enforce",
    "find_graphs",
    "forward_step",
    "get_mode",
    "guard",
    "pinned_bytes",
    "register_container",
    "reset_stats",
    "set_mode",
    "stats",
    "unregister_container",
    "unwrap",
    "watch",
]


def _load() -> None:
    """Every public name, imported (torch with them), and ``torch.compile`` told to run gradguard eagerly."""
    from ._scope.compile import skip_in_dynamo

    for name, module in _LAZY.items():
        globals()[name] = getattr(importlib.import_module(module, __name__), name)
    skip_in_dynamo()


def __getattr__(name: str) -> Any:
    """A public name, loaded with all the others on first use (PEP 562)."""
    if name in _LAZY:
        _load()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _start_process_watch() -> None:
    """``GRADGUARD_AUDIT`` set: a watch for the whole process, with no code change."""
    from ._watch.scope import start_process_watch

    _load()
    start_process_watch()


if os.environ.get("GRADGUARD_AUDIT", "").strip():
    if "torch" in sys.modules:
        _start_process_watch()
    else:  # the watch needs torch: it starts when the program imports torch (the command itself never does)
        import wrapt

        wrapt.register_post_import_hook(lambda _torch: _start_process_watch(), "torch")
elif "torch" in sys.modules:  # a program that imports gradguard after torch: all of it at once
    _load()
