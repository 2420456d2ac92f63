"""The run's settings as environment variables: what ``gradguard run`` and ``gradguard env`` export, and
what every process reached through the bootstrap reads back.

=========================  ==========================================================================
variable                   meaning
=========================  ==========================================================================
``PYTHONPATH``             :data:`BOOTSTRAP` first: every Python process runs its ``sitecustomize``
``GRADGUARD_REPORT_DIR``   the run folder; each process writes one report there. Set and non-empty,
                           it arms the bootstrap; unset, the bootstrap does nothing
``GRADGUARD_RUN_ID``       the run: each report carries it, in its name and its content, and a run
                           reads only its own reports (two runs may share a folder)
``GRADGUARD_RUN_AUDIT``    each process's watch: ``auto`` (the default), a positive N, or ``0``/``off``
``GRADGUARD``              the mode (gradguard's own variable, read as everywhere)
``GRADGUARD_RUN_PARENT``   the pid of ``gradguard run``: its direct child is the command the user typed,
                           whose messages carry no origin tag unless it has a rank
=========================  ==========================================================================

A variable set to an empty (or blank) value counts as unset, as ``GRADGUARD`` and ``GRADGUARD_AUDIT`` do.
``GRADGUARD_AUDIT`` is left out of a launched process's environment: the run's own watch replaces it
there (otherwise each ``enforce()`` scope of the program would start a second watch).

Nothing here imports torch: ``gradguard run`` reads and checks these values before it starts the
command, and the launcher's own start-up is part of every command's cost.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from .._errors import GradGuardError
from .._policy import validate
from .._policy.modes import ENV_VAR as MODE
from .._policy.validate import Every

__all__ = [
    "AUDIT",
    "AUDIT_ENV",
    "BOOTSTRAP",
    "MODE",
    "PARENT",
    "REPORT_DIR",
    "RUN_ID",
    "Settings",
    "check_run_id",
    "child_environment",
    "exports",
    "given",
    "new_run_id",
    "python_path",
]

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bootstrap")
"""The folder holding the bootstrap ``sitecustomize.py``."""

REPORT_DIR = "GRADGUARD_REPORT_DIR"
RUN_ID = "GRADGUARD_RUN_ID"
AUDIT = "GRADGUARD_RUN_AUDIT"
PARENT = "GRADGUARD_RUN_PARENT"
AUDIT_ENV = "GRADGUARD_AUDIT"  # the watch's own variable (gradguard._watch.scope.AUDIT_ENV; a test keeps them equal)

_RUN_ID = re.compile(r"[A-Za-z0-9_]{1,64}")  # no "-": it ends the run id in a report's file name
RUN_ID_ACCEPTED = "1 to 64 letters, digits or '_' (gradguard run and gradguard env set it)"


def check_run_id(value: str, *, what: str = RUN_ID) -> str:
    """A run id, checked: one a report's file name can carry.

    Args:
        value: The run id.
        what: The option or variable it came from, for the error.

    Returns:
        ``value``.

    Raises:
        GradGuardError: naming ``what``, the value and what is accepted.
    """
    if _RUN_ID.fullmatch(value) is None:
        raise validate.refusal(what, value, RUN_ID_ACCEPTED)
    return value


def new_run_id() -> str:
    """A new run's id.

    Returns:
        Twelve random hexadecimal digits: no other run takes it.
    """
    return os.urandom(6).hex()


def given(environ: Mapping[str, str], name: str) -> str | None:
    """A variable's value, an empty or blank one counting as unset.

    Args:
        environ: The environment.
        name: The variable.

    Returns:
        ``environ[name]``, or ``None`` when it is unset, empty or blank.
    """
    value = environ.get(name)
    return value if value is not None and value.strip() else None


class Settings:
    """What one process reads from its environment; a bad value is kept in ``errors``, never raised.

    Args:
        environ: The environment (``os.environ`` by default).

    Attributes:
        report_dir: The run folder.
        run: The run id (``""`` when the variables were set by hand without one).
        every: The watch's ``every`` (``None``: no watch).
        parent: The pid of ``gradguard run``, or ``None``.
        errors: Bad values, said once in the report and on stderr (a bad watch setting turns the watch off).
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.report_dir = environ.get(REPORT_DIR, "")
        self.errors: list[str] = []
        self.every: Every | None = None
        self.run = ""
        try:
            self.every = validate.audit(given(environ, AUDIT) or "auto", what=AUDIT)
        except GradGuardError as exc:  # reported, never raised into the program's `import torch`
            self.errors.append(str(exc))
        run = (given(environ, RUN_ID) or "").strip()
        if run:
            try:
                self.run = check_run_id(run)
            except GradGuardError as exc:
                self.errors.append(f"{exc}; this process's report carries no run id")
        self.parent = validate.read_count(environ.get(PARENT))


def _every_text(every: Every | None) -> str:
    return "0" if every is None else str(every)


def exports(report_dir: str, every: Every | None, mode: str | None, run: str) -> dict[str, str]:
    """The variables that make a process report into a run folder.

    Args:
        report_dir: The run folder (made absolute).
        every: The watch's ``every`` (``None``: no watch).
        mode: The mode, or ``None`` to leave ``GRADGUARD`` as it is.
        run: The run id.

    Returns:
        The variables and their values, ``PYTHONPATH`` not included.
    """
    variables = {REPORT_DIR: os.path.abspath(report_dir), RUN_ID: run, AUDIT: _every_text(every)}
    if mode is not None:
        variables[MODE] = mode
    return variables


def python_path(current: str | None) -> str:
    """``PYTHONPATH`` with the bootstrap folder first.

    Every other entry is kept, in its order, the empty ones too: an empty entry means the current
    directory (``PYTHONPATH=':/lib'``), so dropping one would change what the program imports. An unset
    or empty ``PYTHONPATH`` has no entries (Python ignores an empty value).

    Args:
        current: The ``PYTHONPATH`` now, or ``None``.

    Returns:
        The bootstrap folder (once), then ``current``'s entries as they were.
    """
    if not current:
        return BOOTSTRAP
    rest = [p for p in current.split(os.pathsep) if not (p and os.path.abspath(p) == BOOTSTRAP)]
    return os.pathsep.join([BOOTSTRAP, *rest])


def child_environment(
    report_dir: str, every: Every | None, mode: str | None, run: str, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The whole environment of the command ``gradguard run`` starts.

    Args:
        report_dir: As for :func:`exports`.
        every: As for :func:`exports`.
        mode: As for :func:`exports`.
        run: As for :func:`exports`.
        base: The environment to start from (``os.environ`` by default).

    Returns:
        ``base`` with the bootstrap first on ``PYTHONPATH``, the settings, this process's pid as the
        parent, and no ``GRADGUARD_AUDIT``.
    """
    environ = dict(os.environ if base is None else base)
    environ.pop(AUDIT_ENV, None)
    environ.update(exports(report_dir, every, mode, run))
    environ["PYTHONPATH"] = python_path(environ.get("PYTHONPATH"))
    environ[PARENT] = str(os.getpid())
    return environ
