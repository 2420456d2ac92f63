"""megatron-core: guard ``forward_data_store`` where the pipeline schedules append to it.

* megatron-core >= 0.14: ``schedules.forward_step_calc_loss`` (every schedule, and the combined-1F1B
  path, which imports it inside a function and so sees the patch): what it appends to
  ``forward_data_store`` is detached, and the loss ``loss_func`` returned is checked (see
  :func:`_calc_loss_wrapper` for how, per mode).
* 0.12 / 0.13 (loss code inside ``forward_step``): ``schedules.forward_step`` receives the guarded
  store, and ``forward_step_func`` is wrapped so that the ``loss_func`` it returns is checked.

Nothing else is guarded: the schedules' ``input_tensors`` / ``output_tensors`` hold graphs on purpose.
Megatron skips backward on stages whose output does not require grad (vision-encoder stages), so a
loss that does not require grad is a :class:`gradguard.LossContractWarning` by default; see
:func:`configure`.
"""

from __future__ import annotations

import functools
from importlib import metadata
from types import ModuleType
from typing import Any

import torch

from .._policy import DETACH, OFF, resolve
from .._publish import publish_into
from .._step import LossCheck
from .._store import guarded
from . import _patch

__all__ = ["MODULES", "configure", "instrument", "uninstrument", "version"]

MODULES = ("megatron.core.pipeline_parallel.schedules",)
STORE_NAME = "megatron.forward_data_store"
_loss_check = LossCheck("requires_grad", on_violation="warn", name="megatron loss_func loss")


def configure(*, loss_check: str = "warn") -> None:
    """What a last-stage loss that does not require grad does: ``"warn"`` (default), ``"raise"``, ``"off"``."""
    global _loss_check
    _loss_check = LossCheck("requires_grad", on_violation=loss_check, name="megatron loss_func loss")


def version() -> str | None:
    """The installed megatron-core version, or ``None``."""
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def _guard_store(store: Any) -> Any:
    return store if store is None else guarded(store, STORE_NAME)


def _check(loss: Any) -> None:
    if type(loss) is not torch.Tensor or not loss.requires_grad:  # else it passes: skip the call
        _loss_check(loss)


def _call_checked(loss_func: Any, *args: Any, **kwargs: Any) -> Any:
    outputs = loss_func(*args, **kwargs)
    if not kwargs.get("non_loss_data") and isinstance(outputs, (tuple, list)) and outputs:
        _check(outputs[0])
    return outputs


def _checked_loss_func(loss_func: Any) -> Any:
    """``loss_func`` wrapped to check the loss it returns (a partial: cheap to build per call)."""
    if loss_func is None or (type(loss_func) is functools.partial and loss_func.func is _call_checked):
        return loss_func
    return functools.partial(_call_checked, loss_func)


def _checked_forward_step_func(forward_step_func: Any) -> Any:
    def step(*args: Any, **kwargs: Any) -> Any:
        result = forward_step_func(*args, **kwargs)
        if isinstance(result, tuple) and len(result) == 2 and callable(result[1]):
            return result[0], _checked_loss_func(result[1])
        return result

    return step


def _guarding(store_index: int, fn_index: int, fn_name: str, check: Any) -> Any:
    """A wrapper giving the call a guarded ``forward_data_store`` and a checking ``fn_name`` argument."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if resolve(None) == OFF:
            return wrapped(*args, **kwargs)
        args, kwargs = _patch.replace_arg(args, kwargs, store_index, "forward_data_store", _guard_store)
        args, kwargs = _patch.replace_arg(args, kwargs, fn_index, fn_name, check)
        return wrapped(*args, **kwargs)

    return wrapper


# >= 0.14: forward_step_calc_loss(model, output_tensor, loss_func, config, vp_stage,
#          collect_non_loss_data, num_microbatches, forward_data_store, cp_group_size, is_last_stage)
_calc_loss_any_call = _guarding(7, 2, "loss_func", _checked_loss_func)


def _calc_loss_wrapper(frames: int) -> Any:
    """The wrapper of ``forward_step_calc_loss``; ``frames``: gradguard's frames between the schedule
    and it (0, or 1 for a call through ``_PlainFunctionWrapper.__call__``: see ``_patch.install``).

    For the schedules' own call (ten positional arguments):

    * ``detach`` mode, a ``list`` store: the records the call appended are detached as it returns
      (building a wrapt proxy per call would cost more than the call's own Python work); stats
      attribute them to the schedule line that called ``forward_step_calc_loss``. ``warn`` and
      ``raise`` guard the store during the call, so messages name the append line itself.
    * With ``is_last_stage`` given, the loss is checked on the result: at the last stage, with a
      ``loss_func`` and no ``collect_non_loss_data``, the returned ``output_tensor`` is the loss
      ``loss_func`` returned, scaled in place. Without it (combined 1F1B), ``loss_func`` is wrapped.
    """
    skip = 1 + frames  # publish_into's call-site search starts above this wrapper's frame and those

    def calc_loss(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mode = resolve(None)
        if kwargs or len(args) != 10 or args[9] is None or mode == OFF:
            return _calc_loss_any_call(wrapped, instance, args, kwargs)
        store = args[7]
        if mode == DETACH and type(store) is list:
            start = len(store)
            try:
                result = wrapped(*args)
            finally:
                for i in range(start, len(store)):
                    store[i] = publish_into(None, STORE_NAME, mode, None, store[i], skip)
        else:
            replaced = list(args)
            replaced[7] = _guard_store(store)
            result = wrapped(*replaced)
        if args[9] and args[2] is not None and not args[5]:
            _check(result[0])  # a warning names the schedule line that called forward_step_calc_loss
        return result

    return calc_loss


_calc_loss, _calc_loss_direct = _calc_loss_wrapper(0), _calc_loss_wrapper(1)


# 0.12 / 0.13: forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
#              forward_data_store, config, ...)
_forward_step_legacy = _guarding(5, 0, "forward_step_func", _checked_forward_step_func)


def _target(module: ModuleType) -> tuple[str, Any, Any]:
    """The attribute to patch, its wrapper, and the wrapper for direct calls (``_patch.install``)."""
    if hasattr(module, "forward_step_calc_loss"):
        return "forward_step_calc_loss", _calc_loss, _calc_loss_direct
    return "forward_step", _forward_step_legacy, None


def instrument(module: ModuleType) -> None:
    """Patch ``megatron.core.pipeline_parallel.schedules`` (idempotent)."""
    attr, wrapper, direct = _target(module)
    _patch.install(module, attr, wrapper, direct)


def uninstrument(module: ModuleType) -> None:
    """Restore the original function object."""
    _patch.uninstall(module, _target(module)[0])
