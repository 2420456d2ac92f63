"""The ``gradguard`` command: ``gradguard bench``, ``gradguard doctor`` and ``gradguard run``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _threads(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; accepted: 0 (torch's default) or a positive count")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
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
        help="run a script (or -m module) under enforce() and the step-boundary watch",
        usage=_RUN_USAGE,
        add_help=False,
    )

    args = parser.parse_args(argv)
    if args.command == "bench":
        from ._errors import GradGuardError
        from ._policy import get_mode

        try:
            get_mode()  # a bad GRADGUARD is refused here, before the run, in one line
        except GradGuardError as exc:
            return _fail(str(exc))
        return _bench(args)
    from ._doctor import doctor

    return doctor()


def _fail(message: str) -> int:
    print(f"gradguard bench: {message}", file=sys.stderr)
    return 2


def _bench(args: argparse.Namespace) -> int:
    import torch

    from ._bench.machine import machine, machine_line
    from ._bench.report import plot, table, verdicts
    from ._bench.runner import run_scenario
    from ._bench.scenarios import PRESETS, SCENARIOS, Size

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
            from ._bench.megatron_gpt import unavailable

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
    tick, close = _progress(len(names) * 2 * micro_batches, args.no_progress)
    report: dict[str, Any] = {
        "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "torch": torch.__version__,
        "machine": machine_line(machine(device)),
        "scenarios": {},
    }
    try:
        for name in names:
            report["scenarios"][name] = run_scenario(name, device, size, micro_batches, tick, cap)
    finally:
        close()
    print(f"machine: {report['machine']}")
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if args.plot:
        plot(report, args.plot)
    failed = [c for r in report["scenarios"].values() for c, ok, _ in verdicts(r) if not ok]
    return 1 if failed else 0


def _late_leak(args: argparse.Namespace, device: Any, size: Any, names: list[str]) -> int:
    import torch

    from ._bench.late_leak import run_late_leak
    from ._bench.machine import machine, machine_line
    from ._bench.report import late_plot, late_table, late_verdicts

    if args.leak_start >= args.steps:
        return _fail(f"--leak-start {args.leak_start} must come before the last of --steps {args.steps}")
    tick, close = _progress(len(names) * (2 * args.steps + 2 * args.clean_steps), args.no_progress)
    report: dict[str, Any] = {
        "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "torch": torch.__version__,
        "machine": machine_line(machine(device)),
        "late_leak": {},
    }
    try:
        for name in names:
            report["late_leak"][name] = run_late_leak(
                name, device, size, start=args.leak_start, steps=args.steps, clean_steps=args.clean_steps, tick=tick
            )
    finally:
        close()
    print(f"machine: {report['machine']}")
    print(late_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    if args.plot:
        late_plot(report, args.plot)
    failed = [c for r in report["late_leak"].values() for c, ok, _ in late_verdicts(r) if not ok]
    return 1 if failed else 0


def _te_unavailable(device: Any) -> str | None:
    if device.type != "cuda":
        return "Transformer Engine runs on CUDA only"
    from ._doctor import te_import_error

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
# gradguard run
# --------------------------------------------------------------------------------------------------

_RUN_USAGE = "gradguard run [--mode MODE] [--audit-every N] (script.py | -m module) [args ...]"
_RUN_OPTIONS = ("--mode", "--audit-every")


def _run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradguard run",
        usage=_RUN_USAGE,
        description=(
            "Run a Python script, or a module as `python -m` does, inside gradguard.enforce() and the "
            "step-boundary watch (gradguard.watch), with no change to its code. At exit, print "
            "gradguard.stats() and the watch's summary (holders, bytes, steps survived) to stderr. "
            "In raise mode, exit non-zero when a graph outlived a step boundary."
        ),
    )
    parser.add_argument(
        "--mode", help="off, detach, warn or raise (default: GRADGUARD, else detach); the watch's mode too"
    )
    parser.add_argument(
        "--audit-every",
        metavar="N",
        help="audit every N-th optimizer step; auto (the default, or GRADGUARD_AUDIT when set): as often "
        "as keeps the audits under 1%% of the run's time; 0/off: no watch",
    )
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run library module MODULE as a script")
    parser.add_argument("script", nargs="?", help="the script (its arguments follow it)")
    return parser


def _split_run(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(gradguard run's own arguments, the target's argv)``: ours end at the script or at ``-m MODULE``."""
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


def _run(argv: list[str]) -> int:
    own, target = _split_run(argv)
    parser = _run_parser()
    args = parser.parse_args(own)
    if args.module is None and not target:
        parser.error("give a script to run, or -m MODULE")
    if args.module is not None and args.script is not None:
        parser.error("give either a script or -m MODULE, not both")

    from ._errors import GradGuardError
    from ._policy import get_mode, normalize_mode
    from ._watch import AUDIT_ENV, parse_audit

    try:
        get_mode()  # a bad GRADGUARD is refused before the script starts
        mode = None if args.mode is None else normalize_mode(args.mode, what="--mode")
        if args.audit_every is not None:
            every = parse_audit(args.audit_every, what="--audit-every")
        else:
            every = parse_audit(os.environ.get(AUDIT_ENV) or "auto", what=AUDIT_ENV)
    except GradGuardError as exc:
        print(f"gradguard run: {exc}", file=sys.stderr)
        return 2
    if args.module is None:
        script = target[0]
        if not os.path.exists(script):
            print(f"gradguard run: cannot open {script!r}: no such file or directory", file=sys.stderr)
            return 2
    return _run_target(args.module, target, mode, every)


def _run_target(module: str | None, target: list[str], mode: Any, every: Any) -> int:
    import contextlib
    import runpy

    from ._enforce import enforce
    from ._stats import stats
    from ._watch import stop_process_watch, watch

    stop_process_watch()  # GRADGUARD_AUDIT is this run's --audit-every default: one watch, not two

    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    if module is None:
        sys.argv = list(target)
        path0 = os.path.dirname(os.path.realpath(target[0]))
    else:
        sys.argv = [module, *target]  # runpy puts the module's file name in argv[0], as python -m does
        path0 = os.getcwd()
    if sys.path:
        sys.path[0] = path0
    else:
        sys.path.append(path0)
    watching = None if every is None else watch(every=every, mode=mode)
    code = 0
    try:
        with enforce(mode=mode, audit=0), watching if watching is not None else contextlib.nullcontext():
            if module is None:
                runpy.run_path(target[0], run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_status(exc.code)
    except BaseException as exc:  # noqa: BLE001 - reported as python would, then the summary
        tb = _script_traceback(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        del tb
        code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
    counted = stats()
    summary = f"gradguard stats:\n{counted}" if counted else "gradguard stats: no guarded store saw a record"
    print(summary, file=sys.stderr)
    if watching is not None:
        watcher = watching.watcher
        print(watcher.summary(), file=sys.stderr)
        if code == 0 and any(entry.outcome == "raised" for entry in watcher.history()):
            code = 1  # the script caught the GraphRetentionError: the run still failed
    return code


def _script_traceback(tb: Any) -> Any:
    """The traceback from the script's first frame on, as python shows it: without this module and runpy."""
    own = os.path.abspath(__file__)
    while tb is not None and tb.tb_next is not None:
        filename = tb.tb_frame.f_code.co_filename
        if os.path.abspath(filename) != own and "runpy" not in filename:
            break
        tb = tb.tb_next
    return tb


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
