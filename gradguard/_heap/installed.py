"""Where installed packages live, which one a module belongs to, its installed version, and the known
leaks (:mod:`gradguard._heap.known_leaks`) an installed version has.

An installed package lives in a ``site-packages`` directory, or in a folder on ``sys.path`` that holds
its ``*.dist-info`` (``pip install --target``, a wheel unpacked there); a source tree installed
editable is the program's, wherever its metadata is.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import site
import sys
import sysconfig
import types
from collections.abc import Iterable

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from .hold import before_search, working_directory
from .known_leaks import KNOWN_LEAKS, KnownLeak

__all__ = [
    "installed_known_leaks",
    "known_leak",
    "library_dirs",
    "library_of_module",
    "package_version",
    "program_frame",
    "short_path",
]


@before_search
@functools.lru_cache(maxsize=1)
def library_dirs() -> tuple[str, ...]:
    """The directories installed packages live in, each ending with a separator, as named and with their
    links resolved: the ``site-packages`` directories, and the folders on ``sys.path`` (as it is at the first
    call) that hold a ``*.dist-info``."""
    dirs = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site module
        pass
    dirs.update(d for d in sys.path if d and _holds_dist_info(d))
    return tuple({os.path.join(form, ""): None for d in dirs if d for form in (d, os.path.realpath(d))})


def _holds_dist_info(folder: str) -> bool:
    """Whether ``folder`` holds a ``*.dist-info`` directory: pip installed into it (``--target``).

    An ``*.egg-info`` does not count: setuptools writes one into a source tree installed editable."""
    try:
        with os.scandir(folder) as entries:
            return any(e.name.endswith(".dist-info") and e.is_dir() for e in entries)
    except OSError:
        return False


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
    return top if filename.startswith(library_dirs()) else None


def short_path(filename: str) -> str | None:
    """``filename`` as messages name it: relative to the directory its installed package lives in, or to the
    working directory when under it; ``None`` otherwise. Reads nothing from the operating system during a
    search (see :func:`~gradguard._heap.hold.working_directory`)."""
    site_dir = next((d for d in library_dirs() if filename.startswith(d)), None)
    if site_dir is not None:
        return filename[len(site_dir) :]
    cwd = working_directory()
    try:
        relative = os.path.relpath(os.path.join(cwd, filename), cwd)
    except ValueError:  # another drive on Windows
        return None
    return None if relative.startswith(os.pardir) else relative


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
        # The distribution of the same name first, when its RECORD lists the module: one folder read,
        # where mapping every installed distribution to its modules reads them all.
        files = importlib.metadata.distribution(label).files or ()
        if any(f.parts and f.parts[0] in (label, f"{label}.py") for f in files):
            return importlib.metadata.version(label)
    except Exception:  # noqa: BLE001 - no distribution of that name, or broken metadata: map them all
        pass
    try:
        for distribution in importlib.metadata.packages_distributions().get(label, ()):
            return importlib.metadata.version(distribution)
    except Exception:  # noqa: BLE001 - broken package metadata: no version to say
        return None
    return None


def known_leak(label: str, version: str | None, shapes: Iterable[str], keys: Iterable[str]) -> KnownLeak | None:
    """The known leak a holder matches, or ``None``.

    Args:
        label: The library that owns the holder, as :func:`library_of_module` names it (``"trl"``).
        version: Its installed version (:func:`package_version`); ``None`` matches nothing.
        shapes: What holds the graph in the library: the module-qualified classes of its objects along
            the path, their bases included, and the functions whose locals it is
            (``"transformers.trainer.Trainer.train"``).
        keys: The attribute names, dict keys and local names along the path inside the library.

    Returns:
        The first entry for ``label`` whose affected versions hold ``version``, whose ``owner`` is one
        of ``shapes`` and whose ``attribute`` (where it names one) is one of ``keys``.
    """
    if version is None:
        return None
    shapes, keys = set(shapes), set(keys)
    for entry in KNOWN_LEAKS:
        if entry.package != label or entry.owner not in shapes:
            continue
        if (entry.attribute is None or entry.attribute in keys) and _affected(entry, version):
            return entry
    return None


def installed_known_leaks() -> list[tuple[KnownLeak, str]]:
    """The known leaks of the packages installed here, each with the installed version that has it,
    found by package metadata alone (nothing is imported)."""
    found = []
    for entry in KNOWN_LEAKS:
        try:
            version = importlib.metadata.version(entry.distribution)
        except Exception:  # noqa: BLE001 - not installed, or broken metadata: nothing to say
            continue
        if _affected(entry, version):
            found.append((entry, version))
    return found


def _affected(entry: KnownLeak, version: str) -> bool:
    try:
        return Version(version) in SpecifierSet(entry.affected)
    except (InvalidSpecifier, InvalidVersion):
        return False


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
