"""Where a call passes a named parameter, from the function's signature, read once.

Used wherever gradguard reads or replaces one argument of someone else's call: the decorator's
``forward_only``, ``enforce(stores=...)`` targets and the Megatron adapter. Positional-or-keyword
parameters may come either way; keyword-only ones (after ``*args``) only by keyword; ``*args`` and
``**kwargs`` cannot be named.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .._errors import GradGuardError

__all__ = ["MISSING", "Argument"]

MISSING: Any = object()


class Argument:
    """Parameter ``name`` of ``func``: read it from, or replace it in, a wrapt call's ``(instance, args, kwargs)``.

    ``args`` are the positional arguments as wrapt hands them to a wrapper: without ``self``/``cls``
    when ``instance`` is given (a bound call). ``func`` may be a function, a bound method (its ``self``
    is counted) or a staticmethod's function. ``what`` names it in errors, ``hint`` ends them.
    """

    __slots__ = ("name", "index", "default", "what")

    def __init__(self, func: Callable[..., Any], name: str, *, what: str | None = None, hint: str = "") -> None:
        self.what = what or getattr(func, "__qualname__", repr(func))
        hint = f". {hint}" if hint else ""
        if inspect.ismethod(func):
            func = func.__func__  # count self/cls: wrapt hands bound calls their args without it
        try:
            parameters = list(inspect.signature(func).parameters.values())
        except (TypeError, ValueError) as exc:
            raise GradGuardError(f"{self.what}: its signature cannot be read ({exc}){hint}") from exc
        names = [p.name for p in parameters]
        if name not in names:
            raise GradGuardError(f"{self.what} has no parameter {name!r}; its parameters are {names}{hint}")
        parameter = parameters[names.index(name)]
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise GradGuardError(f"{self.what}: {name!r} is *{name} / **{name}; name a single parameter instead{hint}")
        self.name = name
        positional = parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
        self.index: int | None = names.index(name) if positional else None
        self.default = MISSING if parameter.default is parameter.empty else parameter.default

    def position(self, instance: Any) -> int | None:
        """Index into ``args`` for a call bound to ``instance`` (``None``: keyword only)."""
        if self.index is None:
            return None
        return self.index - 1 if instance is not None else self.index

    def get(self, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The value passed, else the parameter's default, else :data:`MISSING`."""
        if self.name in kwargs:
            return kwargs[self.name]
        i = self.position(instance)
        if i is not None and 0 <= i < len(args):
            return args[i]
        return self.default

    def replace(
        self, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[Any], Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` with the value passed replaced by ``fn(value)``; unchanged when it was not passed."""
        if self.name in kwargs:
            return args, {**kwargs, self.name: fn(kwargs[self.name])}
        i = self.position(instance)
        if i is not None and 0 <= i < len(args):
            return (*args[:i], fn(args[i]), *args[i + 1 :]), kwargs
        return args, kwargs
