"""The ``gradguard`` command: ``gradguard bench``, ``gradguard doctor``, ``gradguard run``, ``gradguard env``
and ``gradguard report``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _threads(text: str) -> int:
    value = _whole(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; accepted: 0 (torch's default) or a positive count")
    return value


def _positive(text: str) -> int:
    value = _whole(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not accepted; accepted: a whole number >= 1")
    return value


def _output(text: str) -> str:
    """An output path whose folder exists and is writable: checked before the run, not after it."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {folder!r} is not writable")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file name")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # its own parser: everything after the script belongs to the script
        return _run(argv[1:])
    parser = argparse.ArgumentParser(
        prog="gradguard", description="Keep per-micro-batch records from pinning autograd graphs."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="per-micro-batch memory growth, unguarded vs guarded")
    bench.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when present")
    bench.add_argument(
        "--scenario",
        action="append",
        help="pp-last-stage, lora-checkpoint (the default: both), megatron-gpt (needs megatron-core)",
    )
    bench.add_argument("--micro-batches", type=int, default=None, help="micro-batches per run (default 32)")
    bench.add_argument(
        "--preset", choices=("seed-pp4",), help="seed-pp4: ~45.4 MiB pinned per micro-batch × 1024 (CUDA)"
    )
    bench.add_argument("--json", metavar="PATH", type=_output, help="write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", type=_output, help="write a PNG plot (needs matplotlib)")
    bench.add_argument("--te", action="store_true", help="also run the Transformer Engine block (needs TE and CUDA)")
    bench.add_argument(
        "--memory-cap",
        type=float,
        metavar="GIB",
        help="stop a run once its allocated memory passes GIB (default on CUDA: 85%% of the device's memory)",
    )
    bench.add_argument(
        "--late-leak",
        action="store_true",
        help="a clean run that starts leaking at --leak-start, unwatched and watched (memory per step, the step "
        "the leak is reported at), and --clean-steps clean steps for the watch's share of the time",
    )
    bench.add_argument("--leak-start", type=_positive, default=500, metavar="STEP", help="--late-leak: default 500")
    bench.add_argument("--steps", type=_positive, default=1000, metavar="N", help="--late-leak: default 1000")
    bench.add_argument("--clean-steps", type=_positive, default=2000, metavar="N", help="--late-leak: default 2000")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--threads",
        type=_threads,
        default=1,
        help="CPU: torch threads (default 1: steady timings on shared cores; 0 keeps torch's default)",
    )

    sub.add_parser("doctor", help="what gradguard sees here: torch, CUDA, TE, engines, mode")
    sub.add_parser(
        "run",
        help="run a command (a script, -m module, torchrun, accelerate, ...) with enforce() and the step-boundary "
        "watch in every Python process it starts, and print one summary",
        usage=_RUN_USAGE,
        add_help=False,
    )
    env = sub.add_parser(
        "env",
        help="print the environment that sets gradguard up in processes gradguard run does not start "
        "(an existing Ray cluster, srun, a Kubernetes pod)",
        description="Print the variables that make every Python process started with them set gradguard up "
        "when it imports torch and write its report to --report-dir (the bootstrap first on PYTHONPATH). "
        "Merge the reports afterwards with `gradguard report DIR`.",
    )
    _settings_options(env)
    env.add_argument("--json", action="store_true", help="one JSON object (for Ray's runtime_env env_vars, a pod spec)")
    report = sub.add_parser(
        "report",
        help="merge the reports of a run into one summary (exit status 1 when a process found a leak in raise mode)",
    )
    report.add_argument("folder", metavar="DIR", help="the run folder (GRADGUARD_REPORT_DIR)")

    args = parser.parse_args(argv)
    if args.command in ("env", "report"):
        from .._launch import _process

        _process.retire()  # with the run's environment exported, this tool's own process is no trainer of it
    if args.command == "env":
        return _env(args, env)
    if args.command == "report":
        return _report(args.folder)
    if args.command == "bench":
        from .._errors import GradGuardError
        from .._policy.modes import get_mode

        try:
            get_mode()  # a bad GRADGUARD is refused here, before the run, in one line
        except GradGuardError as exc:
            return _fail(str(exc))
        return _bench(args)
    from .doctor import doctor

    return doctor()


