"""Which trainable parameters a loss reaches: the loss contract's graph walk (:func:`unreached_params`).

It visits each graph node once, never runs backward, never calls a checkpointed function (what a
reentrant checkpoint will recompute is read from its function's closure, defaults and globals).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction

from .._compat import functorch_interpreter
from .nodes import nodes as _nodes

__all__ = ["Unreached", "active_transform", "unreached_params"]


def active_transform() -> str | None:
    """The innermost active ``torch.func`` transform (``"Grad"``, ``"Jvp"``, ``"Vmap"``,
    ``"Functionalize"``), or ``None`` in plain eager code."""
    interpreter = functorch_interpreter()
    return None if interpreter is None else interpreter.key().name


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
