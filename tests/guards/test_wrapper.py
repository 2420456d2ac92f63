"""gradguard._guards.wrapper: wrapt function wrappers, and what kind of callable a function is."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import wrapt

from gradguard._guards.wrapper import function_wrapper, kind


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


def test_bound_and_unbound_calls_reach_the_wrapper_as_wrapt_passes_them() -> None:
    calls: list[Any] = []

    def method(self: Any, x: int) -> tuple[Any, int]:
        return self, x

    class Owner:
        m = function_wrapper(method, _recorder("w", calls))

    owner = Owner()
    assert owner.m(1) == (owner, 1)
    assert Owner.m(owner, 2) == (owner, 2)
    assert Owner.__dict__["m"](owner, 3) == (owner, 3)  # unbound: self is just the first argument
    tags = [(instance, args) for _, _, instance, args, _ in calls]
    assert tags == [(owner, (1,)), (owner, (2,)), (None, (owner, 3))]


def test_keywords_pass_through() -> None:
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


def test_kind_tells_what_calling_a_function_does() -> None:
    async def coroutine() -> None:
        pass

    def generator() -> Any:
        yield 1

    async def async_generator() -> Any:
        yield 1

    class Owner:
        async def method(self) -> None:
            pass

    assert kind(add) == "function" and kind(len) == "function"
    assert kind(coroutine) == "coroutine" and kind(Owner().method) == "coroutine"
    assert kind(generator) == "generator" and kind(async_generator) == "async generator"
    assert kind(staticmethod(generator)) == "generator"
    assert kind(function_wrapper(coroutine, _recorder("w", []))) == "coroutine"  # through a wrapper


def test_exceptions_propagate_unchanged() -> None:
    def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError, match="x"):
        function_wrapper(boom, _recorder("w", []))()