def _fail(message: str) -> int:
    print(f"gradguard bench: {message}", file=sys.stderr)
    return 2


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .bench.report import plot, table, verdicts
    from .bench.runner import run_scenario
    from .bench.scenarios import PRESETS, SCENARIOS, Size

    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        return _fail("--device cuda, but torch sees no CUDA device (torch.cuda.is_available() is False)")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and cuda) else "cpu")
    if device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _fail("--plot needs matplotlib: pip install 'gradguard[bench]'")

    size, micro_batches = Size(), 32
    names = args.scenario or ["pp-last-stage", "lora-checkpoint"]
    if args.preset:
        size, micro_batches = PRESETS[args.preset]
        names = args.scenario or ["pp-last-stage"]
        if device.type != "cuda":
            need = micro_batches * 2 * size.seq * size.batch * size.hidden * size.dtype.itemsize
            return _fail(
                f"--preset {args.preset} is a CUDA run: its unguarded run keeps ~{need / 2**30:.1f} GiB of "
                f"pinned graphs ({micro_batches} micro-batches × {need / micro_batches / 2**20:.1f} MiB); "
                "run it with a GPU, or drop --preset"
            )
    if args.micro_batches is not None:
        if args.micro_batches < 2:
            return _fail("--micro-batches must be at least 2 (a slope needs two points)")
        micro_batches = args.micro_batches
    for name in names:
        if name not in SCENARIOS:
            return _fail(f"unknown scenario {name!r}; known: pp-last-stage, lora-checkpoint, megatron-gpt")
        if name == "megatron-gpt":
            from .bench.megatron_gpt import unavailable

            reason = unavailable()
            if reason:
                return _fail(f"--scenario megatron-gpt needs megatron-core: {reason}")
        if name == "pp-last-stage-te":
            # Named directly (not through --te): without TE this is a refusal, not an ImportError traceback.
            reason = _te_unavailable(device)
            if reason:
                return _fail(f"--scenario {name} needs Transformer Engine: {reason}")
    if args.te:
        reason = _te_unavailable(device)
        if reason:
            print(f"gradguard bench: skipping --te: {reason}", file=sys.stderr)
        elif "pp-last-stage-te" not in names:
            names.append("pp-last-stage-te")

    if args.memory_cap is not None and args.memory_cap <= 0:
        return _fail(f"--memory-cap must be a positive number of GiB, got {args.memory_cap:g}")
    cap = None if args.memory_cap is None else int(args.memory_cap * 2**30)
    if cap is None and device.type == "cuda":
        cap = int(0.85 * torch.cuda.get_device_properties(device).total_memory)

    if args.late_leak:
        return _late_leak(args, device, size, names)

    def run(name: str, tick: Callable[[], None]) -> Any:
        return run_scenario(name, device, size, micro_batches, tick, cap)

    return _measure(args, device, "scenarios", names, len(names) * 2 * micro_batches, run, table, plot, verdicts)


def _late_leak(args: argparse.Namespace, device: Any, size: Any, names: list[str]) -> int:
    from .bench.late_leak import run_late_leak
    from .bench.report import late_plot, late_table, late_verdicts

    if args.leak_start >= args.steps:
        return _fail(f"--leak-start {args.leak_start} must come before the last of --steps {args.steps}")

    def run(name: str, tick: Callable[[], None]) -> Any:
        return run_late_leak(
            name, device, size, start=args.leak_start, steps=args.steps, clean_steps=args.clean_steps, tick=tick
        )

    total = len(names) * (2 * args.steps + 2 * args.clean_steps)
    return _measure(args, device, "late_leak", names, total, run, late_table, late_plot, late_verdicts)


def _measure(
    args: argparse.Namespace,
    device: Any,
    key: str,
    names: list[str],
    total: int,
    run: Callable[[str, Callable[[], None]], Any],
    table: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], str], None],
    verdicts: Callable[[Any], list[tuple[str, bool, str]]],
) -> int:
    """Run ``run(name, tick)`` per scenario into ``report[key]``, print the machine line and the table,
    write ``--json`` and ``--plot``; exit status 1 when a verdict failed."""
    import torch

    from .bench.machine import machine, machine_line
    from .bench.report import write_json

    tick, close = _progress(total, args.no_progress)
    report: dict[str, Any] = {
        "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "torch": torch.__version__,
        "machine": machine_line(machine(device)),
        key: {},
    }
    try:
        for name in names:
            report[key][name] = run(name, tick)
    finally:
        close()
    print(f"machine: {report['machine']}")
    print(table(report))
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    failed = [c for r in report[key].values() for c, ok, _ in verdicts(r) if not ok]
    return 1 if failed else 0


