"""The scope under ``gradguard.enforce()`` and ``gradguard.watch()``: a mode plus reference-counted installs.

A :class:`Scope` holds a mode and the :class:`Install` objects it needs while it is entered: the engine
adapters and ``stores=`` patches made here (:func:`engine_installs`, :func:`store_installs`), and any
other install a layer above implements (the watch's). Installation is process-wide and
reference-counted: the first scope that needs an install installs it, the last one to leave restores
every original object. Engine adapters install through wrapt post-import hooks, so an engine may be
imported before or after entering. The mode is context-local: inside the scope, in this thread or
asyncio task, the scope's mode rules; other threads keep theirs.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any, TypeVar

import wrapt

from .. import engines as _engines
from .._errors import GradGuardError, GradGuardWarning
from .._guards import patch
from .._guards.arguments import Argument
from .._guards.store import guard_in_place
from .._guards.wrapper import function_wrapper, kind
from .._policy.modes import Mode, normalize_mode, pop_enforced, push_enforced
from .._policy.validate import refusal

__all__ = ["Install", "Scope", "engine_installs", "installed", "store_installs"]


# --------------------------------------------------------------------------------------------------
# What a scope installs
# --------------------------------------------------------------------------------------------------


class Install(abc.ABC):
    """One thing a scope installs while it is entered; scopes whose installs have equal keys share one.

    Attributes:
        key: What the install is (``("engine", "megatron")``, ``("watch", "audit=auto")``): the first
            scope entered with a key installs, the last to leave uninstalls.
    """

    key: Hashable

    @abc.abstractmethod
    def install(self) -> None:
        """Put it in place (the first scope with this key is entering).

        Raises:
            GradGuardError: it cannot be installed; nothing of it is left in place.
        """

    @abc.abstractmethod
    def uninstall(self) -> None:
        """Take it away, restoring exactly what was there (the last scope with this key has left)."""


class _EngineInstall(Install):
    """An engine adapter: instrument its modules now if imported, and on import otherwise."""

    # Modules waiting with a post-import hook. wrapt's hooks fire once, on the next import, and are
    # then dropped: one hook per module is enough whatever the number of scopes, and a module
    # imported again later (after leaving sys.modules) gets a new one when an install starts.
    _waiting: set[str] = set()

    def __init__(self, adapter: _engines.Adapter) -> None:
        self.adapter = adapter
        self.key = ("engine", adapter.name)
        self.instrumented: dict[str, ModuleType] = {}  # the module objects patched: restored even if re-imported

    def install(self) -> None:
        for name in self.adapter.modules:
            module = sys.modules.get(name)
            if module is not None:
                self.instrument(module)
            elif name not in self._waiting:
                self._waiting.add(name)
                wrapt.register_post_import_hook(_on_import, name)

    def instrument(self, module: ModuleType) -> None:
        if self.instrumented.get(module.__name__) is not module:
            self.adapter.instrument(module)
            self.instrumented[module.__name__] = module

    def uninstall(self) -> None:
        for name in sorted(self.instrumented):
            self.adapter.uninstrument(self.instrumented[name])
        self.instrumented.clear()


def _on_import(module: ModuleType) -> None:
    """A waited-for engine module was imported: instrument it for every engine install active now."""
    with _lock:
        _EngineInstall._waiting.discard(module.__name__)
        for install in list(_active.values()):
            if isinstance(install, _EngineInstall) and module.__name__ in install.adapter.modules:
                try:
                    install.instrument(module)
                except GradGuardError as exc:  # raising here would fail the user's import
                    warnings.warn(
                        f"gradguard: the {install.adapter.name} adapter was not installed: {exc}",
                        GradGuardWarning,
                        stacklevel=2,
                    )


class _StoreInstall(Install):
    """``stores={"pkg.mod:func": "arg"}``: that argument of every call is guarded in place."""

    def __init__(self, target: str, arg: str) -> None:
        self.target, self.arg = target, arg
        self.key = ("store", target)
        self.patched: list[tuple[Any, str]] = []

    def install(self) -> None:
        module_name, _, path = self.target.partition(":")
        try:
            owner, attr, original = wrapt.resolve_path(module_name, path)
        except ImportError as exc:
            cause = exc.__cause__ or exc
            raise GradGuardError(f"stores target {self.target!r}: cannot import {module_name!r} ({cause})") from exc
        except AttributeError as exc:
            raise GradGuardError(f"stores target {self.target!r}: {exc}") from exc
        func = getattr(original, "__func__", original)  # a staticmethod/classmethod's function
        if not callable(func):
            raise GradGuardError(f"stores target {self.target!r} is a {type(original).__qualname__}, not a function")
        if patch.is_installed(owner, attr):
            raise GradGuardError(
                f"stores target {self.target!r} is already patched by gradguard (an engine adapter patches it); "
                f"cannot also guard {self.arg!r}"
            )
        argument = Argument(
            func if isinstance(owner, type) else original, self.arg, what=f"stores target {self.target!r}"
        )
        wrapper = _store_wrapper(f"{self.target}:{self.arg}", argument)
        patch.install(owner, attr, wrapper)
        self.patched.append((owner, attr))
        if isinstance(owner, ModuleType):
            # names bound by `from module import func` before the scope: the same object elsewhere
            for module in list(sys.modules.values()):
                namespace = getattr(module, "__dict__", None)
                if module is not owner and type(namespace) is dict and namespace.get(attr) is original:
                    patch.install(module, attr, wrapper)
                    self.patched.append((module, attr))

    def uninstall(self) -> None:
        for owner, attr in reversed(self.patched):
            patch.uninstall(owner, attr)
        self.patched.clear()


def _store_wrapper(name: str, argument: Argument) -> Callable[..., Any]:
    def guard_arg(value: Any) -> Any:
        return value if value is None else guard_in_place(value, name)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = argument.replace(instance, args, kwargs, guard_arg)
        return wrapped(*args, **kwargs)

    return wrapper


# --------------------------------------------------------------------------------------------------
# Reference counting
# --------------------------------------------------------------------------------------------------

_lock = threading.RLock()
_counts: dict[Hashable, int] = {}
_active: dict[Hashable, Install] = {}
_scopes: contextvars.ContextVar[tuple[contextvars.Token[Mode | None], ...]] = contextvars.ContextVar(
    "gradguard_enforce_scopes", default=()
)


def _acquire(installs: Sequence[Install]) -> None:
    """Take one reference on each install, installing on the first; all or nothing."""
    with _lock:
        done: list[Install] = []
        try:
            for item in installs:
                current = _active.get(item.key)
                if current is None:
                    item.install()  # a failed install is not counted: there is nothing to undo
                    _active[item.key] = item
                elif isinstance(item, _StoreInstall) and isinstance(current, _StoreInstall) and current.arg != item.arg:
                    raise GradGuardError(
                        f"stores target {item.target!r} is already patched by an enclosing enforce() to guard "
                        f"{current.arg!r}; cannot also guard {item.arg!r}"
                    )
                _counts[item.key] = _counts.get(item.key, 0) + 1
                done.append(item)
        except BaseException:
            _release(done)
            raise


def _release(installs: Sequence[Install]) -> None:
    """Give back one reference on each install, uninstalling on the last; every one is processed
    even when an uninstall fails (the first failure is raised afterwards)."""
    with _lock:
        error: BaseException | None = None
        for item in reversed(installs):
            _counts[item.key] -= 1
            if _counts[item.key] == 0:
                del _counts[item.key]
                try:
                    _active.pop(item.key).uninstall()
                except BaseException as exc:  # noqa: BLE001 - re-raised once the rest is restored
                    error = error or exc
        if error is not None:
            raise error


def installed() -> dict[Hashable, int]:
    """What is installed now.

    Returns:
        Each install's key and how many entered scopes hold it: ``{("engine", "megatron"): 1, ("store", target): 2}``.
    """
    with _lock:
        return dict(_counts)


# --------------------------------------------------------------------------------------------------
# The scope
# --------------------------------------------------------------------------------------------------


F = TypeVar("F", bound=Callable[..., Any])
S = TypeVar("S", bound="Scope")


class Scope:
    """A mode and the installs it needs, held while it is entered: in a ``with`` block, or around a
    decorated function.

    As a decorator it scopes the function's body: for a coroutine function while it runs, for a
    generator (or async generator) function each time it resumes, the installs held from its start
    to its end. Re-entrant, nestable, exception-safe; safe to enter from several threads at once.
    ``gradguard.enforce`` and ``gradguard.watch`` are scopes.

    Args:
        mode: The mode inside (``None`` keeps the enclosing one), as :func:`gradguard.set_mode` takes it.
        installs: What the scope installs while entered.

    Attributes:
        mode: The mode inside, normalised (``None``: the enclosing one).
        installs: What the scope installs while entered.

    Raises:
        GradGuardError: a bad ``mode``; on entering, an install that failed (nothing is left installed).
    """

    def __init__(self, mode: str | None, installs: Iterable[Install]) -> None:
        self.mode: Mode | None = None if mode is None else normalize_mode(mode)
        self.installs: tuple[Install, ...] = tuple(installs)

    def __enter__(self: S) -> S:
        _acquire(self.installs)
        _scopes.set((*_scopes.get(), push_enforced(self.mode)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        scopes = _scopes.get()
        pop_enforced(scopes[-1])
        _scopes.set(scopes[:-1])
        _release(self.installs)

    def __call__(self, func: F) -> F:
        """``func`` wrapped so that each call (each run of its coroutine or generator) is inside the scope."""
        how = kind(func)
        if how == "coroutine":

            def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
                async def scoped() -> Any:
                    with self:
                        return await wrapped(*args, **kwargs)

                return scoped()

        elif how == "generator":

            def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
                return _ScopedGenerator(wrapped(*args, **kwargs), self)

        elif how == "async generator":

            def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
                return _ScopedAsyncGenerator(wrapped(*args, **kwargs), self)

        else:

            def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
                with self:
                    return wrapped(*args, **kwargs)

        wrapped: F = function_wrapper(func, wrapper)
        return wrapped

    def __repr__(self) -> str:
        return f"gradguard.enforce(mode={self.mode!r}, installs={[item.key for item in self.installs]})"


class _Scoped(wrapt.ObjectProxy):  # type: ignore[misc]
    """A generator (or async generator) whose every resumption runs inside ``scope``.

    The mode is the scope's while the body runs and the caller's between resumptions; the installs
    are taken at the first resumption and given back when the generator finishes, is closed, or is
    collected (a generator collected unfinished is then closed by Python, outside the scope).
    """

    def __init__(self, gen: Any, scope: Scope) -> None:
        super().__init__(gen)
        self._self_scope = scope
        self._self_hold = _Hold(scope.installs)
        weakref.finalize(self, self._self_hold.give_back)

    @contextlib.contextmanager
    def _resumed(self) -> Iterator[None]:
        self._self_hold.take()
        token = push_enforced(self._self_scope.mode)
        try:
            yield
        except BaseException:
            self._self_hold.give_back()  # StopIteration, StopAsyncIteration or an error: the body has ended
            raise
        finally:
            pop_enforced(token)


class _Hold:
    """One generator's hold on its scope's installs: taken once, given back once."""

    __slots__ = ("installs", "state")

    def __init__(self, installs: Sequence[Install]) -> None:
        self.installs, self.state = installs, "new"

    def take(self) -> None:
        if self.state == "new":
            _acquire(self.installs)
            self.state = "held"

    def give_back(self) -> None:
        if self.state == "held":
            _release(self.installs)
        self.state = "done"


class _ScopedGenerator(_Scoped):
    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        with self._resumed():
            return self.__wrapped__.send(value)

    def throw(self, *args: Any) -> Any:
        with self._resumed():
            return self.__wrapped__.throw(*args)

    def close(self) -> None:
        if self._self_hold.state == "held":  # the body is suspended: it runs to its end inside the scope
            with self._resumed():
                self.__wrapped__.close()
        else:
            self.__wrapped__.close()
        self._self_hold.give_back()


class _ScopedAsyncGenerator(_Scoped):
    def __aiter__(self) -> Any:
        return self

    def __anext__(self) -> Any:
        return self.asend(None)

    async def asend(self, value: Any) -> Any:
        with self._resumed():
            return await self.__wrapped__.asend(value)

    async def athrow(self, *args: Any) -> Any:
        with self._resumed():
            return await self.__wrapped__.athrow(*args)

    async def aclose(self) -> None:
        if self._self_hold.state == "held":
            with self._resumed():
                await self.__wrapped__.aclose()
        else:
            await self.__wrapped__.aclose()
        self._self_hold.give_back()


def engine_installs(engines: str | Iterable[str] | None) -> list[Install]:
    """The installs of the engine adapters ``engines`` names.

    Args:
        engines: ``"auto"`` (every adapter of :data:`gradguard.engines.KNOWN`), ``"none"`` or ``None``,
            one name, or an iterable of names.

    Returns:
        One install per adapter, its engine not imported.

    Raises:
        GradGuardError: an unknown name, or a value of another type.
    """
    return [_EngineInstall(_engines.load(name)) for name in _engine_names(engines)]


def store_installs(stores: Mapping[str, str] | None) -> list[Install]:
    """The installs that guard an argument of every call of a function, in place.

    Args:
        stores: ``{"pkg.module:function": "arg_name"}`` (``function`` may be ``Class.method``, or
            ``obj.method`` of a module-level object); a name the function is bound to elsewhere by
            ``from pkg.module import function`` is patched too. ``None``: none.

    Returns:
        One install per target; a target is resolved (imported) when the install is entered.

    Raises:
        GradGuardError: a mapping of the wrong shape (resolving the target fails on entering instead).
    """
    return [_StoreInstall(target, arg) for target, arg in _store_items(stores)]


def _engine_names(engines: str | Iterable[str] | None) -> list[str]:
    if engines == "auto":
        return list(_engines.KNOWN)
    if engines == "none" or engines is None:
        return []
    if isinstance(engines, str):
        return [_engines.load(engines).name]
    if isinstance(engines, (bytes, bytearray)) or not isinstance(engines, Iterable):
        raise refusal("engines", engines, f"'auto', 'none', or a list of names from {', '.join(_engines.KNOWN)}")
    return [_engines.load(name).name for name in engines]


def _store_items(stores: Mapping[str, str] | None) -> list[tuple[str, str]]:
    if stores is None:
        return []
    if not isinstance(stores, Mapping):
        raise refusal("stores", stores, "a mapping {'pkg.module:function': 'arg_name'}")
    items = []
    for target, arg in stores.items():
        if not (isinstance(target, str) and target.count(":") == 1 and all(target.split(":"))):
            raise refusal("stores target", target, "'pkg.module:function' or 'pkg.module:Class.method'")
        if not isinstance(arg, str) or not arg.strip():
            raise refusal(f"stores[{target!r}]", arg, "the name of one of its arguments")
        items.append((target, arg))
    return items
