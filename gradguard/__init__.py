"""gradguard: keep per-micro-batch records from pinning autograd graphs.

Training engines keep one record per micro-batch until the mini-batch ends. A tensor in such a
record that still carries ``grad_fn`` keeps that micro-batch's graph, and the leaves behind it, alive.
gradguard detaches what is published at that boundary, after the loss is computed, and checks that
the loss used for backward still requires grad.
"""

from ._errors import (
    GradGuardError,
    GradGuardWarning,
    GraphRetentionError,
    GraphRetentionWarning,
    LossContractError,
    LossContractWarning,
)
from ._graph.memory import pinned_bytes
from ._guards.contract import check_loss
from ._guards.step import forward_step
from ._guards.store import guard, unwrap
from ._policy.modes import get_mode, set_mode
from ._policy.stats import SiteStats, Stats, reset_stats, stats
from ._scope.compile import skip_in_dynamo as _skip_in_dynamo
from ._scope.enforce import enforce
from ._tree.containers import register_container, unregister_container
from ._tree.walk import GraphRecord, detach_tree, find_graphs
from ._watch.audit import Retention, RetentionReport, audit
from ._watch.trigger import TriggerSettings
from ._watch.watcher import Watcher, watch
from ._watch.watcher import start_process_watch as _start_process_watch

_skip_in_dynamo()
_start_process_watch()  # GRADGUARD_AUDIT: a watch for the whole process, with no code change
__version__ = "0.1.0"

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