def _te_unavailable(device: Any) -> str | None:
    if device.type != "cuda":
        return "Transformer Engine runs on CUDA only"
    from .doctor import te_import_error

    error = te_import_error()
    return None if error is None else f"transformer_engine does not import ({error})"


def _progress(total: int, disabled: bool) -> tuple[Any, Any]:
    if disabled or not sys.stderr.isatty():
        return (lambda: None), (lambda: None)
    try:
        from tqdm import tqdm
    except ImportError:
        return (lambda: None), (lambda: None)
    bar = tqdm(total=total, unit="micro-batch", leave=False)
    return (lambda: bar.update(1)), bar.close


# --------------------------------------------------------------------------------------------------
# gradguard run, env, report
# --------------------------------------------------------------------------------------------------

_RUN_USAGE = (
    "gradguard run [--mode MODE] [--audit-every N] [--report-dir DIR] (script.py | -m module | program) [args ...]"
)
_RUN_OPTIONS = ("--mode", "--audit-every", "--report-dir")
_PROGRAMS = "a program on PATH (torchrun, accelerate, deepspeed, python, ...)"


def _settings_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode", help="off, detach, warn or raise (default: GRADGUARD, else detach); the watch's mode too"
    )
    parser.add_argument(
        "--audit-every",
        metavar="N",
        help="audit every N-th optimizer step in each process; auto (the default, or GRADGUARD_AUDIT when set): "
        "when the memory in use grows, and behind that as often as keeps the audits within a small share of "
        "the run's time; 0/off: no watch",
    )
    parser.add_argument(
        "--report-dir",
        metavar="DIR",
        help="where each process writes its report (default: a new temporary folder, announced on stderr)",
    )


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradguard run",
        usage=_RUN_USAGE,
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
    _settings_options(parser)
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


def _settings(args: argparse.Namespace, prog: str) -> tuple[Any, Any] | None:
    """``(mode, every)`` from the options (``every`` defaults to GRADGUARD_AUDIT, else auto); ``None``
    after saying what is wrong."""
    from .._errors import GradGuardError
    from .._policy.modes import get_mode, normalize_mode
    from .._watch.watcher import AUDIT_ENV, parse_audit

    try:
        get_mode()  # a bad GRADGUARD is refused before anything starts
        mode = None if args.mode is None else normalize_mode(args.mode, what="--mode")
        if args.audit_every is not None:
            every = parse_audit(args.audit_every, what="--audit-every")
        else:
            every = parse_audit(os.environ.get(AUDIT_ENV) or "auto", what=AUDIT_ENV)
    except GradGuardError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    return mode, every


def _command(module: str | None, target: list[str]) -> list[str] | str:
    """The command line to start, or why there is none: ``-m module`` and files run with this Python;
    anything else is a program found on PATH (or an executable file given by its path)."""
    import shutil

    if module is not None:
        return [sys.executable, "-m", module, *target]
    first, rest = target[0], target[1:]
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


def _report_dir(given: str | None, prog: str) -> str | None:
    """The run folder: ``given`` (created if missing; refused when it holds an earlier run's reports) or a
    new temporary folder; ``None`` after saying what is wrong."""
    import tempfile

    from .._launch._report import reports_in

    if given is None:
        return tempfile.mkdtemp(prefix="gradguard-run-")
    folder = os.path.abspath(given)
    if os.path.exists(folder) and not os.path.isdir(folder):
        print(f"{prog}: --report-dir {given!r} is a file; give a folder (new or empty)", file=sys.stderr)
        return None
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        print(f"{prog}: --report-dir {given!r} cannot be created ({exc}); give a writable folder", file=sys.stderr)
        return None
    if not os.access(folder, os.W_OK):
        print(f"{prog}: --report-dir {given!r} is not writable; give a writable folder", file=sys.stderr)
        return None
    earlier = reports_in(folder)
    if earlier:
        print(
            f"{prog}: --report-dir {given!r} already holds {len(earlier)} report(s) of an earlier run, which would "
            "be merged into this one; give a new or empty folder",
            file=sys.stderr,
        )
        return None
    return folder


