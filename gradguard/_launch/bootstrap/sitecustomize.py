"""gradguard's bootstrap: with this folder first on ``PYTHONPATH``, every Python process sets gradguard up
the moment it imports torch, and pays nothing before.

``gradguard run`` (and ``gradguard env``, for processes it does not start) puts this folder first on
``PYTHONPATH``; Python's ``site`` then imports this file at start-up in every process that inherits
the variable: the command itself, a launcher's workers (torchrun, accelerate, deepspeed),
multiprocessing spawn children, Ray workers. The contract:

* Only ``GRADGUARD_REPORT_DIR`` set and non-empty arms it; otherwise it only chains (below).
* Armed, it puts one finder first on ``sys.meta_path`` that waits for ``torch``. When torch's own
  import has completed (and gradguard's, when the program imported gradguard first, which imports
  torch), the finder steps aside and calls ``gradguard._launch._process.setup()``
  (``enforce()``, the watch and this process's report). This file imports nothing but ``os`` and
  ``sys`` (both loaded before ``site`` runs): gradguard, wrapt and torch are imported by the program's
  own ``import torch``, never here. A process that never imports torch never imports gradguard.
* It sets up at most once per process: the finder is removed before the setup runs, and a forked
  child inherits the parent's state (the setup itself handles the fork).
* Then it runs the user's own ``sitecustomize``, the next one on ``sys.path``, as ``site`` would have;
  that module becomes ``sys.modules["sitecustomize"]``. An error in it propagates as it would
  without gradguard (``site`` reports it).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing is not imported at start-up: the names below are for type checkers only
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType
    from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPORT_DIR = "GRADGUARD_REPORT_DIR"  # gradguard._launch._settings.REPORT_DIR (a test keeps them equal)


class _Loader:
    """The module's own loader, then a call back: ``__loader__`` and ``__spec__.loader`` are the module's
    own again before its code runs."""

    def __init__(self, loader: Any, finder: _WaitForTorch) -> None:
        self.loader = loader
        self.finder = finder

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self.loader, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.finder.imported(module.__name__)


def _initializing(name: str) -> bool:
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return getattr(spec, "_initializing", False)


class _WaitForTorch:
    """A ``sys.meta_path`` finder that answers for ``torch`` and ``gradguard`` only, with the spec the
    finders after it give, its loader wrapped so that the setup runs once both imports are complete:
    torch's, and gradguard's when torch was imported by gradguard's own import (``import gradguard``
    first in a program), since the setup imports gradguard."""

    def __init__(self) -> None:
        self.busy = False

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if (name != "torch" and name != "gradguard") or self.busy:
            return None
        self.busy = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(name, path, target)
                if spec is not None:
                    break
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, self)
        return spec

    def imported(self, done: str | None = None) -> None:
        """``done``: the module whose code has just run (its import is still marked as under way)."""
        if "torch" not in sys.modules or any(_initializing(n) for n in ("torch", "gradguard") if n != done):
            return  # called again when the import under way completes
        if self not in sys.meta_path:
            return
        sys.meta_path.remove(self)
        try:
            from gradguard._launch._process import setup

            setup()
        except Exception as exc:  # the program's `import torch` must not fail because of gradguard
            print(f"gradguard: not set up in process {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)


def _arm() -> None:
    if not os.environ.get(_REPORT_DIR):
        return
    if any(type(f).__name__ == "_WaitForTorch" for f in sys.meta_path):
        return
    finder = _WaitForTorch()
    sys.meta_path.insert(0, finder)
    if "torch" in sys.modules:  # imported already (by a .pth file): set up now
        finder.imported()


def _chain() -> None:
    """Import the next ``sitecustomize`` on ``sys.path`` (this folder left out), as ``sitecustomize``."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    here = os.path.normcase(_HERE)
    path = [p for p in sys.path if os.path.normcase(os.path.abspath(p or os.curdir)) != here]
    spec = PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_arm()
_chain()
