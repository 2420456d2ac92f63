"""Modes: the one vocabulary shared by stores, decorators and engine adapters, and how it resolves.

Resolution order, first match wins: an explicit ``mode=`` > the innermost enclosing
``gradguard.enforce(mode=...)`` > ``gradguard.set_mode()`` > the ``GRADGUARD`` environment variable >
``"detach"``. The enforce and set_mode layers are context variables, so a mode set in one thread or
asyncio task never leaks into another. ``GRADGUARD`` is read and validated once, at first use.
"""

from __future__ import annotations

import contextvars
import os
from typing import Literal

from .validate import choice

__all__ = [
    "ACCEPTED",
    "ENV_VAR",
    "Mode",
    "get_mode",
    "mode_source",
    "normalize_mode",
    "pop_enforced",
    "push_enforced",
    "reload_env",
    "resolve",
    "set_mode",
]

Mode = Literal["off", "detach", "warn", "raise"]

OFF: Mode = "off"
DETACH: Mode = "detach"
WARN: Mode = "warn"
RAISE: Mode = "raise"

_ALIASES: dict[str, Mode] = {
    "off": OFF,
    "0": OFF,
    "false": OFF,
    "detach": DETACH,
    "on": DETACH,
    "1": DETACH,
    "true": DETACH,
    "warn": WARN,
    "raise": RAISE,
    "strict": RAISE,
}
ACCEPTED = "off/0/false, detach/on/1/true, warn, raise/strict"
ENV_VAR = "GRADGUARD"

_enforced: contextvars.ContextVar[Mode | None] = contextvars.ContextVar("gradguard_enforce", default=None)
_chosen: contextvars.ContextVar[Mode | None] = contextvars.ContextVar("gradguard_set_mode", default=None)
_env: tuple[Mode | None] | None = None  # cached parse of GRADGUARD (a 1-tuple once read)


def normalize_mode(value: object, *, what: str = "mode") -> Mode:
    """The canonical mode for ``value``.

    Args:
        value: A mode or an alias, in any case: ``off``/``0``/``false``, ``detach``/``on``/``1``/``true``,
            ``warn``, ``raise``/``strict``.
        what: The option as the user spelled it, for the error (``mode``, ``--mode``, ``GRADGUARD``).

    Returns:
        ``"off"``, ``"detach"``, ``"warn"`` or ``"raise"``.

    Raises:
        GradGuardError: anything else, naming ``what``, the value and the accepted ones.
    """
    return choice(value, _ALIASES, what=what, accepted=ACCEPTED, said="is not a gradguard mode")


def _env_mode() -> Mode | None:
    global _env
    env = _env
    if env is None:
        raw = os.environ.get(ENV_VAR)
        env = _env = (None if raw is None or not raw.strip() else normalize_mode(raw, what=ENV_VAR),)
    return env[0]


def reload_env() -> None:
    """Forget the cached ``GRADGUARD`` so the next use reads it again (tests, ``gradguard doctor``)."""
    global _env
    _env = None


def resolve(explicit: Mode | None = None) -> Mode:
    """The mode in force for one call.

    Args:
        explicit: The call's own ``mode=``, when it has one.

    Returns:
        ``explicit`` when given, else the context's mode (the resolution order above).

    Raises:
        GradGuardError: ``GRADGUARD`` is read here the first time, and is not a mode.
    """
    if explicit is not None:
        return explicit
    mode = _enforced.get()
    if mode is not None:
        return mode
    mode = _chosen.get()
    if mode is not None:
        return mode
    env = _env if _env is not None else (_env_mode(),)
    return env[0] or DETACH


def get_mode() -> Mode:
    """The effective mode here (this thread or asyncio task).

    Returns:
        What a store without ``mode=`` would use now.

    Raises:
        GradGuardError: ``GRADGUARD`` is set to something that is not a mode.
    """
    return resolve(None)


def mode_source() -> tuple[Mode, str]:
    """The effective mode and where it came from.

    Returns:
        ``(mode, source)``, ``source`` one of ``"enforce"``, ``"set_mode"``, ``"GRADGUARD"``, ``"default"``.

    Raises:
        GradGuardError: ``GRADGUARD`` is set to something that is not a mode.
    """
    for mode, source in ((_enforced.get(), "enforce"), (_chosen.get(), "set_mode"), (_env_mode(), ENV_VAR)):
        if mode is not None:
            return mode, source
    return DETACH, "default"


def set_mode(mode: str | None) -> Mode | None:
    """Set the mode for this thread or asyncio task (an enclosing ``enforce`` still wins).

    Args:
        mode: A mode or an alias, as :func:`normalize_mode` takes it; ``None`` clears it.

    Returns:
        The previous ``set_mode`` value of this context.

    Raises:
        GradGuardError: ``mode`` is not a mode.
    """
    previous = _chosen.get()
    _chosen.set(None if mode is None else normalize_mode(mode))
    return previous


def push_enforced(mode: Mode | None) -> contextvars.Token[Mode | None]:
    """Enter an ``enforce`` scope's mode in this context.

    Args:
        mode: The scope's mode; ``None`` keeps the enclosing scope's.

    Returns:
        The token :func:`pop_enforced` takes to leave it.
    """
    return _enforced.set(mode if mode is not None else _enforced.get())


def pop_enforced(token: contextvars.Token[Mode | None]) -> None:
    """Leave the scope mode :func:`push_enforced` entered.

    Args:
        token: What :func:`push_enforced` returned.
    """
    _enforced.reset(token)
