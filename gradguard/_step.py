"""``@gradguard.forward_step``: keep the loss live and checked, publish everything else.

Two result shapes are understood, told apart by whether the second element is callable:

* verl style ``(loss, output, ...)`` (or a dict): the element at ``loss`` stays live and is checked
  unless the call is forward-only or grad is disabled; every other element goes through the active
  mode as one record, so messages show paths such as ``[1]['model_output']['log_probs']``.
* Megatron style ``(output_tensor, loss_func)``: the output tensor is left alone (Megatron
  back-propagates it); ``loss_func`` is wrapped so that its ``(loss, [num_tokens,] report)`` keeps the
  loss live and checked and publishes the rest.

The same pieces serve the engine adapters (``gradguard.engines``).
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from ._contract import Params, check_loss
from ._errors import GradGuardError, LossContractError, LossContractWarning
from ._policy import OFF, _env_mode, resolve
from ._publish import publish, publish_into
from ._report import warn_outside
from ._wrapper import Wrapper, function_wrapper

__all__ = ["Labels", "LossCheck", "forward_step", "guard_loss_func", "guard_result"]

Check = Literal["requires_grad", "reaches_params"] | None
_CHECKS = ("requires_grad", "reaches_params", None)
Kwargs = dict[str, Any]
_Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled


class LossCheck:
    """One configured loss check: what to check, how often the graph walk runs, what a violation does.

    ``on_violation`` is ``"raise"`` (a :class:`LossContractError`), ``"warn"`` (a
    :class:`LossContractWarning`) or ``"off"``.
    """

    __slots__ = ("check", "params", "check_every", "on_violation", "name", "_calls", "_active", "walks")

    def __init__(
        self,
        check: Check = "requires_grad",
        params: Params | None = None,
        check_every: int = 1,
        on_violation: str = "raise",
        name: str = "scaled_loss",
    ) -> None:
        if check not in _CHECKS:
            raise GradGuardError(f"check={check!r} is not accepted; accepted: {_CHECKS}")
        if check == "reaches_params" and params is None:
            raise GradGuardError("check='reaches_params' needs params= (a module or its parameters)")
        if not isinstance(check_every, int) or check_every < 1:
            raise GradGuardError(f"check_every must be a positive int, got {check_every!r}")
        if on_violation not in ("raise", "warn", "off"):
            raise GradGuardError(f"on_violation={on_violation!r} is not accepted; accepted: raise, warn, off")
        self.check, self.params, self.check_every = check, params, check_every
        self.on_violation, self.name = on_violation, name
        self._calls = itertools.count()
        self._active = check is not None and on_violation != "off"
        self.walks = check == "reaches_params"  # when False, a loss that requires grad always passes

    def __call__(self, loss: Any) -> None:
        if not self._active:
            return
        walk = self.walks and next(self._calls) % self.check_every == 0
        if not walk and type(loss) is _Tensor and loss.requires_grad:
            return  # the common, passing case without the call below
        try:
            check_loss(loss, name=self.name, params=self.params if walk else None)
        except LossContractError as exc:
            if self.on_violation == "raise":
                raise
            warn_outside(str(exc), LossContractWarning)


class Labels(dict[Any, str]):
    """Store labels of a result's elements, ``"{label}[{key!r}]"``, built once per key."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def __missing__(self, key: Any) -> str:
        name = self[key] = f"{self.label}[{key!r}]"
        return name


def guard_result(result: Any, loss_key: Any, labels: Labels, check: LossCheck | None, frames: int = 1) -> Any:
    """verl style: check ``result[loss_key]`` and publish every other element (nothing in ``off``).

    Each other element is published as its own record, into the store ``labels[key]``
    (``Engine.forward_step[1]``, path ``['model_output']['log_probs']``). A result with nothing to
    detach comes back as itself; a changed one is rebuilt as its own type, the loss element the very
    same object. ``frames`` counts gradguard's frames between this function and the code whose
    call produced ``result`` (1: the wrapper that called it), where the call site search starts.
    """
    skip = frames + 1  # publish_into's skip: this frame too
    mode = resolve(None)
    if mode == OFF:
        return result
    if type(result) is tuple and len(result) == 2 and loss_key == 0 and type(loss_key) is int:
        loss, item = result  # verl's (loss, output): the common case, without the general loop below
        if check is not None and (check.walks or type(loss) is not _Tensor or not loss.requires_grad):
            check(loss)  # else it passes
        new = publish_into(None, labels[1], mode, None, item, skip)
        return result if new is item else (loss, new)
    if isinstance(result, (tuple, list)):  # before the Mapping ABC check: common, and cheap
        n = len(result)
        if type(loss_key) is not int or not -n <= loss_key < n:
            raise GradGuardError(f"{labels.label} returned {n} elements; loss={loss_key!r} is not an index of them")
        items: Any = enumerate(result)
        loss_at = loss_key % n
        mapping = False
    elif isinstance(result, Mapping):
        if loss_key not in result:
            raise GradGuardError(f"{labels.label} returned a mapping without the loss key {loss_key!r}")
        items = result.items()
        loss_at = loss_key
        mapping = True
    else:  # a bare loss
        if check is not None:
            check(result)
        return result
    if check is not None:
        loss = result[loss_at]
        if check.walks or type(loss) is not _Tensor or not loss.requires_grad:  # else it passes
            check(loss)
    out: Any = None
    for key, item in items:
        if key != loss_at:
            new = publish_into(None, labels[key], mode, None, item, skip)
            if new is not item:
                if out is None:
                    out = copy.copy(result) if mapping else list(result)
                out[key] = new
    cls = type(result)
    if out is None or mapping or cls is list:
        return result if out is None else out
    if cls is tuple:
        return tuple(out)
    return cls._make(out) if hasattr(result, "_fields") else cls(out)


