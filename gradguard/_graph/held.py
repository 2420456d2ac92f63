"""How many references the program's autograd graphs hold to its parameters, read in constant time.

A graph that saved a parameter for backward (a convolution's or a norm's weight, a linear layer's
``weight.t()``: a view holds its base) holds a reference to the parameter's tensor until a backward
frees what it saved. ``Tensor._use_count()`` counts those references. At a step boundary, after the
backward, they are back at the level the program keeps (the optimizer, the model, a grad accumulator
the current step's graph still uses); each forward kept with its graph, never backwarded (an eval
forward without ``no_grad`` kept in a list), adds one per parameter it saved. :class:`HeldParameters`
reads the counts of a few parameters at each boundary, in turn, and sums how far each moved since
its previous reading, so a growing number of kept forwards shows without looking at the heap
(``docs/how-it-works.md``), whichever parameters they saved. Parameters are held weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["HeldParameters"]

_use_count = getattr(torch.Tensor, "_use_count", None)


class HeldParameters:
    """The references the program's graphs hold to the parameters of ``optimizers``, as a running level
    (see the module documentation). Each call reads the next ``sample`` parameters in turn (every parameter
    is read once every ``ceil(parameters / sample)`` readings, weights first: the layers that use them save
    them) and adds
    to the level how much each one's count moved since that parameter's previous reading: a forward kept
    with its graph raises the level when the turn of a parameter it saved comes. :meth:`__call__`
    returns the level, or ``None`` where no count can be read (a torch without ``Tensor._use_count``,
    every parameter gone)."""

    __slots__ = ("_last", "_turn", "_turns", "level")

    def __init__(self, optimizers: Iterable[Any], sample: int) -> None:
        params: list[torch.Tensor] = []
        seen: set[int] = set()
        for optimizer in optimizers:
            for group in getattr(optimizer, "param_groups", ()):
                for p in group.get("params", ()):
                    if isinstance(p, torch.Tensor) and id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
        params.sort(key=lambda p: p.dim() < 2)  # stable: weights first, in the optimizer's order
        pairs = [(i, weakref.ref(p)) for i, p in enumerate(params)]
        # Each reading's parameters, made once: the reading itself only looks them up.
        self._turns = [tuple(pairs[k : k + sample]) for k in range(0, len(pairs), sample)]
        self._turn = 0
        self._last: list[int | None] = [None] * len(params)
        self.level = 0
        """The running level: the sum of the moves read so far."""

    def __call__(self) -> int | None:
        turns = self._turns
        if _use_count is None or not turns:
            return None
        turn = self._turn
        self._turn = turn + 1 if turn + 1 < len(turns) else 0
        last = self._last
        level = self.level
        read = False
        for i, ref in turns[turn]:
            p = ref()
            if p is None:
                continue
            try:
                count = _use_count(p)
            except (RuntimeError, TypeError):  # a tensor subclass without a TensorImpl of its own
                continue
            before = last[i]
            if before is not None:
                level += count - before
            last[i] = count
            read = True
        self.level = level
        return level if read else None
