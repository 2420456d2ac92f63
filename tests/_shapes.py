"""Container types the tree tests share: a namedtuple, a dataclass, a pytree-registered class."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from torch.utils import _pytree

__all__ = ["Plain", "Point", "PytreeBox"]


class Point(NamedTuple):
    x: Any
    y: Any
    z: Any


@dataclasses.dataclass
class Plain:
    x: Any
    y: Any
    z: Any


class PytreeBox:
    """Registered with torch.utils._pytree (module-level, once)."""

    def __init__(self, x: Any, y: Any, z: Any, label: str = "box") -> None:
        self.x, self.y, self.z, self.label = x, y, z, label


_pytree.register_pytree_node(
    PytreeBox,
    lambda b: ([b.x, b.y, b.z], b.label),
    lambda children, label: PytreeBox(*children, label=label),
)
