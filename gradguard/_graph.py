"""Autograd graph inspection: what a graph keeps alive, and whether a loss reaches parameters.

Both walks visit each graph node once. They never run backward, and never unpack a saved tensor that
has saved-tensor hooks (unpacking a non-reentrant checkpoint's saved tensor re-runs its forward):
inspecting a graph leaves it, and the gradients it will produce, exactly as they were.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch._C import _functorch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._tree import _iter_tensors

__all__ = ["pinned_bytes", "unreached_params"]


def _distinct_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Each distinct tensor in ``obj``: the tree walk's, used here and nowhere else in this module."""
    return (t for _, t in _iter_tensors(obj))


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


# --------------------------------------------------------------------------------------------------
# pinned_bytes
# --------------------------------------------------------------------------------------------------


def pinned_bytes(obj: Any) -> int:
    """Estimate the bytes that the autograd graphs reachable from ``obj`` keep alive.

    Counted, each piece of memory once (keyed by device and data pointer):
      * leaves reached through ``AccumulateGrad`` nodes that are not ``nn.Parameter``s (receive
        buffers, embedding outputs made leaves by ``enable_input_require_grads``, checkpoint
        inputs), and their ``.grad``;
      * tensors saved for backward that have not been freed yet (all of them in a forward-only
        pass with grad enabled; none after ``backward()`` without ``retain_graph``);
      * for saved tensors packed by saved-tensor hooks, the packed object when it is a tensor.

    A tensor counts for the memory it really holds: a sparse tensor its indices and values, a
    ``DTensor`` its local shard, a jagged nested tensor and any other traceable wrapper subclass the
    components its ``__tensor_flatten__`` names, another wrapper subclass the tensors among its
    attributes; a meta tensor, and any tensor whose storage is unallocated or freed, counts 0.

    Not visible, so not counted: memory held by hooks as opaque objects (a non-reentrant
    checkpoint's recomputation state, offload holders that are not tensors), the C++ node objects
    themselves, parameters, views of them saved for backward (``addmm`` saves ``weight.t()``) and
    their gradients (they outlive any record anyway), and tensors held by Python closures or
    ``ctx`` attributes other than ``save_for_backward``.
    """
    roots = [t.grad_fn for t in _distinct_tensors(obj) if t.grad_fn is not None]
    counted: set[Hashable] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor) or _is_parameter(t):
            return
        for key, nbytes in _memory(t, set()):
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


_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def _memory(t: torch.Tensor, seen: set[int]) -> Iterator[tuple[Hashable, int]]:
    """``(key, bytes)`` for each piece of memory ``t`` really holds; nothing for what holds none."""
    if id(t) in seen or t.is_meta:
        return
    seen.add(id(t))
    if is_traceable_wrapper_subclass(t):  # DTensor, jagged nested tensors, tensor-subclass quantizers
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        parts: Iterable[Any] = [getattr(t, name) for name in names]
    elif _functorch.is_functorch_wrapped_tensor(t):
        parts = [_functorch.get_unwrapped(t)]
    elif t.layout in _SPARSE_PARTS:
        parts = [getattr(t, name)() for name in _SPARSE_PARTS[t.layout]]  # new objects: kept alive for `seen`
    else:
        own = _storage(t)
        if own is not None:
            yield own
            return
        parts = vars(t).values()  # a wrapper subclass keeping its data in attributes; freed or fake: none
    for part in parts:
        if isinstance(part, torch.Tensor):
            yield from _memory(part, seen)


def _storage(t: torch.Tensor) -> tuple[Hashable, int] | None:
    """``t``'s own allocated storage as ``(key, bytes)``; ``None`` where nothing is allocated in it."""
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass, or an opaque layout
        if type(t) in (torch.Tensor, nn.Parameter):
            return ("tensor", id(t)), t.numel() * t.element_size()  # mkldnn and the like own their elements
        return None
    return ((t.device, ptr), storage.nbytes()) if ptr else None


_saved_names: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


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
