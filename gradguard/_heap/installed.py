"""Where installed packages live, which one a module belongs to, and its installed version."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import site
import sys
import sysconfig
import types

__all__ = ["library_dirs", "library_of_module", "package_version", "program_frame"]


@functools.lru_cache(maxsize=1)
def library_dirs() -> tuple[str, ...]:
    """The directories installed packages live in (``site-packages``), each ending with a separator."""
    dirs = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


@functools.lru_cache(maxsize=4096)
def library_of_module(name: str) -> str | None:
    """The library a module (by dotted name) belongs to: ``"the standard library"``, ``"torch"``, the
    installed package's top-level name, or ``None`` for the program's own code."""
    top = name.partition(".")[0]
    if top in sys.stdlib_module_names or top == "builtins":
        return "the standard library"
    if top in ("torch", "gradguard", "wrapt"):
        return top
    module = sys.modules.get(top)
    filename = getattr(module, "__file__", None) if _is_module(module) else None
    if not isinstance(filename, str):
        return None
    return top if os.path.realpath(filename).startswith(library_dirs()) else None


@functools.lru_cache(maxsize=256)
def package_version(label: str) -> str | None:
    """The installed version of the library ``label`` (a top-level module name, as :func:`library_of_module`
    gives it), or ``None`` where none is known (the standard library, a package not installed by pip)."""
    if label == "the standard library":
        return None
    module = sys.modules.get(label)
    version = getattr(module, "__version__", None) if _is_module(module) else None
    if isinstance(version, str):
        return version
    try:
        for distribution in importlib.metadata.packages_distributions().get(label, ()):
            return importlib.metadata.version(distribution)
    except Exception:  # noqa: BLE001 - broken package metadata: no version to say
        return None
    return None


def program_frame(frame: types.FrameType | None) -> types.FrameType | None:
    """``frame``, or the nearest frame it was called from, that runs the program's own code (no library's:
    see :func:`library_of_module`); ``None`` when every frame from there out is a library's."""
    while frame is not None:
        module = frame.f_globals.get("__name__")
        if not isinstance(module, str) or library_of_module(module) is None:
            return frame
        frame = frame.f_back
    return None


def _is_module(obj: object) -> bool:
    """A module by its exact type's MRO, never through ``__class__`` (a proxy may claim to be one)."""
    return types.ModuleType in type(obj).__mro__
