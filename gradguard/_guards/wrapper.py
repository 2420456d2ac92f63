"""Wrapping callables with wrapt, and telling what kind of callable a function is.

``wrapt.FunctionWrapper`` keeps name, docstring, signature and ``__wrapped__``, binds as a method,
classmethod or staticmethod, and calls ``wrapper(wrapped, instance, args, kwargs)``. A wrapper that
must act *around the body* of a function (``enforce`` as a decorator) has to know whether calling
the function runs the body (a plain function) or only creates a coroutine or generator object whose
body runs later: :func:`kind` tells.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

import wrapt

__all__ = ["Kind", "Wrapper", "function_wrapper", "kind"]

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]
Kind = Literal["function", "coroutine", "generator", "async generator"]


def function_wrapper(func: Callable[..., Any], wrapper: Wrapper) -> Any:
    """``wrapt.FunctionWrapper(func, wrapper)``: ``wrapper(wrapped, instance, args, kwargs)`` serves every call."""
    return wrapt.FunctionWrapper(func, wrapper)


def kind(func: Callable[..., Any]) -> Kind:
    """What calling ``func`` does: run its body (``"function"``) or create a coroutine/generator object."""
    target = inspect.unwrap(func) if callable(func) else func
    target = getattr(target, "__func__", target)  # bound methods, classmethod/staticmethod objects
    if inspect.isasyncgenfunction(target):
        return "async generator"
    if inspect.iscoroutinefunction(target):
        return "coroutine"
    if inspect.isgeneratorfunction(target):
        return "generator"
    return "function"