def guard_loss_func(loss_func: Callable[..., Any], labels: Labels, check: LossCheck | None) -> Callable[..., Any]:
    """Megatron style: wrap ``loss_func`` so its loss stays live and checked and the rest is published.

    ``loss_func(output, non_loss_data=True)`` (Megatron's ``collect_non_loss_data``) returns data,
    not a loss: all of it is published.
    """

    def guarded_loss_func(*args: Any, **kwargs: Any) -> Any:
        out = loss_func(*args, **kwargs)
        if kwargs.get("non_loss_data"):
            return publish(labels.label, resolve(None), out)  # off: publish passes it through
        if isinstance(out, (tuple, list)) and len(out) >= 2:
            return guard_result(out, 0, labels, check)
        return out

    guarded_loss_func.__wrapped__ = loss_func  # type: ignore[attr-defined]
    return guarded_loss_func


def forward_step(
    fn: Callable[..., Any] | None = None,
    *,
    loss: Any = 0,
    forward_only: str | None = "forward_only",
    check: Check = "requires_grad",
    params: Params | None = None,
    check_every: int = 1,
) -> Any:
    """Decorate an engine's ``forward_step`` (function or method); usable bare or with options.

    ``loss`` is the index (or dict key) of the live loss in a verl-style result; ``forward_only``
    names the argument that marks forward-only calls (their loss is not checked); ``check`` is
    ``"requires_grad"``, ``"reaches_params"`` (needs ``params``) or ``None``; ``check_every=N`` runs
    the ``reaches_params`` graph walk on every N-th call only. Name, docstring and signature are
    kept. With ``GRADGUARD=off`` at decoration time the function itself is returned.
    """
    loss_check = LossCheck(check, params, check_every) if check is not None else None

    def decorate(func: Callable[..., Any]) -> Any:
        if not callable(func):
            raise TypeError(
                f"gradguard.forward_step decorates a function or method, got {type(func).__qualname__}; "
                "pass options as keywords: @gradguard.forward_step(loss=..., check=...)"
            )
        if _env_mode() == OFF:
            return func
        label = getattr(func, "__qualname__", repr(func))
        labels, loss_func_labels = Labels(label), Labels(f"{label} loss_func")
        locate = _arg_locator(func, forward_only)

        def make_wrapper(frames: int) -> Wrapper:  # frames: gradguard's between the caller and guard_result
            def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: Kwargs) -> Any:
                result = wrapped(*args, **kwargs) if kwargs else wrapped(*args)
                if (
                    isinstance(result, (tuple, list))
                    and len(result) == 2
                    and callable(result[1])
                    and not callable(result[0])
                ):
                    loss_func = guard_loss_func(result[1], loss_func_labels, loss_check)
                    return type(result)((result[0], loss_func))  # type: ignore[misc]
                check = loss_check
                if check is not None:
                    if locate is not None:
                        no_grad_call = locate(instance, args, kwargs)
                    else:  # not a parameter: only a keyword into **kwargs can say so
                        no_grad_call = forward_only in kwargs and kwargs[forward_only]
                    if no_grad_call or not _grad_enabled():
                        check = None  # forward-only, or no grad: no loss to train with
                return guard_result(result, loss, labels, check, frames)

            return wrapper

        return function_wrapper(func, make_wrapper(1), direct=make_wrapper(2))

    return decorate(fn) if fn is not None else decorate


def _arg_locator(
    func: Callable[..., Any], name: str | None
) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None:
    """A fast reader of argument ``name`` from a call's ``(instance, args, kwargs)``.

    ``None`` when ``func`` has no parameter ``name`` (then only a keyword, into ``**kwargs``, can pass it).
    """
    try:
        parameters = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        parameters = []
    names = [p.name for p in parameters]
    if name is None or name not in names:
        return None
    index = names.index(name)
    default = parameters[index].default
    default = None if default is inspect.Parameter.empty else default
    takes_self = bool(names) and names[0] in ("self", "cls")

    def locate(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = index - 1 if instance is not None and takes_self else index
        return args[i] if 0 <= i < len(args) else default

    return locate
