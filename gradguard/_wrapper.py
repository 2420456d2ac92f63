"""wrapt function wrappers, without wrapt's per-call ``__self__`` probe on plain functions.

``wrapt.FunctionWrapper`` called unbound looks up ``wrapped.__self__`` on every call, to find the
instance of a bound method it may have been given. For a plain function that lookup fails: CPython
builds and discards an ``AttributeError`` each time, ~0.25 µs here, a twelfth of the per-call budget
of a decorated ``forward_step``. A plain function never has ``__self__``, so its unbound calls can go
straight to the wrapper with ``instance=None``, which is what wrapt passes after the failed lookup.
Everything else (binding as a method, classmethods, name, docstring, signature, ``__wrapped__``) is
wrapt's own.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import wrapt

__all__ = ["function_wrapper"]

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


class _PlainFunctionWrapper(wrapt.FunctionWrapper):  # type: ignore[misc]
    """A ``wrapt.FunctionWrapper`` of a plain function (``types.FunctionType`` itself)."""

    # Accessed through a class, wrapt binds it with this type (its default, found without a failed lookup).
    __bound_function_wrapper__ = wrapt.BoundFunctionWrapper

    def __init__(self, wrapped: Callable[..., Any], wrapper: Wrapper, direct: Wrapper) -> None:
        super().__init__(wrapped, wrapper)
        self._self_direct = direct

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_direct(self.__wrapped__, None, args, kwargs)


def function_wrapper(func: Callable[..., Any], wrapper: Wrapper, direct: Wrapper | None = None) -> Any:
    """``wrapt.FunctionWrapper(func, wrapper)``, calling ``wrapper(wrapped, instance, args, kwargs)``.

    Plain functions get a subclass whose unbound call skips wrapt's ``__self__`` lookup and calls
    ``direct`` (default: ``wrapper``) instead: such calls reach it through one more Python frame of
    ours, ``_PlainFunctionWrapper.__call__``, which a call-site search must step over. Bound calls
    (wrapt's ``BoundFunctionWrapper``, in C), and every call of a bound method, class/static method
    or other callable (``wrapt.FunctionWrapper`` itself), reach ``wrapper`` with no frame of ours.
    """
    if type(func) is types.FunctionType:  # exactly: a proxy of a function passes isfunction
        return _PlainFunctionWrapper(func, wrapper, wrapper if direct is None else direct)
    return wrapt.FunctionWrapper(func, wrapper)
