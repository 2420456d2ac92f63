"""The watch's options, checked where they are given: ``every`` (by :mod:`gradguard._policy.validate`, as
every option), ``memory``, and the optimizers a boundary is given."""

from __future__ import annotations

from typing import Any

import torch

from .._errors import GradGuardError
from .._policy.validate import EVERY_ACCEPTED, Every, refusal
from .._policy.validate import every as parse_every
from .trigger import DEFAULT_MEMORY, TriggerSettings

__all__ = ["EVERY_ACCEPTED", "Every", "parse_every", "parse_memory", "parse_optimizers"]

MEMORY_ACCEPTED = (
    "True (read the memory figure, the default), False (do not) "
    "or gradguard.TriggerSettings(floor=..., window=..., ...)"
)


def parse_memory(value: object, every: Every) -> TriggerSettings | None:
    """``memory`` as the watch takes it.

    Args:
        value: ``True`` (the default :class:`TriggerSettings`), ``False`` or ``None`` (no memory figure),
            or a :class:`TriggerSettings`.
        every: The watch's ``every`` (the memory figure is read under either).

    Returns:
        The settings of the memory rule, or ``None`` for no memory figure.

    Raises:
        GradGuardError: anything else, naming ``memory``, the value and what is accepted.
    """
    if value is True:
        return DEFAULT_MEMORY
    if value is False or value is None:
        return None
    if isinstance(value, TriggerSettings):
        return value
    raise refusal("memory", value, MEMORY_ACCEPTED)


def parse_optimizers(optimizer: Any) -> tuple[Any, ...]:
    """``Watcher.boundary``'s ``optimizer`` as a tuple of optimizers (empty for ``None``).

    Args:
        optimizer: A ``torch.optim.Optimizer``, an iterable of them, or ``None``.

    Returns:
        The optimizers.

    Raises:
        GradGuardError: anything else, naming the value and what is accepted.
    """
    if optimizer is None:
        return ()
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    try:
        found = tuple(optimizer)
    except TypeError:
        found = ()
    if not found or not all(isinstance(o, torch.optim.Optimizer) for o in found):
        raise GradGuardError(
            f"Watcher.boundary(optimizer={optimizer!r}) is not accepted; pass the torch.optim.Optimizer that "
            "stepped, an iterable of them, or None (age every graph)"
        )
    return found
