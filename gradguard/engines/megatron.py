"""megatron-core: guard ``forward_data_store`` where the pipeline schedules append to it.

* megatron-core >= 0.14: ``schedules.forward_step_calc_loss`` (every schedule, and the combined-1F1B
  path, which imports it inside a function and so sees the patch): what it appends to
  ``forward_data_store`` is detached, and the loss ``loss_func`` returned is checked.
* 0.12 / 0.13 (loss code inside ``forward_step``): ``schedules.forward_step`` receives a guarded
  store, and ``forward_step_func`` is wrapped so that the ``loss_func`` it returns is checked.

The argument positions come from the function's signature when the adapter installs; a release whose
signature lost one of the parameters it reads is refused with a message naming the parameter.

Nothing else is guarded: the schedules' ``input_tensors`` / ``output_tensors`` hold graphs on purpose.
Megatron skips backward on stages whose output does not require grad (vision-encoder stages), so a
loss that does not require grad is a :class:`gradguard.LossContractWarning` by default; see
:func:`configure`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .._boundary.publish import publish
from .._guards import patch as _patch
from .._guards.arguments import MISSING, Argument
from .._guards.contract import LossCheck
from .._guards.results import guard_loss_func
from .._guards.store import guard_in_place
from .._policy.modes import DETACH, OFF, resolve
from ._adapter import Adapter

__all__ = ["ADAPTER", "STORE_NAME", "configure"]

STORE_NAME = "megatron.forward_data_store"
_loss_check = LossCheck("requires_grad", on_violation="warn", name="megatron loss_func loss")


def configure(*, loss_check: str = "warn") -> None:
    """Set what a last-stage loss that does not require grad does, for every schedule from now on.

    Megatron skips backward on stages whose output does not require grad (vision-encoder stages), so
    by default such a loss is a warning, not an error.

    Args:
        loss_check: ``"warn"`` (a :class:`gradguard.LossContractWarning`), ``"raise"`` (a
            :class:`gradguard.LossContractError`) or ``"off"``.

    Raises:
        GradGuardError: any other ``loss_check``, naming it and what is accepted.
    """
    global _loss_check
    _loss_check = LossCheck(
        "requires_grad", on_violation=loss_check, name="megatron loss_func loss", on_violation_option="loss_check"
    )


def _guard_store(store: Any) -> Any:
    return store if store is None else guard_in_place(store, STORE_NAME)


def _checked_loss_func(loss_func: Any) -> Any:
    """``loss_func`` wrapped to check the loss it returns (what it reports goes to the guarded store)."""
    return loss_func if loss_func is None else guard_loss_func(loss_func, None, _loss_check)


def _checked_forward_step_func(forward_step_func: Any) -> Any:
    def step(*args: Any, **kwargs: Any) -> Any:
        result = forward_step_func(*args, **kwargs)
        if isinstance(result, tuple) and len(result) == 2 and callable(result[1]):
            return result[0], _checked_loss_func(result[1])
        return result

    return step


def _arguments(func: Any, names: tuple[str, ...]) -> list[Argument]:
    what = f"megatron-core's {getattr(func, '__qualname__', func)}"
    hint = (
        f"The gradguard megatron adapter reads it; this megatron-core release ({ADAPTER.version()}) is "
        f"outside the supported range {ADAPTER.supported!r}"
    )
    return [Argument(func, name, what=what, hint=hint) for name in names]


def _calc_loss_wrapper(func: Any) -> Any:
    """The wrapper of ``forward_step_calc_loss`` (>= 0.14).

    * ``detach`` mode, a ``list`` store: the records the call appended are detached as it returns,
      even when it raises; stats attribute them to the line that called ``forward_step_calc_loss``.
      ``warn`` and ``raise`` guard the store during the call, so messages name the append line itself.
    * With ``is_last_stage`` given, the loss is checked on the result: at the last stage, with a
      ``loss_func`` and no ``collect_non_loss_data``, the returned ``output_tensor`` is the loss
      ``loss_func`` returned, scaled in place. Without it (combined 1F1B), ``loss_func`` is wrapped.
    """
    store_arg, loss_func_arg, last_arg, non_loss_arg = _arguments(
        func, ("forward_data_store", "loss_func", "is_last_stage", "collect_non_loss_data")
    )

    def calc_loss(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mode = resolve(None)
        if mode == OFF:
            return wrapped(*args, **kwargs)
        last = last_arg.get(instance, args, kwargs)
        if last is MISSING or last is None:
            args, kwargs = store_arg.replace(instance, args, kwargs, _guard_store)
            args, kwargs = loss_func_arg.replace(instance, args, kwargs, _checked_loss_func)
            return wrapped(*args, **kwargs)
        store = store_arg.get(instance, args, kwargs)
        if mode == DETACH and type(store) is list:
            start = len(store)
            try:
                result = wrapped(*args, **kwargs)
            finally:
                for i in range(start, len(store)):
                    store[i] = publish(store[i], STORE_NAME, mode)
        else:
            args, kwargs = store_arg.replace(instance, args, kwargs, _guard_store)
            result = wrapped(*args, **kwargs)
        if (
            last
            and loss_func_arg.get(instance, args, kwargs) is not None
            and not non_loss_arg.get(instance, args, kwargs)
        ):
            _loss_check(result[0])  # a warning names the line that called forward_step_calc_loss
        return result

    return calc_loss


def _legacy_wrapper(func: Any) -> Any:
    """The wrapper of 0.12 / 0.13's ``forward_step``: a guarded store and a checking ``forward_step_func``."""
    store_arg, step_arg = _arguments(func, ("forward_data_store", "forward_step_func"))

    def forward_step(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if resolve(None) == OFF:
            return wrapped(*args, **kwargs)
        args, kwargs = store_arg.replace(instance, args, kwargs, _guard_store)
        args, kwargs = step_arg.replace(instance, args, kwargs, _checked_forward_step_func)
        return wrapped(*args, **kwargs)

    return forward_step


def _target(module: ModuleType) -> str:
    return "forward_step_calc_loss" if hasattr(module, "forward_step_calc_loss") else "forward_step"


class MegatronAdapter(Adapter):
    """Guards ``forward_data_store`` where megatron-core's pipeline schedules append to it."""

    name = "megatron"
    modules = ("megatron.core.pipeline_parallel.schedules",)
    package = "megatron-core"
    supported = ">=0.12,<0.20"

    def instrument(self, module: ModuleType) -> None:
        """Patch ``megatron.core.pipeline_parallel.schedules`` (idempotent)."""
        attr = _target(module)
        if _patch.is_installed(module, attr):
            return
        func = getattr(module, attr)
        wrapper = _calc_loss_wrapper(func) if attr == "forward_step_calc_loss" else _legacy_wrapper(func)
        _patch.install(module, attr, wrapper)

    def uninstrument(self, module: ModuleType) -> None:
        """Restore the original function object."""
        _patch.uninstall(module, _target(module))


ADAPTER = MegatronAdapter()
