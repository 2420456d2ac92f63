"""Option values as users give them, checked in one place.

Every option gradguard reads from a user goes through one of these functions: a keyword argument, an
environment variable, a ``gradguard`` command-line flag, a pytest option or marker argument. Each returns
the value in its canonical type, or raises :class:`GradGuardError` naming the option as the user spelled
it (``what``), the value, and what is accepted. Text (a flag, a variable) reads as the Python value does:
``"2"`` is 2, ``"auto"`` is ``"auto"``. Nothing here imports torch, so that the launcher and the pytest
plugin check their options before anything heavy loads.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Literal, TypeVar

from .._errors import GradGuardError

__all__ = [
    "AUDIT_ACCEPTED",
    "EVERY_ACCEPTED",
    "OFF_WORDS",
    "Every",
    "audit",
    "choice",
    "every",
    "number",
    "output_file",
    "read_count",
    "refusal",
    "whole",
]

T = TypeVar("T")

Every = int | Literal["auto"]
"""The watch's ``every``: a positive ``int`` or ``"auto"``."""

EVERY_ACCEPTED = (
    "a positive whole number N (act on every N-th step boundary's signals at any cost) or 'auto' (audit "
    "when a signal says a graph is old, in the first boundaries, and within a small share of the wall time)"
)
AUDIT_ACCEPTED = f"{EVERY_ACCEPTED}, or 0/off (no watch)"
OFF_WORDS = frozenset({"0", "off", "false", "no", "none"})
"""The words (any case) an ``audit`` setting turns the watch off with."""

_DIGITS = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit and int() also take '²' and '٣'


def refusal(
    what: str, value: object, accepted: str, *, within: str = "", said: str = "is not accepted"
) -> GradGuardError:
    """The error for a value an option does not take.

    Args:
        what: The option as the user spelled it (``every``, ``--audit-every``, ``GRADGUARD_AUDIT``).
        value: The value given; shown with ``repr``, with a note when it is empty text.
        accepted: What the option takes.
        within: The call the option belongs to, when the message names it (``TriggerSettings``).
        said: What is wrong with it.

    Returns:
        ``GradGuardError("what='x' is not accepted; accepted: ...")``, for the caller to raise.
    """
    shown = f"{what}={value!r}"
    if within:
        shown = f"{within}({shown})"
    empty = " (an empty value)" if isinstance(value, str) and not value.strip() else ""
    return GradGuardError(f"{shown}{empty} {said}; accepted: {accepted}")


def whole(
    value: object, *, what: str, least: int = 0, accepted: str | None = None, within: str = "", text: bool = True
) -> int:
    """A whole number of at least ``least``.

    Args:
        value: An ``int`` (not a ``bool``), or with ``text`` a string of ASCII digits, no sign (blanks
            around it are ignored).
        what: The option, as :func:`refusal` names it.
        least: The smallest value taken.
        accepted: What the message says is accepted (default: ``a whole number >= least``).
        within: As for :func:`refusal`.
        text: Whether a string is read (a flag or a variable); ``False`` for a keyword argument whose
            value is kept as given.

    Returns:
        The number.

    Raises:
        GradGuardError: anything else, naming ``what``, the value and what is accepted.
    """
    number_: object = value
    if text and isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
        number_ = int(value.strip())
    if isinstance(number_, int) and not isinstance(number_, bool) and number_ >= least:
        return number_
    raise refusal(what, value, accepted or f"a whole number >= {least}", within=within)


def read_count(text: str | None) -> int | None:
    """A whole number >= 0 that another program set (a rank, a pid), where none of gradguard's options is
    wrong when it is not one.

    Args:
        text: The variable's value, or ``None``.

    Returns:
        The number, or ``None`` for anything else (blanks around it are ignored).
    """
    if text is None or not _DIGITS.fullmatch(text.strip()):
        return None
    return int(text.strip())


