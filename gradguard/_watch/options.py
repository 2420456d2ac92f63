"""The watch's options, checked where they are given: ``every`` and ``memory``."""

from __future__ import annotations

from typing import Literal

from .._errors import GradGuardError
from .trigger import TriggerSettings

__all__ = ["EVERY_ACCEPTED", "Every", "parse_every", "parse_memory"]

Every = int | Literal["auto"]

EVERY_ACCEPTED = (
    "a positive whole number N (act on every N-th step boundary's signals at any cost) or 'auto' (audit "
    "when a signal says a graph is old, in the first boundaries, and within a small share of the wall time)"
)


def parse_every(value: object, *, what: str = "every", accepted: str = EVERY_ACCEPTED) -> Every:
    """``every`` as the watch takes it: a positive ``int`` or ``"auto"``.

    Raises:
        GradGuardError: for anything else, naming ``what``, the value and what is accepted.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    number: object = value
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():  # not '²'
        number = int(value.strip())
    if isinstance(number, int) and not isinstance(number, bool) and number > 0:
        return number
    raise GradGuardError(f"{what}={value!r} is not accepted; accepted: {accepted}")


def parse_memory(value: object, every: Every) -> TriggerSettings | None:
    """``memory`` as the watch takes it: ``True`` (the default :class:`TriggerSettings`), ``False`` or
    ``None`` (no memory figure), or a :class:`TriggerSettings`.

    Raises:
        GradGuardError: for anything else.
    """
    if value is True:
        return TriggerSettings()
    if value is False or value is None:
        return None
    if isinstance(value, TriggerSettings):
        return value
    raise GradGuardError(
        f"memory={value!r} is not accepted; accepted: True (read the memory figure, the default), False (do not) "
        "or gradguard.TriggerSettings(floor=..., window=..., ...)"
    )
