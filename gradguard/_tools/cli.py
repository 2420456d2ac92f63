"""The ``gradguard`` command: ``gradguard bench``, ``gradguard doctor``, ``gradguard run``, ``gradguard env``
and ``gradguard report`` (the last three in :mod:`gradguard._launch.commands`).

Every option is checked before anything runs: a bad value is a usage error (exit status 2) naming the
option, the value and what is accepted. Nothing here imports torch before a sub-command needs it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from .bench.scenarios import Size

__all__ = ["main"]


DEVICES = ("auto", "cpu", "cuda")


def _check_bench(args: argparse.Namespace) -> None:
    """``gradguard bench``'s options checked and converted in place, before torch is imported (``--preset``
    and ``--scenario``, whose names the bench's modules hold, are checked by :func:`_bench` before it runs).

    Raises:
        GradGuardError: the first bad one, naming the flag, the value and what is accepted.
    """
    from .._policy import validate

    args.device = validate.choice(args.device, {d: d for d in DEVICES}, what="--device", accepted=", ".join(DEVICES))
    if args.micro_batches is not None:
        args.micro_batches = validate.whole(
            args.micro_batches,
            what="--micro-batches",
            least=2,
            accepted="a whole number >= 2 (a slope needs two points)",
        )
    for flag in ("--leak-start", "--steps", "--clean-steps"):
        dest = flag[2:].replace("-", "_")
        setattr(args, dest, validate.whole(getattr(args, dest), what=flag, least=1))
    args.threads = validate.whole(
        args.threads, what="--threads", accepted="0 (torch's default) or a positive whole number"
    )
    if args.memory_cap is not None:
        args.memory_cap = validate.number(
            args.memory_cap, what="--memory-cap", accepted="a positive number of GiB", ok=lambda gib: gib > 0
        )
    for flag in ("--json", "--plot"):
        path = getattr(args, flag[2:])
        if path is not None:
            validate.output_file(path, what=flag)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``gradguard`` command.

    Args:
        argv: Its arguments (``sys.argv[1:]`` by default).

    Returns:
        The exit status (2 for a refusal: a bad option is named with what is accepted).
    """
    from .._launch import commands

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:  # its own parser: everything after the script belongs to the script
        return commands.run(argv[1:])
    parser = argparse.ArgumentParser(
        prog="gradguard", description="Keep per-micro-batch records from pinning autograd graphs."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="per-micro-batch memory growth, unguarded vs guarded")
    bench.add_argument("--device", metavar="{auto,cpu,cuda}", default="auto", help="auto: CUDA when present")
    bench.add_argument(
        "--scenario",
        action="append",
        help="pp-last-stage, lora-checkpoint, no-adapter (the default: these three), megatron-gpt (needs "
        "megatron-core); no-adapter: pp-last-stage's engine with no adapter, only the watch, unwatched and "
        "in detach, raise and warn mode",
    )
    bench.add_argument("--micro-batches", metavar="N", help="micro-batches per run (default 32)")
    bench.add_argument(
        "--preset", metavar="{seed-pp4}", help="seed-pp4: ~45.4 MiB pinned per micro-batch × 1024 (CUDA)"
    )
    bench.add_argument("--json", metavar="PATH", help="write the results as JSON")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    bench.add_argument("--te", action="store_true", help="also run the Transformer Engine block (needs TE and CUDA)")
    bench.add_argument(
        "--memory-cap",
        metavar="GIB",
        help="stop a run once its allocated memory passes GIB (default on CUDA: 85%% of the device's memory)",
    )
    bench.add_argument(
        "--late-leak",
        action="store_true",
        help="a clean run that starts leaking at --leak-start, unwatched and watched (memory per step, the step "
        "the leak is reported at), and --clean-steps clean steps for the watch's share of the time",
    )
    bench.add_argument("--leak-start", default=500, metavar="STEP", help="--late-leak: default 500")
    bench.add_argument("--steps", default=1000, metavar="N", help="--late-leak: default 1000")
    bench.add_argument("--clean-steps", default=2000, metavar="N", help="--late-leak: default 2000")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--threads",
        metavar="N",
        default=1,
        help="CPU: torch threads (default 1: steady timings on shared cores; 0 keeps torch's default)",
    )

    sub.add_parser("doctor", help="what gradguard sees here: torch, CUDA, TE, known leaks, engines, mode")
    sub.add_parser(
        "run",
        help="run a command (a script, -m module, torchrun, accelerate, ...) with enforce() and the step-boundary "
        "watch in every Python process it starts, and print one summary",
        usage=commands.RUN_USAGE,
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
    commands.settings_options(env)
    env.add_argument("--json", action="store_true", help="one JSON object (for Ray's runtime_env env_vars, a pod spec)")
    report = sub.add_parser(
        "report",
        help="merge the reports of a run into one summary (exit status 1 when a process found a leak in raise mode, "
        "or when a report could not be used)",
    )
    report.add_argument("folder", metavar="DIR", help="the run folder (GRADGUARD_REPORT_DIR)")
    report.add_argument(
        "--run", metavar="ID", help="the run whose reports to merge, when the folder holds several (GRADGUARD_RUN_ID)"
    )
    commands.page_options(report)

    args = parser.parse_args(argv)
    if args.command == "env":
        return commands.env(args)
    if args.command == "report":
        return commands.report(args.folder, args.run, html=args.html, png=args.png)
    if args.command == "bench":
        from .._errors import GradGuardError
        from .._policy.modes import get_mode

        try:
            _check_bench(args)
            get_mode()  # a bad GRADGUARD is refused here, before the run, in one line
        except GradGuardError as exc:
            return _fail(str(exc))
        return _bench(args)
    from .doctor import doctor

    return doctor()


def _choice(value: str, known: Mapping[str, object], what: str) -> str:
    from .._policy import validate

    return validate.choice(value, {name: name for name in known}, what=what, accepted=", ".join(known))


def _fail(message: str) -> int:
    print(f"gradguard bench: {message}", file=sys.stderr)
    return 2


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .._errors import GradGuardError
    from .bench.no_adapter import LEAST as NO_ADAPTER_LEAST
    from .bench.no_adapter import MODES, run_no_adapter
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

    try:
        known = {**SCENARIOS, "no-adapter": None}
        defaults = ["pp-last-stage", "lora-checkpoint"] + ([] if args.late_leak else ["no-adapter"])
        names = [_choice(name, known, "--scenario") for name in args.scenario or defaults]
        preset = None if args.preset is None else _choice(args.preset, PRESETS, "--preset")
    except GradGuardError as exc:
        return _fail(str(exc))
    size, micro_batches = Size(), 32
    if preset is not None:
        args.preset = preset
        size, micro_batches = PRESETS[args.preset]
        names = names if args.scenario else ["pp-last-stage"]
        if device.type != "cuda":
            need = micro_batches * 2 * size.seq * size.batch * size.hidden * size.dtype.itemsize
            return _fail(
                f"--preset {args.preset} is a CUDA run: its unguarded run keeps ~{need / 2**30:.1f} GiB of "
                f"pinned graphs ({micro_batches} micro-batches × {need / micro_batches / 2**20:.1f} MiB); "
                "run it with a GPU, or drop --preset"
            )
    if args.micro_batches is not None:
        micro_batches = args.micro_batches
    if "no-adapter" in names and micro_batches < NO_ADAPTER_LEAST:
        if args.scenario:
            return _fail(
                f"--scenario no-adapter needs --micro-batches >= {NO_ADAPTER_LEAST} (the report comes by micro-batch "
                f"{NO_ADAPTER_LEAST - 4}, the growth after it needs 4 more); got {micro_batches}"
            )
        names.remove("no-adapter")
        print(f"gradguard bench: skipping no-adapter: it needs --micro-batches >= {NO_ADAPTER_LEAST}", file=sys.stderr)
    for name in names:
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

    cap = None if args.memory_cap is None else int(args.memory_cap * 2**30)
    if cap is None and device.type == "cuda":
        cap = int(0.85 * torch.cuda.get_device_properties(device).total_memory)

    if args.late_leak:
        if "no-adapter" in names:
            return _fail("--late-leak runs pp-last-stage, lora-checkpoint or megatron-gpt, not no-adapter")
        return _late_leak(args, device, size, names)

    def run(name: str, tick: Callable[[], None]) -> Any:
        if name == "no-adapter":
            return run_no_adapter(device, size, micro_batches, tick, cap)
        return run_scenario(name, device, size, micro_batches, tick, cap)

    total = sum((len(MODES) if name == "no-adapter" else 2) * micro_batches for name in names)
    return _measure(args, device, "scenarios", names, total, run, table, plot, verdicts)


def _late_leak(args: argparse.Namespace, device: torch.device, size: Size, names: list[str]) -> int:
    from .._policy.validate import refusal
    from .bench.late_leak import run_late_leak
    from .bench.report import late_plot, late_table, late_verdicts

    if args.leak_start >= args.steps:
        return _fail(str(refusal("--leak-start", args.leak_start, f"a step before the last of --steps ({args.steps})")))

    def run(name: str, tick: Callable[[], None]) -> Any:
        return run_late_leak(
            name, device, size, start=args.leak_start, steps=args.steps, clean_steps=args.clean_steps, tick=tick
        )

    total = len(names) * (2 * args.steps + 2 * args.clean_steps)
    return _measure(args, device, "late_leak", names, total, run, late_table, late_plot, late_verdicts)


def _measure(
    args: argparse.Namespace,
    device: torch.device,
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


def _te_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "Transformer Engine runs on CUDA only"
    from .doctor import te_import_error

    error = te_import_error()
    return None if error is None else f"transformer_engine does not import ({error})"


def _progress(total: int, disabled: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(tick, close)`` of a progress bar on a terminal (tqdm), else two functions that do nothing."""
    bar = None
    if not disabled and sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            bar = tqdm(total=total, unit="micro-batch", leave=False)

    def tick() -> None:
        if bar is not None:
            bar.update(1)

    def close() -> None:
        if bar is not None:
            bar.close()

    return tick, close