def number(
    value: object,
    *,
    what: str,
    accepted: str,
    within: str = "",
    ok: Callable[[float], bool] = lambda _: True,
    text: bool = True,
) -> float:
    """A finite real number for which ``ok`` holds.

    Args:
        value: An ``int`` or ``float`` (not a ``bool``), or with ``text`` a string Python reads as one.
        what: The option, as :func:`refusal` names it.
        accepted: What the message says is accepted (``a number >= 0 and < 1``).
        within: As for :func:`refusal`.
        ok: The range the number must be in.
        text: Whether a string is read, as for :func:`whole`.

    Returns:
        The number (as given: an ``int`` stays an ``int``).

    Raises:
        GradGuardError: anything else (NaN and infinities too), naming ``what``, the value and what is accepted.
    """
    read: object = value
    if text and isinstance(value, str):
        try:
            read = float(value.strip())
        except ValueError:
            read = None
    if isinstance(read, (int, float)) and not isinstance(read, bool) and math.isfinite(read) and ok(read):
        return read
    raise refusal(what, value, accepted, within=within)


def choice(value: object, choices: Mapping[str, T], *, what: str, accepted: str, said: str = "is not accepted") -> T:
    """One of ``choices``' values, by its key.

    Args:
        value: A string: one of ``choices``' keys, in any case, blanks around it ignored.
        choices: The words taken and what each stands for (aliases map to the same value).
        what: The option, as :func:`refusal` names it.
        accepted: What the message says is accepted.
        said: What the message says is wrong (``is not a gradguard mode``).

    Returns:
        ``choices[value.strip().lower()]``.

    Raises:
        GradGuardError: anything else, naming ``what``, the value and what is accepted.
    """
    if isinstance(value, str):
        key = value.strip().lower()
        if key in choices:
            return choices[key]
    raise refusal(what, value, accepted, said=said)


def every(value: object, *, what: str = "every", accepted: str = EVERY_ACCEPTED) -> Every:
    """The watch's ``every``.

    Args:
        value: A positive whole number (an ``int`` or its digits) or ``"auto"`` (any case).
        what: The option, as :func:`refusal` names it.
        accepted: What the message says is accepted.

    Returns:
        The ``int``, or ``"auto"``.

    Raises:
        GradGuardError: anything else, naming ``what``, the value and what is accepted.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return whole(value, what=what, least=1, accepted=accepted)


def audit(value: object, *, what: str = "audit") -> Every | None:
    """An ``audit`` setting (``enforce(audit=)``, ``GRADGUARD_AUDIT``, ``--audit-every``).

    Args:
        value: What :func:`every` takes, or ``0``, ``off``, ``false``, ``no``, ``none`` (any case) or
            ``None`` for no watch.
        what: The option, as :func:`refusal` names it.

    Returns:
        ``every``, or ``None`` for no watch.

    Raises:
        GradGuardError: anything else, an empty string included, naming ``what``, the value and what is
            accepted.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in OFF_WORDS):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return None
    return every(value, what=what, accepted=AUDIT_ACCEPTED)


def output_file(value: str, *, what: str) -> str:
    """A path to write a file to, checked before the work that fills it: its folder exists and is writable.

    Args:
        value: The path.
        what: The option, as :func:`refusal` names it.

    Returns:
        ``value``.

    Raises:
        GradGuardError: an empty value, a missing or read-only folder, or a folder given as the file.
    """
    accepted = "a file path in an existing, writable folder"
    if not value.strip():
        raise refusal(what, value, accepted)
    folder = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(folder):
        raise refusal(what, value, accepted, said=f"is not accepted (the folder {folder!r} does not exist)")
    if not os.access(folder, os.W_OK):
        raise refusal(what, value, accepted, said=f"is not accepted (the folder {folder!r} is not writable)")
    if os.path.isdir(value):
        raise refusal(what, value, accepted, said="is not accepted (it is a folder)")
    return value
