"""gradguard: keep per-micro-batch records from pinning autograd graphs.

Training engines keep one record per micro-batch until the mini-batch ends. A tensor in such a
record that still carries ``grad_fn`` keeps that micro-batch's graph, and the leaves behind it, alive.
gradguard detaches what is published at that boundary, after the loss is computed, and checks that
the loss used for backward still requires grad.
"""

from ._audit import Retention, RetentionReport, audit
from ._compile import skip_in_dynamo as _skip_in_dynamo
from ._containers import register_container, unregister_container
from ._contract import check_loss
from ._enforce import enforce
from ._errors import (
    GradGuardError,
    GradGuardWarning,
    GraphRetentionError,
    GraphRetentionWarning,
    LossContractError,
    LossContractWarning,
)
from ._graph import pinned_bytes
from ._policy import get_mode, set_mode
from ._stats import SiteStats, Stats, reset_stats, stats
from ._step import forward_step
from ._store import guard, unwrap
from ._tree import GraphRecord, detach_tree, find_graphs
from ._trigger import TriggerSettings
from ._watch import Watcher, watch
from ._watch import start_process_watch as _start_process_watch

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
