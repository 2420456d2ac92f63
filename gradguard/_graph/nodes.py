"""Autograd graph nodes: each node reachable from roots, once; and what counts as a parameter."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["is_parameter", "nodes", "saved_names"]


def nodes(roots: Iterable[Any]) -> Iterator[Any]:
    """Every autograd node reachable from ``roots``, each once."""
    seen: set[Any] = set()
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (``addmm`` saves ``weight.t()``): memory that outlives records."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


_saved_names: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def saved_names(node: Any) -> tuple[str, ...]:
    """The names of ``node``'s raw saved-tensor accessors (``_raw_saved_*``), cached per node type."""
    cls = type(node)
    names = _saved_names.get(cls)
    if names is None:
        names = _saved_names[cls] = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
    return names
