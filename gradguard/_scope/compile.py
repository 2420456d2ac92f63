"""``torch.compile`` runs gradguard's own functions eagerly, never traces into them.

A guarded store is a real list (or dict, deque) subclass, so compiled code may hold and append to
one. Dynamo would otherwise inline the store's ``append`` and gradguard's walk; traced, their
per-call bookkeeping (the mode in a context variable, per-thread counters, the caller's frame) is not
what runs. Registering gradguard's directory with Dynamo's skip rules turns each call into gradguard
into a graph break: the call runs as plain Python on real tensors, and the compiled code around it is
unaffected. Done when ``torch._dynamo`` is imported, so importing gradguard does not import it.
"""

from __future__ import annotations

import logging
from types import ModuleType

import wrapt

__all__ = ["skip_in_dynamo"]

logger = logging.getLogger("gradguard")


def _register(trace_rules: ModuleType) -> None:
    try:
        trace_rules.add(__name__.partition(".")[0])  # the whole package, not this folder
    except Exception as exc:  # noqa: BLE001 - a Dynamo internal: without it compiled code traces into gradguard
        logger.debug("gradguard: could not register with torch._dynamo's skip rules: %r", exc)


def skip_in_dynamo() -> None:
    """Register the hook (idempotent: wrapt runs each registered hook once per import)."""
    wrapt.register_post_import_hook(_register, "torch._dynamo.trace_rules")
