"""How many references the program's autograd graphs hold to its parameters, read in constant time.

A graph that saved a parameter for backward (a convolution's or a norm's weight, a linear layer's
``weight.t()``: a view holds its base) holds a reference to the parameter's tensor until a backward
frees what it saved. ``Tensor._use_count()`` counts those references. At a step boundary, after the
backward, they are back at the level the program keeps (the optimizer, the model, a grad accumulator
the current step's graph still uses); each forward kept with its graph, never backwarded (an eval
forward without ``no_grad`` kept in a list), adds one per parameter it saved. :class:`HeldParameters`
sums the count over a small sample of an optimizer's parameters, so a growing number of kept
forwards shows without looking at the heap (``docs/how-it-works.md``). Parameters are held weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["SAMPLE", "HeldParameters"]

SAMPLE = 4
"""Parameters read per reading: spread over the optimizers' parameter lists, weights first."""

_use_count = getattr(torch.Tensor, "_use_count", None)


class HeldParameters:
    """The summed reference count of a sample of the parameters of ``optimizers`` (see the module
    documentation); :meth:`__call__` reads it, or returns ``None`` where it cannot be read (a torch
    without ``Tensor._use_count``, or every sampled parameter gone)."""

    __slots__ = ("_refs", "ids")

    def __init__(self, optimizers: Iterable[Any]) -> None:
        params: list[torch.Tensor] = []
        seen: set[int] = set()
        for optimizer in optimizers:
            for group in getattr(optimizer, "param_groups", ()):
                for p in group.get("params", ()):
                    if isinstance(p, torch.Tensor) and id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
        chosen = _sample(params)
        self.ids = frozenset(id(p) for p in chosen)
        """The ids of the parameters read."""
        self._refs = [weakref.ref(p) for p in chosen]

    def __call__(self) -> int | None:
        if _use_count is None or not self._refs:
            return None
        total = 0
        read = False
        for ref in self._refs:
            p = ref()
            if p is None:
                continue
            try:
                total += _use_count(p)
            except (RuntimeError, TypeError):  # a tensor subclass without a TensorImpl of its own
                continue
            read = True
        return total if read else None


def _sample(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Up to :data:`SAMPLE` parameters evenly spread over ``params``, the last one included, weights
    (two or more dimensions: saved by the layers that use them) before biases and norms' vectors."""
    weights = [p for p in params if p.dim() >= 2] or params
    if len(weights) <= SAMPLE:
        return weights
    step = (len(weights) - 1) / (SAMPLE - 1)
    return [weights[round(i * step)] for i in range(SAMPLE)]
