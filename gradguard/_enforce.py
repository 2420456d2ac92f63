"""``gradguard.enforce()``: a mode scope plus reference-counted installation of patches.

Installation is process-wide and reference-counted: the first enter installs each requested engine
adapter (through a wrapt post-import hook, so the engine may be imported before or after) and each
user store target; the last exit restores every original object. The mode is context-local: inside
the ``with`` block of this thread / task the enforce mode rules; other threads keep theirs.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

import wrapt

from . import engines as _engines
from ._errors import GradGuardError
from ._policy import Mode, _pop_enforced, _push_enforced, normalize_mode
from ._store import guard
from ._wrapper import function_wrapper
from .engines import _patch

__all__ = ["enforce"]

_lock = threading.RLock()
_counts: dict[tuple[str, ...], int] = {}
_instrumented: set[str] = set()  # "engine:module" pairs currently patched
_hooked: set[str] = set()  # post-import hooks registered (wrapt cannot remove them; they check _counts)
_store_owners: dict[tuple[str, ...], tuple[Any, str]] = {}  # installed store key -> (owner, attr) patched
_scopes: contextvars.ContextVar[tuple[contextvars.Token[Mode | None], ...]] = contextvars.ContextVar(
    "gradguard_enforce_scopes", default=()
)


class enforce:
    """Guard engines and stores inside a ``with`` block, or around a decorated function.

    ``mode``: the mode inside (``None`` keeps the enclosing one). ``engines``: ``"auto"`` (every known
    adapter), ``"none"``, or a list of names from ``gradguard.engines.KNOWN``. ``stores``:
    ``{"pkg.module:function": "arg_name"}`` (``function`` may be ``Class.method``) guards that argument
    of every call; a target that cannot be resolved raises :class:`GradGuardError` on entering.
    Re-entrant and nestable; safe to enter from several threads at once.
    """

    def __init__(
        self,
        mode: str | None = None,
        engines: str | Iterable[str] = "auto",
        stores: Mapping[str, str] | None = None,
    ) -> None:
        self.mode: Mode | None = None if mode is None else normalize_mode(mode)
        self._keys: list[tuple[str, ...]] = [("engine", name) for name in _engine_names(engines)]
        self._keys += [("store", target, arg) for target, arg in _store_items(stores)]

    def __enter__(self) -> enforce:
        _acquire(self._keys)
        _scopes.set((*_scopes.get(), _push_enforced(self.mode)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        scopes = _scopes.get()
        _pop_enforced(scopes[-1])
        _scopes.set(scopes[:-1])
        _release(self._keys)

    def __call__(self, func: Callable[..., Any]) -> Any:
        def wrapper(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
            with self:
                return wrapped(*args, **kwargs)

        return function_wrapper(func, wrapper)

    def __repr__(self) -> str:
        return f"gradguard.enforce(mode={self.mode!r}, targets={[':'.join(k[1:]) for k in self._keys]})"


def _engine_names(engines: str | Iterable[str]) -> list[str]:
    if engines == "auto":
        return list(_engines.KNOWN)
    if engines == "none" or engines is None:
        return []
    if isinstance(engines, str):
        engines = [engines]
    names = list(engines)
    for name in names:
        _engines.load(name)  # raises GradGuardError naming the known engines
    return names


def _store_items(stores: Mapping[str, str] | None) -> list[tuple[str, str]]:
    if stores is None:
        return []
    if not isinstance(stores, Mapping):
        raise GradGuardError(
            f"stores must be a mapping {{'pkg.module:function': 'arg_name'}}, got {type(stores).__qualname__}"
        )
    items = []
    for target, arg in stores.items():
        if not (isinstance(target, str) and target.count(":") == 1 and all(target.split(":"))):
            raise GradGuardError(
                f"stores target {target!r} is not of the form 'pkg.module:function' (or 'pkg.module:Class.method')"
            )
        if not isinstance(arg, str) or not arg:
            raise GradGuardError(f"stores[{target!r}] must name an argument, got {arg!r}")
        items.append((target, arg))
    return items


# --------------------------------------------------------------------------------------------------
# Reference-counted installation
# --------------------------------------------------------------------------------------------------


def _acquire(keys: list[tuple[str, ...]]) -> None:
    """Take one reference on each key, installing on the first; all or nothing.

    A key whose install fails is not counted (there is nothing to uninstall), and the references
    already taken by this call are given back, so a failed enter leaves nothing installed.
    """
    with _lock:
        done: list[tuple[str, ...]] = []
        try:
            for key in keys:
                _counts[key] = _counts.get(key, 0) + 1
                if _counts[key] == 1:
                    try:
                        _install(key)
                    except BaseException:
                        del _counts[key]
                        raise
                done.append(key)
        except BaseException:
            _release(done)
            raise


def _release(keys: list[tuple[str, ...]]) -> None:
    """Give back one reference on each key, uninstalling on the last; every key is processed even
    when an uninstall fails (the first failure is raised afterwards)."""
    with _lock:
        error: BaseException | None = None
        for key in reversed(keys):
            _counts[key] -= 1
            if _counts[key] == 0:
                del _counts[key]
                try:
                    _uninstall(key)
                except BaseException as exc:  # noqa: BLE001 - re-raised once the rest is restored
                    error = error or exc
        if error is not None:
            raise error


def _install(key: tuple[str, ...]) -> None:
    if key[0] == "engine":
        adapter = _engines.load(key[1])
        for module_name in adapter.MODULES:
            if module_name in sys.modules:
                _instrument(key, adapter, sys.modules[module_name])
            if module_name not in _hooked:
                _hooked.add(module_name)
                wrapt.register_post_import_hook(_on_import_hook(key, adapter), module_name)
    else:
        owner, attr, index = _resolve_store(key[1], key[2])
        if _patch.is_installed(owner, attr):  # install would be a silent no-op, uninstall premature
            raise GradGuardError(
                f"stores target {key[1]!r} is already patched by gradguard (an enclosing enforce guards "
                f"another of its arguments, or an engine adapter patches it); cannot also guard {key[2]!r}"
            )
        _patch.install(owner, attr, _store_wrapper(key[1], key[2], index))
        _store_owners[key] = (owner, attr)


def _uninstall(key: tuple[str, ...]) -> None:
    if key[0] == "engine":
        adapter = _engines.load(key[1])
        for module_name in adapter.MODULES:
            tag = f"{key[1]}:{module_name}"
            if tag in _instrumented:
                _instrumented.discard(tag)
                adapter.uninstrument(sys.modules[module_name])
    else:
        # Restore what was patched, not what the target resolves to now (the module may be gone
        # from sys.modules or re-imported as a new object).
        owner, attr = _store_owners.pop(key)
        _patch.uninstall(owner, attr)


def _instrument(key: tuple[str, ...], adapter: ModuleType, module: ModuleType) -> None:
    tag = f"{key[1]}:{module.__name__}"
    if tag not in _instrumented:
        adapter.instrument(module)
        _instrumented.add(tag)


def _on_import_hook(key: tuple[str, ...], adapter: ModuleType) -> Callable[[ModuleType], None]:
    def on_import(module: ModuleType) -> None:
        with _lock:
            if _counts.get(key):
                _instrument(key, adapter, module)

    return on_import


def _resolve_store(target: str, arg: str) -> tuple[Any, str, int]:
    module_name, _, path = target.partition(":")
    try:
        owner: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise GradGuardError(f"stores target {target!r}: cannot import {module_name!r} ({exc})") from exc
    *parents, attr = path.split(".")
    try:
        for part in parents:
            owner = getattr(owner, part)
        func = getattr(owner, attr)
    except AttributeError as exc:
        raise GradGuardError(f"stores target {target!r}: {exc}") from exc
    if not callable(func):
        raise GradGuardError(f"stores target {target!r} is a {type(func).__qualname__}, not a function")
    try:
        index = _patch.arg_index(func, arg)
    except (ValueError, TypeError) as exc:
        raise GradGuardError(f"stores target {target!r}: {exc}") from exc
    if isinstance(owner, type) and not isinstance(inspect.getattr_static(owner, attr), (staticmethod, classmethod)):
        index -= 1  # called through an instance or the class: wrapt passes args without self
    return owner, attr, index


def _store_wrapper(target: str, arg: str, index: int) -> Callable[..., Any]:
    name = f"{target}:{arg}"

    def guard_arg(value: Any) -> Any:
        return value if value is None else guard(value, name=name)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = _patch.replace_arg(args, kwargs, index, arg, guard_arg)
        return wrapped(*args, **kwargs)

    return wrapper
