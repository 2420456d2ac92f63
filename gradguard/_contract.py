"""The loss contract: the loss that will be back-propagated can produce the gradients training expects.

A ``.detach()`` placed *before* the loss function makes the loss graph-less (backward raises later,
far from the cause) or, worse, leaves it requiring grad through another path (a value head, a KL
term) while the policy gets zero gradient and the loss curve looks normal. ``requires_grad`` catches
the first; only a walk proving the graph reaches the trainable parameters catches the second.

:func:`check_loss` never runs backward and never changes the loss or its graph.

Where the walk cannot decide (see :func:`gradguard._graph.unreached_params`: a recomputing checkpoint
it cannot look into, FSDP2 parameters it cannot map, a ``torch.func`` transform) the check passes and
says so with a :class:`LossContractWarning`: a check that silently stops checking would be trusted
where it protects nothing, and an error there could be false.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from ._errors import LossContractError, LossContractWarning
from ._graph import unreached_params
from ._report import warn_outside

__all__ = ["Params", "check_loss", "named_params"]

T = TypeVar("T")
Params = nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

_TRAP = (
    "This is what a .detach() placed before the loss function does: detach what you publish "
    "(metrics, model_output) *after* the loss is computed, and return the loss itself undetached."
)


def named_params(params: Params) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs from a module, an iterable of tensors, or of ``(name, tensor)`` pairs."""
    if isinstance(params, nn.Module):
        return list(params.named_parameters())
    if isinstance(params, torch.Tensor):
        return [("param", params)]
    if not isinstance(params, Iterable):
        raise TypeError(
            f"params must be an nn.Module, an iterable of parameters, or of (name, parameter) "
            f"pairs; got {type(params).__qualname__}"
        )
    pairs = []
    for i, item in enumerate(params):
        if isinstance(item, torch.Tensor):
            pairs.append((f"param[{i}]", item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            pairs.append((str(item[0]), item[1]))
        else:
            raise TypeError(
                f"params[{i}] is a {type(item).__qualname__}; accepted: a parameter tensor or a (name, parameter) pair"
            )
    return pairs


def _for_walk(params: Params) -> nn.Module | list[tuple[str, torch.Tensor]]:
    """A module stays a module (FSDP2's parameters are mapped through it); anything else becomes pairs."""
    return params if isinstance(params, nn.Module) else named_params(params)


def _shown(names: tuple[str, ...]) -> str:
    return ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10 else "")


def _verdict(
    loss: Any, name: str, params: nn.Module | list[tuple[str, torch.Tensor]] | None
) -> tuple[str | None, str | None]:
    """``(violation, undecided)``: the error message for ``loss``, and what the walk could not decide.

    Not checked (both ``None``): a non-tensor, and grad disabled.
    """
    if not isinstance(loss, torch.Tensor) or not torch.is_grad_enabled():
        return None, None
    if not loss.requires_grad:
        return (
            f"{name} does not require grad, so backward() cannot train anything from it "
            f"(shape={tuple(loss.shape)}, grad_fn=None). {_TRAP}"
        ), None
    if params is None:
        return None, None
    found = unreached_params(loss, params)
    violation = undecided = None
    if found.missing:
        violation = (
            f"{name} requires grad, but its graph reaches none of these trainable parameters: "
            f"{_shown(found.missing)}. They would get zero gradient while the loss curve looks normal (the loss "
            f"still requires grad through another path, e.g. a value head or a KL term). {_TRAP}"
        )
    if found.undecided:
        undecided = (
            f"{name}: gradguard cannot decide whether its graph reaches these trainable parameters, so "
            f"it let them pass unchecked: {_shown(found.undecided)}. Why: {found.why}."
        )
    return violation, undecided


def check_loss(loss: T, *, name: str = "scaled_loss", params: Params | None = None) -> T:
    """Return ``loss`` unchanged after checking it can train.

    When grad is enabled and ``loss`` is a tensor: raise :class:`LossContractError` if it does not
    require grad; with ``params`` (a module, or an iterable of parameters or ``(name, parameter)``
    pairs), also raise if its graph does not reach every trainable parameter, naming those missed.
    Where the graph walk cannot decide for some parameters (see the module docstring) they pass,
    with a :class:`LossContractWarning` saying which and why (Python shows it once per call site).
    Not checked: non-tensor losses and calls under ``torch.no_grad()``. The graph walk visits each
    node once and runs nothing.
    """
    violation, undecided = _verdict(loss, name, None if params is None else _for_walk(params))
    if violation is not None:
        raise LossContractError(violation)
    if undecided is not None:
        warn_outside(undecided, LossContractWarning)
    return loss
