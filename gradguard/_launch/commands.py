"""``gradguard run``, ``gradguard env`` and ``gradguard report``: their options, each checked before
anything starts, and what each does.

The launcher imports neither torch nor the watch: it checks its options, starts the command, waits
for it and merges the reports, with a few small modules of its own (``benchmarks/launch.py`` measures
what that adds to a command). A
``gradguard run`` started inside another run (a wrapper script, ``gradguard env`` exported) watches
its own command and leaves a record of its outcome in the outer run's folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .._errors import GradGuardError
from .._policy import validate
from .._policy.validate import Every
from ._settings import AUDIT_ENV, PARENT, REPORT_DIR, RUN_ID, check_run_id, given

if TYPE_CHECKING:
    import signal
    import subprocess
    import types

    from ._merge import Merged
    from ._report import Record

    Handler = Callable[[int, types.FrameType | None], object] | int | signal.Handlers | None

__all__ = ["RUN_USAGE", "env", "page_options", "report", "run", "settings_options"]

RUN_USAGE = (
    "gradguard run [--mode MODE] [--audit-every N] [--report-dir DIR] [--html FILE] [--png FILE] "
    "(script.py | -m module | program) [args ...]"
)
_RUN_OPTIONS = ("--mode", "--audit-every", "--report-dir", "--html", "--png")
_PROGRAMS = "a program on PATH (torchrun, accelerate, deepspeed, python, ...)"


def settings_options(parser: argparse.ArgumentParser) -> None:
    """Add the options ``gradguard run`` and ``gradguard env`` share.

    Args:
        parser: The command's parser.
    """
    parser.add_argument(
        "--mode", help="off, detach, warn or raise (default: GRADGUARD, else detach); the watch's mode too"
    )
    parser.add_argument(
        "--audit-every",
        metavar="N",
        help="each process's watch: auto (the default, or GRADGUARD_AUDIT when set) checks the first boundaries, "
        "then audits when a signal read at every boundary says a graph outlived its step or memory grew, within a "
        "small share of the run's time; N acts on every N-th boundary's signals at any cost; 0/off: no watch",
    )
    parser.add_argument(
        "--report-dir",
        metavar="DIR",
        help="where each process writes its report: a new or empty folder (default: a new temporary folder, "
        "announced on stderr)",
    )


def page_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--html`` and ``--png``, which ``gradguard run`` and ``gradguard report`` share.

    Args:
        parser: The command's parser.
    """
    parser.add_argument(
        "--html",
        metavar="FILE",
        help="write one self-contained page of the run (memory per process, the leaks marked, the holders, "
        "what was not covered) when the command ends; opens offline; needs gradguard[report]",
    )
    parser.add_argument("--png", metavar="FILE", help="write the page's plot as a PNG (needs matplotlib)")


def _page_files(args: argparse.Namespace, prog: str) -> bool:
    """Whether ``--html`` and ``--png`` can be written (their folders, what they need installed); says why not."""
    if args.html is None and args.png is None:
        return True  # nothing of the page's is imported
    from ._page import check

    wrong = check(args.html, args.png)
    if wrong is not None:
        print(f"{prog}: {wrong}", file=sys.stderr)
        return False
    return True


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradguard run",
        usage=RUN_USAGE,
        allow_abbrev=False,  # the command starts at the first argument that is not one of ours, spelled out
        description=(
            "Run a command with gradguard.enforce() and the step-boundary watch (gradguard.watch) set up in "
            "every Python process it starts, when that process imports torch: the script itself, a launcher's "
            "ranks (torchrun, accelerate launch, deepspeed), multiprocessing children, Ray workers the "
            "command's driver starts. No change to the code. Each process writes a report to --report-dir; at "
            "the end one merged summary goes to stderr (stats, and per holder: the processes that had it, steps "
            "survived, bytes pinned, the fix). The exit status is the command's (128+N when a signal ended it); "
            "in raise mode a leak found in any process makes it non-zero."
        ),
    )
    settings_options(parser)
    page_options(parser)
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run library module MODULE as python -m does")
    parser.add_argument("script", nargs="?", help=f"the script, or {_PROGRAMS}; its arguments follow it")
    return parser


