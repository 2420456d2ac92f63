"""gradguard._wrapper: wrapt function wrappers whose unbound plain-function calls skip wrapt's probe."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import wrapt

from gradguard._wrapper import function_wrapper


def _recorder(tag: str, calls: list[tuple[str, Any, Any, tuple[Any, ...], dict[str, Any]]]) -> Any:
    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        calls.append((tag, wrapped, instance, args, kwargs))
        return wrapped(*args, **kwargs)

    return wrapper


def add(a: int, b: int = 10) -> int:
    """Add two numbers."""
    return a + b


def test_a_plain_function_keeps_name_docstring_signature_and_wrapped() -> None:
    wrapped = function_wrapper(add, _recorder("w", []))
    assert isinstance(wrapped, wrapt.FunctionWrapper)
    assert wrapped.__wrapped__ is add
    assert (wrapped.__name__, wrapped.__doc__) == ("add", "Add two numbers.")
    assert inspect.signature(wrapped) == inspect.signature(add)


def test_unbound_calls_reach_direct_and_bound_calls_reach_wrapper() -> None:
    calls: list[Any] = []

    def method(self: Any, x: int) -> tuple[Any, int]:
        return self, x

    class Owner:
        m = function_wrapper(method, _recorder("bound", calls), direct=_recorder("direct", calls))

    owner = Owner()
    assert owner.m(1) == (owner, 1)
    assert Owner.m(owner, 2) == (owner, 2)
    assert Owner.__dict__["m"](owner, 3) == (owner, 3)  # unbound: self is just the first argument
    tags = [(tag, instance, args) for tag, _, instance, args, _ in calls]
    assert tags == [("bound", owner, (1,)), ("bound", owner, (2,)), ("direct", None, (owner, 3))]
    assert calls[2][1] is method  # what wrapt passes after its failed __self__ lookup: the function itself


def test_keywords_pass_through_and_direct_defaults_to_wrapper() -> None:
    calls: list[Any] = []
    wrapped = function_wrapper(add, _recorder("w", calls))
    assert wrapped(1, b=2) == 3
    assert calls == [("w", add, None, (1,), {"b": 2})]


def test_same_instance_and_args_as_wrapt_for_every_kind_of_callable() -> None:
    """Whatever the callable, the wrapper sees what ``wrapt.FunctionWrapper`` would give it."""

    def seen(factory: Any) -> list[Any]:
        calls: list[Any] = []

        class Owner:
            def method(self, x: int) -> int:
                return x

            plain = factory(method, _recorder("w", calls))
            static = factory(staticmethod(add), _recorder("w", calls))
            klass = factory(classmethod(lambda cls, x: x), _recorder("w", calls))

        owner = Owner()
        bound = factory(owner.method, _recorder("w", calls))
        results = [owner.plain(1), Owner.plain(owner, 2), owner.static(3), Owner.klass(4), bound(5)]
        results.append(Owner.plain(None, 6))  # wrapt takes a None first argument as "no instance"
        names = {id(owner): "owner", id(Owner): "Owner"}
        return [results, [(names.get(id(i), i), a, k) for _, _, i, a, k in calls]]

    assert seen(function_wrapper) == seen(wrapt.FunctionWrapper)


def test_only_plain_functions_get_the_subclass() -> None:
    class Owner:
        def method(self) -> None:
            pass

    assert type(function_wrapper(add, _recorder("w", []))) is not wrapt.FunctionWrapper
    already = wrapt.FunctionWrapper(add, _recorder("w", []))  # a proxy: inspect.isfunction says True
    for other in (Owner().method, staticmethod(add), classmethod(add), len, already):
        assert type(function_wrapper(other, _recorder("w", []))) is wrapt.FunctionWrapper


def test_exceptions_propagate_unchanged() -> None:
    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError, match="x"):
        function_wrapper(boom, _recorder("w", []))()