def _run(argv: list[str]) -> int:
    own, target = _split_run(argv)
    parser = _run_parser()
    args = parser.parse_args(own)
    if args.module is None and not target:
        parser.error(f"give a script to run, or -m MODULE, or {_PROGRAMS}")
    if args.module is not None and args.script is not None:
        parser.error("give either a script or -m MODULE, not both")
    settings = _settings(args, "gradguard run")
    if settings is None:
        return 2
    mode, every = settings
    command = _command(args.module, target)
    if isinstance(command, str):
        print(f"gradguard run: {command}", file=sys.stderr)
        return 2
    folder = _report_dir(args.report_dir, "gradguard run")
    if folder is None:
        return 2

    from .._launch import _process
    from .._launch._merge import merge
    from .._launch._report import read_run
    from .._launch._settings import child_environment

    _process.retire()  # gradguard run inside a process set up by an outer run: this one only launches
    print(f"gradguard run: each process's report goes to {folder}", file=sys.stderr, flush=True)
    code = _start_and_wait(command, child_environment(folder, every, mode))
    merged = merge(*read_run(folder), folder=folder)
    print(merged.text, file=sys.stderr, flush=True)
    if code == 0 and merged.raised:
        code = 1  # a process caught the GraphRetentionError, or its exit status did not reach the command's
    return code


def _start_and_wait(command: list[str], environ: dict[str, str]) -> int:
    """Run ``command`` to its end, forwarding SIGINT and SIGTERM to it; its exit status as a shell gives it."""
    import subprocess

    try:
        child = subprocess.Popen(command, env=environ)
    except OSError as exc:
        print(f"gradguard run: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return 126 if isinstance(exc, PermissionError) else 127
    with _forwarding(child):
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:  # not the main thread: no handler; the child got the terminal's SIGINT
                continue
    return 128 - code if code < 0 else code


class _forwarding:
    """While entered (in the main thread): SIGTERM is passed on to the child, and so is SIGINT unless
    the terminal sent it (it sends Ctrl-C to the whole foreground process group, the child included:
    passing it on would interrupt the child twice)."""

    def __init__(self, child: Any) -> None:
        self.child = child
        self.saved: dict[int, Any] = {}

    def __enter__(self) -> None:
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.saved[signum] = signal.signal(signum, self._handle)

    def __exit__(self, *exc: object) -> None:
        import signal

        for signum, handler in self.saved.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        import signal

        if signum == signal.SIGINT and _terminal_interrupts_child():
            return
        if self.child.poll() is None:
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


def _env(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import shlex

    from .._launch._settings import BOOTSTRAP, exports, python_path

    settings = _settings(args, "gradguard env")
    if settings is None:
        return 2
    mode, every = settings
    folder = _report_dir(args.report_dir, "gradguard env")
    if folder is None:
        return 2
    variables = exports(folder, every, mode)
    if args.json:
        print(json.dumps({"PYTHONPATH": python_path(os.environ.get("PYTHONPATH")), **variables}, indent=1))
        return 0
    print(f"export PYTHONPATH={shlex.quote(BOOTSTRAP)}" + '"${PYTHONPATH:+:$PYTHONPATH}"')
    for name, value in variables.items():
        print(f"export {name}={shlex.quote(value)}")
    print("unset GRADGUARD_AUDIT  # the run's watch replaces it in each process")
    print(f"# afterwards: gradguard report {shlex.quote(folder)}")
    return 0


def _report(folder: str) -> int:
    from .._launch._merge import merge
    from .._launch._report import read_run

    if not os.path.isdir(folder):
        print(
            f"gradguard report: {folder!r} is not a folder; give the run folder (GRADGUARD_REPORT_DIR)", file=sys.stderr
        )
        return 2
    merged = merge(*read_run(folder), folder=os.path.abspath(folder))
    print(merged.text)
    return 1 if merged.raised else 0
