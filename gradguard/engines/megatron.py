"""megatron-core: guard ``forward_data_store`` where the pipeline schedules append to it.

* megatron-core >= 0.14: ``schedules.forward_step_calc_loss`` (every schedule, and the combined-1F1B
  path, which imports it inside a function and so sees the patch) receives a guarded
  ``forward_data_store``; its ``loss_func`` is wrapped to check the loss it returns.
* 0.12 / 0.13 (loss code inside ``forward_step``): ``schedules.forward_step`` receives the guarded
  store, and ``forward_step_func`` is wrapped so that the ``loss_func`` it returns is checked.

Nothing else is guarded: the schedules' ``input_tensors`` / ``output_tensors`` hold graphs on purpose.
Megatron skips backward on stages whose output does not require grad (vision-encoder stages), so a
loss that does not require grad is a :class:`gradguard.LossContractWarning` by default; see
:func:`configure`.
"""

from __future__ import annotations

from importlib import metadata
from types import ModuleType
from typing import Any

from .._policy import OFF, resolve
from .._step import LossCheck
from .._store import guard
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
    return store if store is None else guard(store, name=STORE_NAME)


def _checked_loss_func(loss_func: Any) -> Any:
    if loss_func is None or getattr(loss_func, "__gradguard__", False):
        return loss_func

    def checked(*args: Any, **kwargs: Any) -> Any:
        outputs = loss_func(*args, **kwargs)
        if not kwargs.get("non_loss_data") and isinstance(outputs, (tuple, list)) and outputs:
            _loss_check(outputs[0])
        return outputs

    checked.__gradguard__ = True  # type: ignore[attr-defined]
    checked.__wrapped__ = loss_func  # type: ignore[attr-defined]
    return checked


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
        if resolve(None) != OFF:
            args, kwargs = _patch.replace_arg(args, kwargs, store_index, "forward_data_store", _guard_store)
            args, kwargs = _patch.replace_arg(args, kwargs, fn_index, fn_name, check)
        return wrapped(*args, **kwargs)

    return wrapper


# >= 0.14: forward_step_calc_loss(model, output_tensor, loss_func, config, vp_stage,
#          collect_non_loss_data, num_microbatches, forward_data_store, cp_group_size, is_last_stage)
_calc_loss = _guarding(7, 2, "loss_func", _checked_loss_func)
# 0.12 / 0.13: forward_step(forward_step_func, data_iterator, model, num_microbatches, input_tensor,
#              forward_data_store, config, ...)
_forward_step_legacy = _guarding(5, 0, "forward_step_func", _checked_forward_step_func)


def _target(module: ModuleType) -> tuple[str, Any]:
    if hasattr(module, "forward_step_calc_loss"):
        return "forward_step_calc_loss", _calc_loss
    return "forward_step", _forward_step_legacy


def instrument(module: ModuleType) -> None:
    """Patch ``megatron.core.pipeline_parallel.schedules`` (idempotent)."""
    attr, wrapper = _target(module)
    _patch.install(module, attr, wrapper)


def uninstrument(module: ModuleType) -> None:
    """Restore the original function object."""
    attr, _ = _target(module)
    _patch.uninstall(module, attr)
