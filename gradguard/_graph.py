"""Autograd graph inspection: what a graph keeps alive, and whether a loss reaches parameters.

Both walks visit each graph node once, never run backward, and never unpack a saved tensor that has
saved-tensor hooks (unpacking a non-reentrant checkpoint's saved tensor re-runs its forward).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ._tree import iter_tensors

__all__ = ["pinned_bytes", "unreached_params"]


def _nodes(roots: Iterable[Any]) -> Iterator[Any]:
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


def pinned_bytes(obj: Any) -> int:
    """Estimate the bytes that the autograd graphs reachable from ``obj`` keep alive.

    Counted, each storage once (keyed by device and data pointer):
      * leaves reached through ``AccumulateGrad`` nodes that are not ``nn.Parameter``s (receive
        buffers, embedding outputs made leaves by ``enable_input_require_grads``, checkpoint
        inputs), and their ``.grad``;
      * tensors saved for backward that have not been freed yet (all of them in a forward-only
        pass with grad enabled; none after ``backward()`` without ``retain_graph``);
      * for saved tensors packed by saved-tensor hooks, the packed object when it is a tensor.

    Not visible, so not counted: memory held by hooks as opaque objects (a non-reentrant
    checkpoint's recomputation state, offload holders that are not tensors), the C++ node objects
    themselves, parameters, views of them saved for backward (``addmm`` saves ``weight.t()``) and
    their gradients (they outlive any record anyway), and tensors held
    by Python closures or ``ctx`` attributes other than ``save_for_backward``.
    """
    roots = [t.grad_fn for _, t in iter_tensors(obj) if t.grad_fn is not None]
    counted: set[tuple[Any, int]] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor) or _is_parameter(t):
            return
        key, nbytes = _storage_key(t)
        if key not in counted:
            counted.add(key)
            total += nbytes

    for node in _nodes(roots):
        leaf = getattr(node, "variable", None)  # only AccumulateGrad has one
        if leaf is not None:
            if not _is_parameter(leaf):
                add(leaf)
                add(leaf.grad)
            continue
        for data in _saved_data(node):
            add(data)
    return total


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (``addmm`` saves ``weight.t()``): memory that outlives records."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


def _storage_key(t: torch.Tensor) -> tuple[tuple[Any, int], int]:
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr:
            return (t.device, ptr), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        pass  # nested and wrapper subclasses have no single storage
    return ("tensor", id(t)), t.numel() * t.element_size()


_saved_names: dict[type, tuple[str, ...]] = {}


def _saved_data(node: Any) -> Iterator[Any]:
    """What the node's saved tensors hold, read without unpacking; nothing on old torch builds."""
    cls = type(node)
    names = _saved_names.get(cls)
    if names is None:
        names = tuple(n for n in dir(node) if n.startswith("_raw_saved_"))
        _saved_names[cls] = names
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:
            continue  # freed by backward
        for saved in value if isinstance(value, (list, tuple)) else (value,):
            if not hasattr(saved, "unpack_hook"):
                continue
            data = getattr(saved, "data", None)
            if saved.unpack_hook is not None and isinstance(data, (list, tuple)):
                yield from data  # a hook's packed form, e.g. save_on_cpu's (device, tensor)
            else:
                yield data


def unreached_params(loss: torch.Tensor, params: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the trainable parameters (``requires_grad``) that ``loss``'s graph does not reach."""
    wanted = {id(p): name for name, p in params if p.requires_grad}
    if not wanted:
        return []
    for node in _nodes([loss.grad_fn]):
        leaf = getattr(node, "variable", None)
        if leaf is not None:
            wanted.pop(id(leaf), None)
            if not wanted:
                return []
    return list(wanted.values())
