"""Autograd graph inspection: what a graph keeps alive, and whether a loss reaches parameters.

Both walks visit each graph node once. They never run backward, never call a checkpointed function,
and never unpack a saved tensor that has saved-tensor hooks (unpacking a non-reentrant checkpoint's
saved tensor re-runs its forward): inspecting a graph leaves it, and the gradients it will produce,
exactly as they were.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import types
import weakref
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch._C import _functorch
from torch.autograd.function import BackwardCFunction
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._tree import iter_tensors

__all__ = ["Unreached", "active_transform", "graph_memory", "pinned_bytes", "released_bytes", "unreached_params"]


def _distinct_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Each distinct tensor in ``obj``: the tree walk's, used here and nowhere else in this module."""
    return (t for _, t in iter_tensors(obj))


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


def active_transform() -> str | None:
    """The innermost active ``torch.func`` transform (``"Grad"``, ``"Jvp"``, ``"Vmap"``,
    ``"Functionalize"``), or ``None`` in plain eager code."""
    interpreter = _functorch.peek_interpreter_stack()
    return None if interpreter is None else interpreter.key().name


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
    return graph_memory(roots, set())[0]


def released_bytes(obj: Any) -> int:
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
    return total, nodes


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


# --------------------------------------------------------------------------------------------------
# unreached_params
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Unreached:
    """What :func:`unreached_params` found: parameters the graph cannot train, and those it cannot decide.

    ``missing``: trainable parameters the graph provably does not reach (they get no gradient).
    ``undecided``: trainable parameters the graph does not visibly reach, where something the walk
    cannot look into may reach them; ``why`` says what. Empty tuples when every one is reached.
    """

    missing: tuple[str, ...] = ()
    undecided: tuple[str, ...] = ()
    why: str = ""


def unreached_params(loss: torch.Tensor, params: nn.Module | Iterable[tuple[str, torch.Tensor]]) -> Unreached:
    """Which trainable parameters (``requires_grad``) of ``params`` the graph of ``loss`` does not reach.

    ``params`` is a module (read now: its current parameters) or ``(name, parameter)`` pairs. A
    parameter counts as reached when the graph has its ``AccumulateGrad`` node, and also:

    * under FSDP2 (``fully_shard``, found in the module ``params``), when the graph reaches the
      unsharded parameter that FSDP swaps in for the registered, sharded one during forward;
    * behind a reentrant activation checkpoint (torch's ``use_reentrant=True``, Megatron's
      ``CheckpointFunction``), whose forward ran under ``no_grad`` so that only the recompute in
      backward reaches its parameters: when the checkpointed function is a module, a module's bound
      method, or a ``functools.partial`` / function whose arguments, closure cells and named globals
      hold modules, tensors and plain values only (see :func:`_reach_of`), the parameters of those
      modules and those tensors count as reached. A module is taken to reach its own parameters.

    Undecided (never missing): every parameter not reached when the graph holds a recomputing
    checkpoint whose function holds anything else (or none: Megatron's ``CheckpointWithoutOutput``),
    or when a ``torch.func`` transform is active (its graph's leaves are the transform's inputs);
    a ``DTensor`` parameter, or one already handed to ``fully_shard``, that no FSDP2 module in
    ``params`` maps to a tensor of the graph (pass the module itself).
    """
    pairs: list[tuple[str, torch.Tensor]]
    if isinstance(params, nn.Module):
        module: nn.Module | None = params
        pairs = [*params.named_parameters()]
    else:
        module, pairs = None, list(params)
    wanted = [(name, p) for name, p in pairs if p.requires_grad]
    if not wanted:
        return Unreached()
    transform = active_transform()
    if transform is not None:
        return Unreached(
            undecided=tuple(name for name, _ in wanted),
            why=f"a torch.func transform ({transform}) is active: the graph's leaves are the transform's "
            "inputs, not these parameters",
        )

    index = {id(p): i for i, (_, p) in enumerate(wanted)}  # each tensor standing for wanted[i]
    fsdp_mapped = set()
    for sharded, unsharded in _fsdp_pairs(module):
        i = index.get(id(sharded), index.get(id(unsharded)))
        if i is not None:
            index[id(sharded)] = index[id(unsharded)] = i
            fsdp_mapped.add(i)

    remaining, opaque = _walk(loss, index, len(wanted))
    if opaque:
        return Unreached(
            undecided=tuple(wanted[i][0] for i in remaining),
            why=f"the graph holds a recomputing activation checkpoint gradguard cannot look into "
            f"({', '.join(opaque)}); its recompute in backward may reach them",
        )
    undecided = [i for i in remaining if i not in fsdp_mapped and _maybe_fsdp_managed(wanted[i][1])]
    why = "FSDP2 (fully_shard) may train them through an unsharded copy that only their module maps them to"
    return Unreached(
        missing=tuple(wanted[i][0] for i in remaining if i not in undecided),
        undecided=tuple(wanted[i][0] for i in undecided),
        why=f"{why}: pass the module itself as params=" if undecided else "",
    )


