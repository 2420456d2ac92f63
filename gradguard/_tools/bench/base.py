"""What a benchmark scenario is: its :class:`Size` and the :class:`Scenario` built for a device.

Apart from :mod:`.scenarios`, so that a scenario defined in a module of its own (megatron-core's
``GPTModel``, imported only when asked for) builds on these without importing the list of scenarios.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Scenario", "Size"]


@dataclass(frozen=True)
class Size:
    seq: int = 128
    batch: int = 2
    hidden: int = 256
    vocab: int = 256
    dtype: torch.dtype = torch.float32


@dataclass
class Scenario:
    """One scenario, built for a device and size.

    ``step(i, store, guarded)`` runs micro-batch ``i`` and keeps its record in ``store``;
    ``new_store(guarded)`` makes the store a run keeps its records in. A scenario whose engine loops
    over the micro-batches itself gives ``run(n, guarded, after_microbatch)`` instead: it runs ``n``
    micro-batches, calls ``after_microbatch()`` after each, and returns what it kept. ``engines``: the
    engine adapters the guarded run enters ``gradguard.enforce(engines=...)`` with (none by default).
    """

    name: str
    model: nn.Module
    expected_pinned_bytes_per_microbatch: int
    record_bytes_per_microbatch: int
    step: Callable[[int, Any, bool], None]
    new_store: Callable[[bool], Any]
    engines: tuple[str, ...] = ()
    run: Callable[[int, bool, Callable[[], None]], Any] | None = None
