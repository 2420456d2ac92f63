"""``@gradguard.forward_step``: keep the loss live and checked, publish everything else.

The result shapes it understands are in :func:`forward_step`'s docstring and
:mod:`gradguard._guards.results`; the guide: ``docs/guide/loss-contract.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from .._errors import GradGuardError
from .arguments import MISSING, Argument
from .contract import Check, LossCheck, Params
from .results import Labels, guard_loss_func, guard_result, with_items
from .wrapper import function_wrapper, kind

__all__ = ["forward_step"]

_DEFAULT_CHECK: Any = object()


def forward_step(
    fn: Callable[..., Any] | None = None,
    *,
    loss: Hashable = 0,
    forward_only: str | None = "forward_only",
    check: Check = _DEFAULT_CHECK,
    params: Params | None = None,
    check_every: int = 1,
) -> Callable[..., Any]:
    """Decorate an engine's ``forward_step`` (function, method or ``async def``); usable bare or with options.

    Two result shapes are understood, told apart by whether the second element is callable:

    * verl style ``(loss, output, ...)`` (or a mapping): the element at ``loss`` stays live and is
      checked unless the call is forward-only or grad is disabled; every other element is published.
    * Megatron style ``(output_tensor, loss_func)``: the output tensor is left alone (Megatron
      back-propagates it); ``loss_func`` is wrapped so that its ``(loss, [num_tokens,] report)`` keeps
      the loss live and checked and publishes the rest.

    The mode is read at each call, so ``enforce()``, ``set_mode()`` and ``GRADGUARD`` apply to functions
    decorated before them. ``async def`` functions are awaited first. The decorated function keeps its
    name, docstring and signature.

    Args:
        fn: The function, when used bare (``@gradguard.forward_step``); ``None`` when called with options.
        loss: The index (or mapping key) of the live loss in a verl-style result.
        forward_only: The name of the argument that marks forward-only calls, whose loss is not
            checked; ``None``: no such argument.
        check: ``"requires_grad"``, ``"reaches_params"`` (needs ``params``) or ``None`` (checks
            nothing); left out, ``"reaches_params"`` when ``params`` is given, else ``"requires_grad"``.
        params: For ``"reaches_params"``: a module (its parameters re-read at each walk), or its
            parameters, or ``(name, parameter)`` pairs, read once, here.
        check_every: Run the ``reaches_params`` graph walk on every N-th call only (the other calls
            still check ``requires_grad``); a positive ``int``.

    Returns:
        The guarded function when ``fn`` is given, else a decorator that guards the function it is given.

    Raises:
        GradGuardError: a bad option (naming it and what is accepted), or, when decorating, a class or a
            generator function; a call whose verl-style result has no element at ``loss``.
        TypeError: decorating something that is not callable.
        LossContractError: at a call, the loss fails its check (see :func:`check_loss`).
    """
    if check is _DEFAULT_CHECK:
        check = "reaches_params" if params is not None else "requires_grad"
    checked = LossCheck(check, params, check_every)  # validates every option, also when check is None
    loss_check = checked if check is not None else None

    def decorate(func: Callable[..., Any]) -> Any:
        if not callable(func):
            raise TypeError(
                f"gradguard.forward_step decorates a function or method, got {type(func).__qualname__}; "
                "pass options as keywords: @gradguard.forward_step(loss=..., check=...)"
            )
        if isinstance(func, type):
            raise GradGuardError(
                f"gradguard.forward_step cannot decorate the class {func.__qualname__!r}: it would wrap its "
                "constructor, whose result is the object, not a step's (loss, output). Decorate the method that "
                "returns them: @gradguard.forward_step on def forward_step(self, ...) inside the class"
            )
        how = kind(func)
        if how in ("generator", "async generator"):
            raise GradGuardError(
                f"gradguard.forward_step cannot decorate {getattr(func, '__qualname__', func)!r}, a {how} function: "
                "its steps come out one by one as it is iterated. Decorate the function that returns each "
                "step's (loss, output), or guard the store the steps are kept in (gradguard.guard)"
            )
        label = getattr(func, "__qualname__", repr(func))
        labels, loss_func_labels = Labels(label), Labels(f"{label} loss_func")
        flag = _flag(func, forward_only)

        def guarded(result: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if (
                isinstance(result, (tuple, list))
                and len(result) == 2
                and callable(result[1])
                and not callable(result[0])
            ):
                return with_items(result, {1: guard_loss_func(result[1], loss_func_labels, loss_check)})
            checking = loss_check
            if checking is not None:
                only = flag.get(instance, args, kwargs) if flag is not None else kwargs.get(forward_only or "", False)
                if (only is not MISSING and only) or not torch.is_grad_enabled():
                    checking = None  # forward-only, or no grad: no loss to train with
            return guard_result(result, loss, labels, checking)

        if how == "coroutine":

            def wrapper(
                wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> Any:
                async def step() -> Any:
                    return guarded(await wrapped(*args, **kwargs), instance, args, kwargs)

                return step()

        else:

            def wrapper(
                wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> Any:
                return guarded(wrapped(*args, **kwargs), instance, args, kwargs)

        return function_wrapper(func, wrapper)

    return decorate(fn) if fn is not None else decorate


def _flag(func: Callable[..., Any], name: str | None) -> Argument | None:
    """The ``forward_only`` parameter, where ``func`` has one by that name."""
    if name is None:
        return None
    try:
        return Argument(func, name)
    except GradGuardError:
        return None  # not a named parameter: only a keyword into **kwargs can pass it
