"""Engine adapters, one module each, behind one contract (:class:`gradguard.engines._adapter.Adapter`).

Each adapter module defines ``ADAPTER``, an :class:`~gradguard.engines._adapter.Adapter` instance:
the modules it waits for, the versions it supports, ``instrument(module)`` / ``uninstrument(module)``
(patch with wrapt / restore the original objects exactly). ``gradguard.enforce()`` installs them
through post-import hooks, so the engine may be imported before or after entering.
"""

from __future__ import annotations

import importlib

from .._errors import GradGuardError
from ._adapter import Adapter

__all__ = ["KNOWN", "Adapter", "load"]

KNOWN = ("megatron", "pipelining", "verl")
"""The engine names :func:`load` and ``enforce(engines=...)`` accept."""


def load(name: str) -> Adapter:
    """The adapter of one engine.

    Args:
        name: One of :data:`KNOWN`: ``"megatron"``, ``"pipelining"`` or ``"verl"``.

    Returns:
        That engine's adapter (its module's ``ADAPTER``), its engine not imported.

    Raises:
        GradGuardError: an unknown ``name``, listing the known ones.
    """
    if not isinstance(name, str) or name not in KNOWN:
        raise GradGuardError(f"unknown engine {name!r}; known engines: {', '.join(KNOWN)} (or 'auto', 'none')")
    adapter: Adapter = importlib.import_module(f"{__name__}.{name}").ADAPTER
    return adapter
