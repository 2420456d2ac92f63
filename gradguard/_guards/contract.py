"""The loss contract: the loss that will be back-propagated can produce the gradients training expects.

A ``.detach()`` placed *before* the loss function makes the loss graph-less (backward raises later,
far from the cause) or, worse, leaves it requiring grad through another path (a value head, a KL
term) while the policy gets zero gradient and the loss curve looks normal. ``requires_grad`` catches
the first; only a walk proving the graph reaches the trainable parameters catches the second.

:func:`check_loss` is the one-shot public check; :class:`LossCheck` is a configured, repeated one
(the ``@forward_step`` decorator and the engine adapters hold one each). Both never run backward
and never change the loss or its graph.

Where the walk cannot decide (see :func:`gradguard._graph.reach.unreached_params`: a recomputing checkpoint
it cannot look into, FSDP2 parameters it cannot map, a ``torch.func`` transform) the check passes and
says so with a :class:`LossContractWarning`: a check that silently stops checking would be trusted
where it protects nothing, and an error there could be false.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from .._errors import GradGuardError, LossContractError, LossContractWarning
from .._graph.reach import active_transform, unreached_params
from .._policy import validate
from .._policy.site import caller, warn_at

__all__ = ["Check", "LossCheck", "Params", "check_loss", "named_params"]

T = TypeVar("T")
Params = nn.Module | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Check = Literal["requires_grad", "reaches_params"] | None
CHECKS: tuple[Check, ...] = ("requires_grad", "reaches_params", None)
ON_VIOLATION = ("raise", "warn", "off")

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
    """A module stays a module (re-read at every walk); anything else is read once, into pairs."""
    return params if isinstance(params, nn.Module) else named_params(params)


def _shown(names: tuple[str, ...]) -> str:
    return ", ".join(names[:10]) + (f", ... ({len(names)} in all)" if len(names) > 10 else "")


def _verdict(
    loss: Any, name: str, params: nn.Module | list[tuple[str, torch.Tensor]] | None
) -> tuple[str | None, str | None]:
    """``(violation, undecided)``: the error message for ``loss``, and what the walk could not decide.

    Not checked (both ``None``): a non-tensor, grad disabled, and a loss inside a forward-mode or
    batching transform (``torch.func.jvp``/``jacfwd``/``vmap``/``functionalize``, or eager
    ``torch.autograd.forward_ad`` with a tangent): there it is not the value backward will run
    from. Inside ``torch.func.grad`` a loss that does not require grad is an error: ``grad``
    would silently return zeros.
    """
    if not isinstance(loss, torch.Tensor) or not torch.is_grad_enabled():
        return None, None
    if active_transform() not in (None, "Grad"):
        return None, None
    if not loss.requires_grad:
        if torch.autograd.forward_ad.unpack_dual(loss).tangent is not None:
            return None, None
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

    Checked when grad is enabled and ``loss`` is a tensor. Not checked: non-tensor losses, calls under
    ``torch.no_grad()``, and losses inside ``torch.func`` forward-mode or batching transforms (``jvp``,
    ``jacfwd``, ``vmap``). The graph walk visits each node once and runs nothing; it never runs
    backward and never changes the loss or its graph.

    Args:
        loss: The loss that will be back-propagated.
        name: The loss's name in messages.
        params: The trainable parameters its graph must reach: a module, or an iterable of parameters
            or of ``(name, parameter)`` pairs; ``None`` checks only that ``loss`` requires grad.

    Returns:
        ``loss`` itself.

    Raises:
        LossContractError: ``loss`` does not require grad, or its graph does not reach every trainable
            parameter of ``params`` (naming those missed).
        TypeError: ``params`` is none of the accepted kinds, naming the item that is not.

    Warns:
        LossContractWarning: where the walk cannot decide for some parameters (a recomputing checkpoint
            it cannot look into, FSDP2 parameters it cannot map), naming them and why; they pass.
    """
    violation, undecided = _verdict(loss, name, None if params is None else _for_walk(params))
    if violation is not None:
        raise LossContractError(violation)
    if undecided is not None:
        warn_at(undecided, LossContractWarning, caller())
    return loss


class LossCheck:
    """One configured loss check: what to check, how often the graph walk runs, what a violation does.

    Calling it with a loss checks it as :func:`check_loss` does. What the walk cannot decide is a
    :class:`LossContractWarning` once per ``LossCheck``, whatever ``on_violation`` says (a guess
    is never an error).

    Args:
        check: ``"requires_grad"``, ``"reaches_params"`` (needs ``params``) or ``None`` (checks nothing).
        params: Used by ``"reaches_params"`` only: an ``nn.Module``, whose parameters are re-read at
            every walk (so parameters added or replaced later, by ``fully_shard`` or PEFT, are seen;
            under FSDP2 pass the module), or one tensor, or an iterable of parameters or of
            ``(name, parameter)`` pairs (a list, or a one-shot iterator such as ``model.parameters()``),
            read once, here.
        check_every: Run the walk on every N-th call only; the other calls still check ``requires_grad``.
        on_violation: ``"raise"`` (a :class:`LossContractError`), ``"warn"`` (a
            :class:`LossContractWarning`) or ``"off"``.
        name: The loss's name in messages.
        on_violation_option: The name the user set ``on_violation`` by (an adapter's own option),
            shown when its value is refused.

    Raises:
        GradGuardError: a bad option, naming it and what is accepted.
    """

    __slots__ = (
        "check",
        "params",
        "check_every",
        "on_violation",
        "name",
        "walks",
        "_calls",
        "_active",
        "_undecided_told",
    )

    def __init__(
        self,
        check: Check = "requires_grad",
        params: Params | None = None,
        check_every: int = 1,
        on_violation: str = "raise",
        name: str = "scaled_loss",
        *,
        on_violation_option: str = "on_violation",
    ) -> None:
        if check not in CHECKS:
            raise validate.refusal("check", check, ", ".join(repr(c) for c in CHECKS))
        if check == "reaches_params" and params is None:
            raise GradGuardError("check='reaches_params' needs params= (a module or its parameters)")
        if check != "reaches_params" and params is not None:
            raise GradGuardError(
                f"params= is read only by check='reaches_params', but check={check!r}: pass "
                "check='reaches_params' to check that the loss's graph reaches them, or drop params="
            )
        validate.whole(check_every, what="check_every", least=1, text=False)
        if on_violation not in ON_VIOLATION:
            raise validate.refusal(on_violation_option, on_violation, ", ".join(repr(v) for v in ON_VIOLATION))
        self.check, self.check_every, self.on_violation, self.name = check, check_every, on_violation, name
        self.params = None if params is None else _for_walk(params)
        self.walks = check == "reaches_params"
        self._active = check is not None and on_violation != "off"
        self._calls = itertools.count()
        self._undecided_told = False  # the "cannot decide" warning was given

    def __call__(self, loss: Any) -> None:
        if not self._active:
            return
        walk = self.walks and next(self._calls) % self.check_every == 0
        if not walk and type(loss) is torch.Tensor and loss.requires_grad:
            return  # passes: the common case, decided without the call below
        violation, undecided = _verdict(loss, self.name, self.params if walk else None)
        if violation is not None:
            if self.on_violation == "raise":
                raise LossContractError(violation)
            warn_at(violation, LossContractWarning, caller())
        if undecided is not None and not self._undecided_told:
            self._undecided_told = True
            warn_at(undecided, LossContractWarning, caller())
