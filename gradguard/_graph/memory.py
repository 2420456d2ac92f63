"""What an autograd graph keeps alive: :func:`pinned_bytes`, :func:`released_bytes`, and the shared count
behind the audit's figures.

The walks visit each graph node once. They never run backward, never call a checkpointed function,
and never unpack a saved tensor that has saved-tensor hooks (unpacking a non-reentrant checkpoint's
saved tensor re-runs its forward): inspecting a graph leaves it, and the gradients it will produce,
exactly as they were.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .._compat import UNKNOWN, degraded, functorch_unwrapped, is_traceable_wrapper_subclass, saved_tensor_parts
from .._tree.walk import iter_tensors
from .nodes import is_parameter as _is_parameter
from .nodes import nodes as _nodes
from .nodes import saved_names

__all__ = ["graph_memory", "pinned_bytes", "released_bytes"]


def _distinct_tensors(obj: object) -> Iterator[torch.Tensor]:
    """Each distinct tensor in ``obj``: the tree walk's, used here and nowhere else in this module."""
    return (t for _, t in iter_tensors(obj))


def pinned_bytes(obj: object) -> int:
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
    their gradients (they outlive any record anyway), and tensors held by Python closures. A custom
    ``autograd.Function``'s tensors kept as plain ``ctx`` attributes (``ctx.x = x``, which no backward
    frees) are counted, read from the context's own ``__dict__``.

    The walk never runs backward, never calls a checkpointed function and never unpacks a saved
    tensor that has saved-tensor hooks: the graphs, and the gradients they will produce, are left
    exactly as they were.

    Args:
        obj: Any object: the graphs of every tensor in it that carries ``grad_fn`` are counted,
            looked for where :func:`gradguard.find_graphs` looks.

    Returns:
        The estimate, in bytes; 0 when ``obj`` holds no graph.
    """
    roots = [t.grad_fn for t in _distinct_tensors(obj) if t.grad_fn is not None]
    return graph_memory(roots, set())[0]


def released_bytes(obj: object) -> int:
    """Estimate the bytes that detaching ``obj``'s graph tensors releases: what their graphs keep
    pinned once a backward has run through them (its saved tensors are freed by the backward anyway):
    the leaves reached through ``AccumulateGrad`` that are not ``nn.Parameter``s, and their ``.grad``
    (the leaf's size when the backward has not made it yet). Each storage once. In a forward-only
    pass no backward frees the saved tensors: detaching then releases them too, and this
    undercounts by their size (:func:`pinned_bytes` counts them)."""
    counted: set[Hashable] = set()
    total = 0
    for node in _nodes(t.grad_fn for t in _distinct_tensors(obj) if t.grad_fn is not None):
        leaf = getattr(node, "variable", None)
        if leaf is None or _is_parameter(leaf):
            continue
        for part in (leaf, leaf.grad):
            if part is None:  # the gradient the backward will make: the leaf's own size
                total += sum(n for key, n in _memory(leaf, set()) if ("grad", key) not in counted)
                counted.update(("grad", key) for key, _ in _memory(leaf, set()))
                continue
            for key, nbytes in _memory(part, set()):
                if key not in counted:
                    counted.add(key)
                    total += nbytes
    return total


def graph_memory(roots: Iterable[Any], counted: set[Hashable], held: set[int] | None = None) -> tuple[int, int]:
    """What the graphs from the autograd nodes ``roots`` keep alive, by :func:`pinned_bytes`' rules:
    ``(bytes, nodes)``, the bytes of the memory and the number of graph nodes (leaves'
    ``AccumulateGrad`` nodes excluded: they live as long as their leaf) that ``counted`` does not
    hold yet (their keys are added to it, so several calls sharing ``counted`` count each storage and
    each node once). ``held``, when given, collects the ids of the tensors the graphs hold."""
    total = nodes = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        if held is not None:
            held.add(id(t))
        if _is_parameter(t):
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
        if node not in counted:
            counted.add(node)
            nodes += 1
        for data in _saved_data(node):
            add(data)
        for value in _context_tensors(node):
            add(value)
    return total, nodes


def _context_tensors(node: Any) -> Iterator[Any]:
    """The tensors a custom ``autograd.Function`` keeps as plain ``ctx`` attributes (directly, or in a list
    or tuple), read from the instance's ``__dict__`` (no code of the program runs)."""
    try:
        attributes = object.__getattribute__(node, "__dict__")
    except (AttributeError, TypeError):
        return
    for value in list(attributes.values()):
        if type(value) in (list, tuple):
            yield from value
        else:
            yield value


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
    elif (unwrapped := functorch_unwrapped(t)) is not None:
        parts = [unwrapped]
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


def _unpacked(node: Any, raw_name: str) -> list[Any]:
    """The tensors of ``node``'s raw accessor ``raw_name``, unpacked; none where torch refuses."""
    name = "saved_tensors" if raw_name == "_raw_saved_tensors" else "_saved_" + raw_name[len("_raw_saved_") :]
    try:
        value = getattr(node, name)
    except RuntimeError:  # freed, or modified in place since: what it held is not what it saves
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _saved_data(node: Any) -> Iterator[Any]:
    """What the node's saved tensors hold, read without unpacking. A torch that cannot show them
    (before 2.13) yields nothing, and says so once (``gradguard._compat.degraded``)."""
    for name in saved_names(node):
        try:
            value = getattr(node, name)
        except RuntimeError:
            continue  # freed by backward
        for saved in value if isinstance(value, (list, tuple)) else (value,):
            if saved is None:
                continue
            data, unpack_hook = saved_tensor_parts(saved)
            if data is UNKNOWN:  # before torch 2.13: unpacked only where no hook can run
                if unpack_hook is UNKNOWN:
                    degraded("saved tensors")
                else:
                    yield from _unpacked(node, name)
                break
            if unpack_hook is not None and isinstance(data, (list, tuple)):
                yield from data  # a hook's packed form, e.g. save_on_cpu's (device, tensor)
            else:
                yield data
