"""The watch's options, checked where they are given: ``every`` (by :mod:`gradguard._policy.validate`, as
every option) and ``memory``."""

from __future__ import annotations

from .._policy.validate import EVERY_ACCEPTED, Every, refusal
from .._policy.validate import every as parse_every
from .trigger import TriggerSettings

__all__ = ["EVERY_ACCEPTED", "Every", "parse_every", "parse_memory"]

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
        return TriggerSettings()
    if value is False or value is None:
        return None
    if isinstance(value, TriggerSettings):
        return value
    raise refusal("memory", value, MEMORY_ACCEPTED)
