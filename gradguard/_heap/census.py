"""The census: every live tensor that carries ``grad_fn``, found in one pass over the collector's objects."""

from __future__ import annotations

import gc
import itertools
from typing import Any

import torch
from torch import nn

from .paths import is_a

__all__ = ["live_graph_tensors", "live_tensors", "promotions"]


def live_graph_tensors(
    exclude_ids: set[int],
    optimizers: list[Any] | None = None,
    young: bool = False,
    views: list[Any] | None = None,
) -> list[torch.Tensor]:
    """Every live tensor (subclasses included) that carries ``grad_fn``, in one ``gc.get_objects()`` pass.

    Never an ``nn.Parameter`` (a leaf holds no graph) or a view of one (a tied decoder weight,
    ``emb.weight.t()``: the parameter itself, seen through a view), never a tensor torch traces with
    (FakeTensor, FunctionalTensor: torch.compile keeps them in its own metadata), never one whose id
    is in ``exclude_ids``. A tensor whose ``grad_fn`` cannot be read (a functorch-wrapped tensor
    outside its transform) is skipped. Objects are told apart by their exact type (against every
    tensor subclass defined now), never through ``__class__``, so a proxy that claims to be a tensor
    is not one. ``optimizers``, when given, receives every live ``torch.optim.Optimizer``, found in
    the same pass. ``young``: only the objects of the collector's two young generations (what was
    made since their last promotion to the oldest one: see :func:`promotions`). ``views``, when given,
    receives the ``grad_fn`` of every view of a parameter (the model's own nodes, alive as long as it is).
    """
    kinds = _tensor_types()
    optimizer_kinds = _subclasses(torch.optim.Optimizer) if optimizers is not None else frozenset()
    picked = _of_types(kinds | optimizer_kinds, young)  # the few kept are split afterwards
    tensors = picked
    if optimizers is not None:
        optimizers.extend(o for o in picked if type(o) in optimizer_kinds)
        tensors = [o for o in picked if type(o) in kinds]
    del picked
    found = []
    for t in tensors:
        if id(t) in exclude_ids:
            continue
        try:
            node = t.grad_fn
            if node is None:
                continue
            if is_a(t._base, nn.Parameter):
                if views is not None:
                    views.append(node)
                continue
        except Exception:  # noqa: BLE001 - a subclass whose grad_fn raises outside its mode holds nothing we can name
            continue
        found.append(t)
    return found


def promotions() -> tuple[int, int]:
    """How many collections of the middle and the oldest generation ran so far: while it does not change,
    every object made since is still in one of the two young generations."""
    stats = gc.get_stats()
    return stats[1]["collections"], stats[2]["collections"]


def live_tensors() -> list[torch.Tensor]:
    """Every live tensor of any subclass, parameters included (not the tensors torch traces with), in one
    ``gc.get_objects()`` pass told apart by exact type in C, as :func:`live_graph_tensors` does."""
    return _of_types(frozenset(c for c in _subclasses(torch.Tensor) if not _traced_with(c)))


def _of_types(kinds: frozenset[type], young: bool = False) -> list[Any]:
    """The collector's objects whose exact type is in ``kinds`` (``young``: of its two young generations
    only), told apart in one pass in C."""
    objects = gc.get_objects(0) + gc.get_objects(1) if young else gc.get_objects()
    found = list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
    del objects  # it refers to every object: no search may run while it lives
    return found


def _subclasses(base: type) -> frozenset[type]:
    """``base`` and every subclass of it defined now."""
    found: set[type] = {base}
    stack: list[type] = [base]
    while stack:
        subclasses: list[type] = type.__subclasses__(stack.pop())
        for sub in subclasses:
            if sub not in found:
                found.add(sub)
                stack.append(sub)
    return frozenset(found)


def _tensor_types() -> frozenset[type]:
    """``torch.Tensor`` and every subclass of it defined now; not parameters, nor the tensors torch
    itself traces with."""
    found = _subclasses(torch.Tensor)
    return frozenset(c for c in found if not issubclass(c, nn.Parameter) and not _traced_with(c))


def _traced_with(cls: type) -> bool:
    """A tensor subclass torch makes for tracing (``torch._subclasses``: FakeTensor, FunctionalTensor)."""
    module = cls.__dict__.get("__module__")
    return isinstance(module, str) and module.startswith("torch._subclasses.")
