"""The heaps the audit benchmark scans: filler objects to a given count of gc-tracked objects, and
the leak it must find."""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn

__all__ = ["FILLER", "LEAKED", "fill", "leak", "live_objects", "unleak"]

FILLER: list[Any] = []  # a module global: the filler is reachable, as a program's own objects are
LEAKED: list[Any] = []  # the one list of leaked records


class Record:
    """A plain object with attributes, like the program objects a real heap is mostly made of."""

    def __init__(self, i: int) -> None:
        self.index = i
        self.name = "record"
        self.tags = {"i": i}


def live_objects() -> int:
    """How many objects the cycle collector tracks now (what an audit and ``gc.get_objects()`` visit)."""
    return len(gc.get_objects())


def fill(target: int) -> int:
    """Add filler until about ``target`` objects are tracked: instances with a dict attribute,
    dicts, lists, in lists of 1000 (a tree, not one flat list). Returns the count reached."""
    gc.collect()
    while (missing := target - live_objects()) > 1000:
        for _ in range(max(missing // 4000, 1)):
            block: list[Any] = []
            for i in range(333):
                block.append(Record(i))  # the instance (its tags dict holds atoms only: not tracked)
                block.append({"a": [i], "b": (i, "x")})  # dict + list (a tuple of atoms is untracked by gc)
                block.append([block[-1], block[-2]])
            FILLER.append(block)  # 4 objects per triple, and the block: ~1000 objects
        gc.collect()
    return live_objects()


def leak(records: int = 100) -> nn.Module:
    """Append ``records`` training-step records that keep their graphs to :data:`LEAKED`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for step in range(records):
        logits = model(torch.randn(8, 16))
        LEAKED.append({"loss": logits.pow(2).mean(), "logits": logits, "step": step})
    return model


def unleak() -> None:
    LEAKED.clear()
    gc.collect()
