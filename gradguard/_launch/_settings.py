"""The run's settings as environment variables: what ``gradguard run`` and ``gradguard env`` export, and
what every process reached through the bootstrap reads back.

=========================  ==========================================================================
variable                   meaning
=========================  ==========================================================================
``PYTHONPATH``             :data:`BOOTSTRAP` first: every Python process runs its ``sitecustomize``
``GRADGUARD_REPORT_DIR``   the run folder; each process writes one report there. Set and non-empty,
                           it arms the bootstrap; unset, the bootstrap does nothing
``GRADGUARD_RUN_AUDIT``    each process's watch: ``auto`` (the default), a positive N, or ``0``/``off``
``GRADGUARD``              the mode (gradguard's own variable, read as everywhere)
``GRADGUARD_RUN_PARENT``   the pid of ``gradguard run``: its direct child is the command the user typed,
                           whose messages carry no origin tag unless it has a rank
=========================  ==========================================================================

``GRADGUARD_AUDIT`` is left out of a launched process's environment: the run's own watch replaces it
there (otherwise each ``enforce()`` scope of the program would start a second watch).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .._errors import GradGuardError
from .._policy.modes import ENV_VAR as MODE
from .._watch.watcher import AUDIT_ENV, Every, parse_audit

__all__ = ["AUDIT", "BOOTSTRAP", "MODE", "PARENT", "REPORT_DIR", "Settings", "child_environment", "exports"]

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
"""The folder holding the bootstrap ``sitecustomize.py``."""

REPORT_DIR = "GRADGUARD_REPORT_DIR"
AUDIT = "GRADGUARD_RUN_AUDIT"
PARENT = "GRADGUARD_RUN_PARENT"


class Settings:
    """What one process reads from its environment: ``report_dir``, ``every`` (``None``: no watch),
    ``parent`` (the pid of ``gradguard run``, or ``None``) and ``error`` (a bad value, said once in the
    report and on stderr; the watch is then off)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.report_dir = environ.get(REPORT_DIR, "")
        self.error: str | None = None
        self.every: Every | None = None
        try:
            self.every = parse_audit(environ.get(AUDIT) or "auto", what=AUDIT)
        except GradGuardError as exc:  # reported, never raised into the program's `import torch`
            self.error = str(exc)
        parent = environ.get(PARENT, "")
        self.parent = int(parent) if parent.isdigit() else None


def _every_text(every: Every | None) -> str:
    return "0" if every is None else str(every)


def exports(report_dir: str, every: Every | None, mode: str | None) -> dict[str, str]:
    """The variables to set for a process to report into ``report_dir`` (``PYTHONPATH`` not included)."""
    variables = {REPORT_DIR: os.path.abspath(report_dir), AUDIT: _every_text(every)}
    if mode is not None:
        variables[MODE] = mode
    return variables


def python_path(current: str | None) -> str:
    """``PYTHONPATH`` with the bootstrap folder first (once), then ``current``."""
    rest = [p for p in (current or "").split(os.pathsep) if p and os.path.abspath(p) != BOOTSTRAP]
    return os.pathsep.join([BOOTSTRAP, *rest])


def child_environment(
    report_dir: str, every: Every | None, mode: str | None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The whole environment of the command ``gradguard run`` starts: ``base`` (``os.environ``) with the
    bootstrap first on ``PYTHONPATH``, the settings, this process's pid as the parent, and no
    ``GRADGUARD_AUDIT``."""
    environ = dict(os.environ if base is None else base)
    environ.pop(AUDIT_ENV, None)
    environ.update(exports(report_dir, every, mode))
    environ["PYTHONPATH"] = python_path(environ.get("PYTHONPATH"))
    environ[PARENT] = str(os.getpid())
    return environ
