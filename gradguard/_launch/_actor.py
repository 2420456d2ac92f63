"""The Ray actor this process runs, if any: its instance, named as a root of the holder search, and its class.

A Ray actor's state is reached first through Ray's own table of actor instances
(``ray._private.worker.global_worker.actors``), so without this the watch names what an actor keeps
from Ray's module globals and offers to replace Ray's table. Here the instance is a named root
(:mod:`gradguard._heap.roots`): ``actor Trainer: self.losses[*]``, fix ``self.losses = gradguard.guard([])
(in actor Trainer)``.

Ray's public runtime context says whether this process is an actor (``get_actor_id()``); the instance
itself is read, without changing anything, from the worker object the context holds
(``ray.get_runtime_context().worker.actors[worker.actor_id]``, Ray 2.x), which Ray does not document:
a release that moves it gives no instance, and the paths fall back to what they were. Ray is never
imported here (a process that has not imported it is not an actor), and never initialised: nothing
here is asked of Ray unless ``ray.is_initialized()``, since Ray's public calls start a local cluster
when none is connected (a driver's report written at exit, after ``ray.shutdown()``, did).
"""

from __future__ import annotations

import sys
from typing import Any

from .._heap import roots as _roots

__all__ = ["current", "current_class", "provide_roots"]


def current() -> tuple[Any, str] | None:
    """The Ray actor this process runs.

    Returns:
        ``(instance, class name)``, or ``None`` (not a Ray actor's worker, or Ray not initialised).
    """
    ray = sys.modules.get("ray")
    if ray is None:
        return None
    try:
        if not ray.is_initialized():  # first: get_runtime_context() would start a Ray cluster (auto-init)
            return None
        context = ray.get_runtime_context()
        if context.get_actor_id() is None:
            return None
        worker = context.worker
        instance = worker.actors.get(worker.actor_id)
    except Exception:  # noqa: BLE001 - not a worker, not initialised, or a Ray whose internals moved
        return None
    if instance is None:
        return None
    cls = getattr(type(instance), "__ray_actor_class__", type(instance))  # Ray subclasses the user's class
    return instance, getattr(cls, "__name__", type(instance).__name__)


def current_class() -> str | None:
    """The Ray actor this process runs.

    Returns:
        Its class name, or ``None``.
    """
    found = current()
    return None if found is None else found[1]


def _roots_provider() -> list[tuple[Any, str, str]]:
    found = current()
    if found is None:
        return []
    instance, name = found
    return [(instance, f"actor {name}", "self")]


def provide_roots() -> None:
    """From now on the holder search starts at this process's actor instance, when it runs one."""
    _roots.add_provider(_roots_provider)