def _walk(loss: torch.Tensor, index: dict[int, int], n: int) -> tuple[list[int], list[str]]:
    """Walk ``loss``'s graph until every one of the ``n`` parameters (``index``: tensor id -> which)
    is reached; return those not reached, in order, and the recomputing checkpoints it met that it
    could not see through."""
    remaining = set(range(n))
    opaque: set[str] = set()
    seen: set[int] = set()  # what _reach_of followed already, across checkpoints
    for node in _nodes([loss.grad_fn]):
        leaf = getattr(node, "variable", None)  # only AccumulateGrad has one
        if leaf is not None:
            remaining.discard(index.get(id(leaf), -1))
        elif isinstance(node, BackwardCFunction) and _recomputes(node):
            called = _checkpointed(node)
            tensors, complete = _reach_of(called, seen) if called else ([], False)
            remaining.difference_update(index.get(id(t), -1) for t in tensors)
            if not complete:
                opaque.add(_describe(node))
        if not remaining:
            break
    return sorted(remaining), sorted(opaque)


def _recomputes(node: BackwardCFunction) -> bool:
    """A custom Function that recomputes in backward: it stores a ``run_function`` on its ctx
    (torch's reentrant checkpoint, Megatron, DeepSpeed, Transformer Engine) or says so in its name
    (Megatron's ``CheckpointWithoutOutputFunction``)."""
    return hasattr(node, "run_function") or "checkpoint" in type(node).__name__.lower()


def _checkpointed(node: BackwardCFunction) -> list[Any]:
    """What the recompute will call, and with which non-tensor arguments (torch's ``ctx.inputs``)."""
    if not hasattr(node, "run_function"):
        return []
    inputs = getattr(node, "inputs", None)
    return [node.run_function, *(inputs if isinstance(inputs, (list, tuple)) else ())]


def _describe(node: BackwardCFunction) -> str:
    fn = getattr(node, "run_function", None)
    what = type(node).__name__
    return what if fn is None else f"{what} of {getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _plain(module_name: str | None) -> bool:
    """A Python module whose globals hold none of the user's modules: torch's own, math, operator."""
    name = module_name or ""
    return name in ("torch", "math", "operator") or name.startswith("torch.")


_INERT = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    type,
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    types.BuiltinFunctionType,
    type(Ellipsis),
    slice,
    range,
)


def _reach_of(roots: Iterable[Any], seen: set[int]) -> tuple[list[torch.Tensor], bool]:
    """The tensors that calling the checkpointed function in ``roots`` can reach, and whether that is all.

    Followed: a module (its parameters), a tensor, a bound method (its object when it is a module,
    else its object and function), a ``functools.partial`` (function and arguments), a Python
    function (its closure cells, defaults, and the globals its code, nested code included, names;
    for torch's own functions not the globals), and lists, tuples, sets and dicts of those. Plain
    values, classes, builtins and torch's own modules reach nothing. Anything else may reach more
    than the walk can tell: ``complete`` is ``False``. Objects in ``seen`` were followed already.
    """
    found: list[torch.Tensor] = []
    complete = True
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if isinstance(obj, _INERT) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            found.extend(obj.parameters())
        elif isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, functools.partial):
            stack.extend((obj.func, *obj.args, *obj.keywords.values()))
        elif isinstance(obj, types.MethodType):
            owner = obj.__self__
            stack.extend((owner,) if isinstance(owner, nn.Module) else (owner, obj.__func__))
        elif isinstance(obj, types.FunctionType):
            stack.extend(cell.cell_contents for cell in obj.__closure__ or () if not _empty(cell))
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
            if not _plain(obj.__module__):
                stack.extend(obj.__globals__[name] for name in _names(obj.__code__) if name in obj.__globals__)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, types.ModuleType):
            complete &= _plain(obj.__name__)
        else:
            complete = False
    return found, complete


def _empty(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - reading it is the test
    except ValueError:
        return True
    return False


def _names(code: types.CodeType) -> Iterator[str]:
    """The global (and attribute) names ``code`` and the code nested in it use."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _fsdp_pairs(module: nn.Module | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(sharded, unsharded)`` parameter pairs of the FSDP2 (``fully_shard``) modules in ``module``.

    FSDP2 registers sharded ``DTensor`` parameters and, during forward, swaps in unsharded ones: the
    graph reaches those. Nothing when FSDP2 was never imported or its internals are not as expected
    (the parameters then stay undecided, see :func:`_maybe_fsdp_managed`).
    """
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if module is None or fsdp_module is None:
        return
    for m in module.modules():
        if not isinstance(m, fsdp_module):
            continue
        try:
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)  # a list; older torch: one group
            if groups is None:
                groups = [g] if (g := getattr(state, "_fsdp_param_group", None)) is not None else []
            for group in groups:
                for fsdp_param in group.fsdp_params:
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)  # before 1st forward: none
                    if unsharded is not None:
                        yield fsdp_param.sharded_param, unsharded
        except (AttributeError, AssertionError):
            continue


def _maybe_fsdp_managed(p: torch.Tensor) -> bool:
    """``p`` may be trained through a tensor FSDP2 swaps in: a ``DTensor`` while FSDP2 is imported,
    or an original parameter that ``fully_shard`` has replaced (it marks them ``_fsdp_orig_uid``)."""
    if hasattr(p, "_fsdp_orig_uid"):
        return True
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and "torch.distributed.fsdp" in sys.modules and isinstance(p, dtensor)
