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
* When the setup fails (most often: this interpreter cannot import gradguard, a second virtualenv
  that has torch but not gradguard), the program goes on: the reason is said on stderr and written
  as this process's report (kind ``not-set-up``), so the run's summary says the process was not
  checked, and why, instead of counting it as a process that never imported torch.
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
# gradguard._launch._settings and ._report's names (a test keeps them equal)
_REPORT_DIR = "GRADGUARD_REPORT_DIR"
_RUN_ID = "GRADGUARD_RUN_ID"
_PARENT = "GRADGUARD_RUN_PARENT"
_FORMAT = "gradguard-run-report"
_VERSION = 4


class _Loader:
    """The module's own loader, then a call back: ``__loader__`` and ``__spec__.loader`` are the module's
    own again before its code runs."""

    def __init__(self, loader: Any, finder: _WaitForTorch) -> None:
        self.loader = loader
        self.finder = finder

    def __getattr__(self, name: str) -> Any:  # get_code, get_source, is_package (runpy's -m): the loader's own
        return getattr(self.loader, name)

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


def _ours(name: str) -> bool:
    return name == "gradguard" or name.startswith("gradguard.")


class _WaitForTorch:
    """A ``sys.meta_path`` finder that answers for ``torch`` and gradguard's modules only, with the spec
    the finders after it give, its loader wrapped so that the setup runs once torch's import is complete
    and no import of a gradguard module is under way: torch is often imported by one of gradguard's
    (``from gradguard import guard`` first in a program), and the setup imports gradguard's modules,
    which must not be met half-initialised."""

    def __init__(self) -> None:
        self.busy = False

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if (name != "torch" and not _ours(name)) or self.busy:
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
        under_way = [n for n in list(sys.modules) if (n == "torch" or _ours(n)) and n != done and _initializing(n)]
        if "torch" not in sys.modules or under_way:
            return  # called again when the import under way completes
        if self not in sys.meta_path:
            return
        sys.meta_path.remove(self)
        try:
            from gradguard._launch._process import setup

            setup()
        except Exception as exc:  # the program's `import torch` must not fail because of gradguard
            print(f"gradguard: not set up in process {os.getpid()}: {type(exc).__name__}: {exc}", file=sys.stderr)
            _not_set_up(f"{type(exc).__name__}: {exc}")


def _word(text: str) -> bool:
    return all(c.isascii() and (c.isalnum() or c == "_") for c in text)


def _not_set_up(error: str) -> None:
    """This process's report, written here (gradguard may not be importable): it imported torch and was
    not set up, and why."""
    try:
        import json
        import socket
        import time

        run = os.environ.get(_RUN_ID, "").strip()
        run = run if _word(run) and len(run) <= 64 else ""
        parent = os.environ.get(_PARENT, "").strip()
        host = socket.gethostname() or "localhost"
        try:
            with open("/proc/self/stat", encoding="ascii", errors="replace") as f:
                started: int | None = int(f.read().rsplit(")", 1)[1].split()[19])
        except (OSError, IndexError, ValueError):
            started = None
        report = {
            "format": _FORMAT,
            "version": _VERSION,
            "run": run,
            "kind": "not-set-up",
            "pid": os.getpid(),
            "host": host,
            "top": parent.isascii() and parent.isdigit() and int(parent) == os.getppid(),
            "argv": [str(a) for a in sys.argv],
            "error": error,
            "written": time.time(),
            "executable": sys.executable,
            "started": started,
        }
        folder = os.environ[_REPORT_DIR]
        os.makedirs(folder, exist_ok=True)
        safe = "".join(c if _word(c) or c in ".-" else "_" for c in host)[:64]
        path = os.path.join(folder, f"report-{run}-{safe}-{os.getpid()}-{os.urandom(4).hex()}.json")
        with open(f"{path}.{os.getpid()}.tmp", "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    except Exception as exc:  # noqa: BLE001 - said, never raised into the program
        print(f"gradguard: process {os.getpid()}: the report saying so was not written: {exc!r}", file=sys.stderr)


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
