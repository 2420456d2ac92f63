"""Engine adapters, one module each, in the OpenTelemetry ``instrument()/uninstrument()`` style.

Each adapter module defines ``MODULES`` (the engine modules whose import it waits for),
``instrument(module)`` / ``uninstrument(module)`` (patch with wrapt / restore the original objects
exactly) and ``version()`` (the installed engine version, or ``None``). ``gradguard.enforce()``
installs them through post-import hooks, so the engine may be imported before or after entering.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .._errors import GradGuardError

__all__ = ["KNOWN", "load"]

KNOWN = ("megatron", "pipelining", "verl")


def load(name: str) -> ModuleType:
    """The adapter module for engine ``name``; :class:`GradGuardError` lists the known ones."""
    if name not in KNOWN:
        raise GradGuardError(f"unknown engine {name!r}; known engines: {', '.join(KNOWN)} (or 'auto', 'none')")
    return importlib.import_module(f"{__name__}.{name}")
