"""The loss contract: the loss that will be back-propagated can produce the gradients training expects.

A ``.detach()`` placed *before* the loss function makes the loss graph-less (backward raises later,
far from the cause) or, worse, leaves it requiring grad through another path (a value head, a KL
term) while the policy gets zero gradient and the loss curve looks normal. ``requires_grad`` catches
the first; only a walk proving the graph reaches the trainable parameters catches the second.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import torch
from torch import nn

from ._errors import LossContractError
from ._graph import unreached_params

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


def check_loss(loss: T, *, name: str = "scaled_loss", params: Params | None = None) -> T:
    """Return ``loss`` unchanged after checking it can train.

    When grad is enabled and ``loss`` is a tensor: raise :class:`LossContractError` if it does not
    require grad; with ``params`` (a module, or an iterable of parameters or ``(name, parameter)``
    pairs), also raise if its graph does not reach every trainable parameter, naming those missed.
    Non-tensor losses and calls under ``torch.no_grad()`` are not checked. The graph walk visits
    each node once and runs nothing.
    """
    if not isinstance(loss, torch.Tensor) or not torch.is_grad_enabled():
        return loss
    if not loss.requires_grad:
        raise LossContractError(
            f"{name} does not require grad, so backward() cannot train anything from it "
            f"(shape={tuple(loss.shape)}, grad_fn=None). {_TRAP}"
        )
    if params is not None:
        missing = unreached_params(loss, named_params(params))
        if missing:
            shown = ", ".join(missing[:10]) + (f", ... ({len(missing)} in all)" if len(missing) > 10 else "")
            raise LossContractError(
                f"{name} requires grad, but its graph reaches none of these trainable parameters: "
                f"{shown}. They would get zero gradient while the loss curve looks normal (the loss "
                f"still requires grad through another path, e.g. a value head or a KL term). {_TRAP}"
            )
    return loss


# Provisional: moved here from _step.py; the graph-contract branch replaces it.
import itertools  # noqa: E402
from typing import Literal  # noqa: E402

from ._errors import GradGuardError, LossContractWarning  # noqa: E402

Check = Literal["requires_grad", "reaches_params"] | None
CHECKS = ("requires_grad", "reaches_params", None)


class LossCheck:
    """One configured loss check: what to check, how often the graph walk runs, what a violation does."""

    __slots__ = ("check", "params", "check_every", "on_violation", "name", "_calls", "_active", "walks")

    def __init__(
        self,
        check: Check = "requires_grad",
        params: Params | None = None,
        check_every: int = 1,
        on_violation: str = "raise",
        name: str = "scaled_loss",
        what: str = "on_violation",
    ) -> None:
        if check not in CHECKS:
            raise GradGuardError(f"check={check!r} is not accepted; accepted: {CHECKS}")
        if check == "reaches_params" and params is None:
            raise GradGuardError("check='reaches_params' needs params= (a module or its parameters)")
        if not isinstance(check_every, int) or check_every < 1:
            raise GradGuardError(f"check_every must be a positive int, got {check_every!r}")
        if on_violation not in ("raise", "warn", "off"):
            raise GradGuardError(f"{what}={on_violation!r} is not accepted; accepted: 'raise', 'warn', 'off'")
        self.check, self.params, self.check_every = check, params, check_every
        self.on_violation, self.name = on_violation, name
        self._calls = itertools.count()
        self._active = check is not None and on_violation != "off"
        self.walks = check == "reaches_params"

    def __call__(self, loss: object) -> None:
        if not self._active:
            return
        walk = self.walks and next(self._calls) % self.check_every == 0
        if not walk and type(loss) is torch.Tensor and loss.requires_grad:
            return
        try:
            check_loss(loss, name=self.name, params=self.params if walk else None)
        except LossContractError as exc:
            if self.on_violation == "raise":
                raise
            from ._site import caller, warn_at

            warn_at(str(exc), LossContractWarning, caller())