def _split_run(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(gradguard run's own arguments, the command)``: ours end at the script or program, or at ``-m MODULE``."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i], argv[i + 1 :]
        if arg in _RUN_OPTIONS or arg == "-m":
            if arg == "-m":
                return argv[: i + 2], argv[i + 2 :]
            i += 2
        elif arg.startswith("-m") and not arg.startswith("--"):  # -mpkg.mod, as python takes it
            return [*argv[:i], "-m", arg[2:]], argv[i + 1 :]
        elif arg.startswith("-"):
            i += 1  # --mode=raise, -h, or an unknown option for the parser to refuse
        else:
            return argv[:i], argv[i:]
    return argv, []


def _settings(args: argparse.Namespace, prog: str) -> tuple[str | None, Every | None] | None:
    """``(mode, every)`` from the options (``every`` defaults to GRADGUARD_AUDIT, else auto); ``None``
    after saying what is wrong."""
    from .._policy.modes import get_mode, normalize_mode

    try:
        get_mode()  # a bad GRADGUARD is refused before anything starts
        mode = None if args.mode is None else normalize_mode(args.mode, what="--mode")
        if args.audit_every is not None:
            every = validate.audit(args.audit_every, what="--audit-every")
        else:
            every = validate.audit(given(os.environ, AUDIT_ENV) or "auto", what=AUDIT_ENV)
    except GradGuardError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    return mode, every


def _command(module: str | None, target: list[str]) -> list[str] | str:
    """The command line to start, or why there is none: ``-m module`` and files run with this Python;
    anything else is a program found on PATH (or an executable file given by its path)."""
    import shutil

    if module is not None:
        if not module.strip():
            return f"-m {module!r} names no module; give -m MODULE (a module name, as python -m takes it)"
        return [sys.executable, "-m", module, *target]
    first, rest = target[0], target[1:]
    if not first.strip():
        return f"{first!r} (an empty name) is not a command; give a script (train.py), -m MODULE, or {_PROGRAMS}"
    if os.path.exists(first):
        if first.endswith((".py", ".pyz")) or os.path.isdir(first) or not os.access(first, os.X_OK):
            return [sys.executable, first, *rest]
        return [first, *rest]
    if first.endswith(".py") or os.sep in first:
        return f"cannot open {first!r}: no such file or directory"
    found = shutil.which(first)
    if found is None:
        return f"{first!r} is neither a file nor a program on PATH; give a script (train.py), -m MODULE, or {_PROGRAMS}"
    return [found, *rest]


_PYTHON_FLAGS = {"I": "ignores PYTHONPATH (-I)", "E": "ignores PYTHONPATH (-E)", "S": "skips site, which runs it (-S)"}


def python_flags(command: Sequence[str]) -> str | None:
    """Why the bootstrap cannot reach a command's own process.

    Args:
        command: The command line ``gradguard run`` starts.

    Returns:
        The reason when it is a Python started with ``-I``, ``-E`` or ``-S``; ``None`` otherwise.
    """
    import re

    if not command or not (
        command[0] == sys.executable or re.fullmatch(r"python[0-9.]*", os.path.basename(command[0]))
    ):
        return None
    found: list[str] = []
    args = iter(command[1:])
    for arg in args:
        if arg in ("-", "--") or not arg.startswith("-"):
            break  # the script, or stdin: the interpreter's own options end here
        if arg.startswith("--"):
            if arg == "--check-hash-based-pycs":
                next(args, None)
            continue
        letters = arg[1:]
        for i, letter in enumerate(letters):
            if letter in _PYTHON_FLAGS and letter not in found:
                found.append(letter)
            if letter in "cm":  # -c CMD, -m MOD: the options end
                return _unreachable(found)
            if letter in "WX":  # -W and -X take a value: the rest of this argument, else the next one
                if i == len(letters) - 1:
                    next(args, None)
                break
    return _unreachable(found)


def _unreachable(found: list[str]) -> str | None:
    if not found:
        return None
    return "the command's Python " + " and ".join(_PYTHON_FLAGS[f] for f in found) + ": the bootstrap cannot reach it"


_REPORT_DIR_ACCEPTED = "a new or empty folder (created if missing), or --report-dir left out for a new temporary folder"


def _report_dir(given_dir: str | None, prog: str) -> str | None:
    """The run folder: ``given_dir`` (created if missing; refused when it holds an earlier run's reports, so
    that a folder holds one run) or a new temporary folder; ``None`` after saying what is wrong. Runs
    that start on the same empty folder at once each read only their own reports (the run id)."""
    import tempfile

    if given_dir is None:
        return tempfile.mkdtemp(prefix="gradguard-run-")
    wrong = None
    folder = os.path.abspath(given_dir)
    if not given_dir.strip():
        wrong = "is not accepted"
    elif os.path.exists(folder) and not os.path.isdir(folder):
        wrong = "is a file"
    else:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            wrong = f"cannot be created ({exc})"
    if wrong is None and not os.access(folder, os.W_OK):
        wrong = "is not writable"
    if wrong is None:
        from ._names import runs_in

        earlier = sum(runs_in(folder).values())
        if earlier:
            wrong = f"already holds {earlier} report(s) of an earlier run (merge that run with gradguard report)"
    if wrong is not None:
        print(
            f"{prog}: {validate.refusal('--report-dir', given_dir, _REPORT_DIR_ACCEPTED, said=wrong)}", file=sys.stderr
        )
        return None
    return folder


# --------------------------------------------------------------------------------------------------
# gradguard run
# --------------------------------------------------------------------------------------------------


def run(argv: list[str]) -> int:
    """``gradguard run``.

    Args:
        argv: Its arguments: its own options, then the command and the command's arguments.

    Returns:
        The exit status: the command's (128+N when signal N ended it), 1 when it exited 0 but a process
        found a leak in ``raise`` mode, 2 for a refusal (nothing started).
    """
    from ._settings import child_environment, new_run_id

    own, target = _split_run(argv)
    parser = _run_parser()
    args = parser.parse_args(own)
    if args.module is None and not target:
        parser.error(f"give a script to run, or -m MODULE, or {_PROGRAMS}")
    if args.module is not None and args.script is not None:
        parser.error("give either a script or -m MODULE, not both")
    chosen = _settings(args, "gradguard run")
    if chosen is None or not _page_files(args, "gradguard run"):
        return 2
    mode, every = chosen
    command = _command(args.module, target)
    if isinstance(command, str):
        print(f"gradguard run: {command}", file=sys.stderr)
        return 2
    folder = _report_dir(args.report_dir, "gradguard run")
    if folder is None:
        return 2
    _retire()
    run_id = new_run_id()
    print(f"gradguard run: each process's report goes to {folder} (run {run_id})", file=sys.stderr, flush=True)
    hint = python_flags(command)
    if hint:
        print(f"gradguard run: {hint}; only its children that run without those flags are checked", file=sys.stderr)
    code = _start_and_wait(command, child_environment(folder, every, mode, run_id))

    from ._merge import merge
    from ._read import read_run

    found = read_run(folder, run_id)
    merged = merge(found.reports, found.problems, folder, hint=hint)
    print(merged.text, file=sys.stderr, flush=True)
    if not _write_page(args.html, args.png, found.reports, found.problems, merged.text, folder, "gradguard run"):
        code = code or 2
    _leave_a_record(folder, run_id, code, merged)
    if code == 0 and merged.raised:
        code = 1  # a process caught the GraphRetentionError, or its exit status did not reach the command's
    return code


def _retire() -> None:
    """A process the bootstrap set up, which runs ``gradguard run`` in-process, only launches now."""
    process = sys.modules.get("gradguard._launch._process")
    if process is not None:
        process.retire()


def _leave_a_record(folder: str, run_id: str, code: int, merged: Merged) -> None:
    """Inside another run (its folder in this process's environment): the record of this nested run."""
    outer = given(os.environ, REPORT_DIR)
    if outer is None or os.path.abspath(outer) == folder:
        return
    from ._identity import HOST
    from ._names import file_name
    from ._report import nested_record, write

    outer_run = (given(os.environ, RUN_ID) or "").strip()
    try:
        outer_run = check_run_id(outer_run) if outer_run else ""
    except GradGuardError:
        outer_run = ""  # the process reports say so; this record goes with them
    record = nested_record(
        run=outer_run, pid=os.getpid(), host=HOST,
        top=validate.read_count(os.environ.get(PARENT)) == os.getppid(), folder=folder, nested_run=run_id, code=code,
        raised=merged.raised, reached=merged.reached, checked=merged.checked,
    )  # fmt: skip
    try:
        os.makedirs(outer, exist_ok=True)
        write(os.path.join(outer, file_name(record.run, HOST, os.getpid())), record)
    except OSError as exc:
        print(f"gradguard run: the record of this run was not left in the outer run's folder {outer!r}: {exc}",
              file=sys.stderr)  # fmt: skip


def _start_and_wait(command: list[str], environ: dict[str, str]) -> int:
    """Run ``command`` to its end, passing SIGINT and SIGTERM on to it; its exit status as a shell gives it."""
    import subprocess

    with _Forwarding() as forwarding:
        try:
            child = subprocess.Popen(command, env=environ)
        except OSError as exc:
            print(f"gradguard run: cannot start {command[0]!r}: {exc}", file=sys.stderr)
            return 126 if isinstance(exc, PermissionError) else 127
        forwarding.started(child)
        _prepare()
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:  # not the main thread: no handler; the child got the terminal's SIGINT
                continue
    return 128 - code if code < 0 else code


def _prepare() -> None:
    """What the summary needs, imported while the command runs rather than before it starts."""
    from . import _merge, _read  # noqa: F401


class _Forwarding:
    """While entered (in the main thread): SIGTERM is passed on to the child, and so is SIGINT unless the
    terminal sent it (it sends Ctrl-C to the whole foreground process group, the child included: passing
    it on would interrupt the child twice). The handlers are in place before the child starts: a signal
    that comes before it exists is passed on as soon as it does."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []
        self.saved: dict[int, Handler] = {}

    def __enter__(self) -> _Forwarding:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.saved[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        for signum, handler in self.saved.items():
            signal.signal(signum, handler)

    def started(self, child: subprocess.Popen[bytes]) -> None:
        self.child = child
        while self.pending:
            self._pass_on(self.pending.pop(0))

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        import signal

        if signum == signal.SIGINT and _terminal_interrupts_child():
            return
        if self.child is None:
            self.pending.append(signum)
        else:
            self._pass_on(signum)

    def _pass_on(self, signum: int) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)


def _terminal_interrupts_child() -> bool:
    """Whether this process, and so the child in its process group, is the terminal's foreground job."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


# --------------------------------------------------------------------------------------------------
# gradguard env, gradguard report
# --------------------------------------------------------------------------------------------------


def env(args: argparse.Namespace) -> int:
    """``gradguard env``: print the variables, as ``export`` lines or JSON.

    Args:
        args: Its parsed options (:func:`settings_options`, and ``--json``).

    Returns:
        The exit status: 0, or 2 for a refusal.
    """
    import json
    import shlex

    from ._settings import BOOTSTRAP, exports, new_run_id, python_path

    _retire()
    chosen = _settings(args, "gradguard env")
    if chosen is None:
        return 2
    mode, every = chosen
    folder = _report_dir(args.report_dir, "gradguard env")
    if folder is None:
        return 2
    run_id = new_run_id()
    variables = exports(folder, every, mode, run_id)
    if args.json:
        print(json.dumps({"PYTHONPATH": python_path(os.environ.get("PYTHONPATH")), **variables}, indent=1))
        return 0
    # the shell expands "${PYTHONPATH:+:$PYTHONPATH}" as it is, empty entries included
    print(f"export PYTHONPATH={shlex.quote(BOOTSTRAP)}" + '"${PYTHONPATH:+:$PYTHONPATH}"')
    for name, value in variables.items():
        print(f"export {name}={shlex.quote(value)}")
    print(f"unset {AUDIT_ENV}  # the run's watch replaces it in each process")
    print(f"# afterwards: gradguard report {shlex.quote(folder)} --run {run_id}")
    return 0


def _write_page(
    html: str | None, png: str | None, reports: Sequence[Record], problems: Sequence[str], summary: str,
    folder: str, prog: str,
) -> bool:  # fmt: skip
    """Write ``--html`` and ``--png`` (each given) and say where; ``False`` after saying why one was not written."""
    if html is None and png is None:
        return True
    from ._page import write

    for line in write(html, png, reports, problems, summary, folder):
        print(f"{prog}: {line}", file=sys.stderr, flush=True)
        if line.startswith("cannot"):
            return False
    return True


def report(folder: str, run_id: str | None, html: str | None = None, png: str | None = None) -> int:
    """``gradguard report DIR [--run ID] [--html FILE] [--png FILE]``: print the merged summary of a run folder.

    Args:
        folder: The run folder.
        run_id: The run to merge, when the folder holds several (``None``: the only one there).
        html: Where to write the run's page, or ``None``.
        png: Where to write the page's plot as a PNG, or ``None``.

    Returns:
        The exit status: 1 when a process found a leak in ``raise`` mode, or when a report could not be
        used (its process may have found one); 2 for a refusal; 0 otherwise.
    """
    import datetime

    from ._merge import merge
    from ._read import read_run

    _retire()
    if not os.path.isdir(folder):
        print(f"gradguard report: {folder!r} is not a folder; give the run folder (GRADGUARD_REPORT_DIR)",
              file=sys.stderr)  # fmt: skip
        return 2
    if run_id is not None:
        try:
            check_run_id(run_id, what="--run")
        except GradGuardError as exc:
            print(f"gradguard report: {exc}", file=sys.stderr)
            return 2
    if not _page_files(argparse.Namespace(html=html, png=png), "gradguard report"):
        return 2
    found = read_run(folder, run_id)
    runs: dict[str, list[Record]] = {}
    for r in found.reports:
        runs.setdefault(r.run, []).append(r)
    if len(runs) > 1:
        listed = []
        for name, reports in sorted(runs.items(), key=lambda kv: -max(r.written for r in kv[1])):
            last = datetime.datetime.fromtimestamp(max(r.written for r in reports)).strftime("%Y-%m-%d %H:%M:%S")
            listed.append(f"{name or '(no run id)'}: {len(reports)} report(s), the last written {last}")
        print(f"gradguard report: {folder!r} holds the reports of {len(runs)} runs; give one with --run ID:\n  "
              + "\n  ".join(listed), file=sys.stderr)  # fmt: skip
        return 2
    merged = merge(found.reports, found.problems, folder=os.path.abspath(folder), prog="gradguard report")
    print(merged.text)
    written = _write_page(html, png, found.reports, found.problems, merged.text, os.path.abspath(folder),
                          "gradguard report")  # fmt: skip
    if not written:
        return 2
    return 1 if merged.raised or found.problems else 0
