"""The ``gradguard`` command: ``gradguard bench`` and ``gradguard doctor``."""

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
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument(
        "--threads",
        type=_threads,
        default=1,
        help="CPU: torch threads (default 1: steady timings on shared cores; 0 keeps torch's default)",
    )

    sub.add_parser("doctor", help="what gradguard sees here: torch, CUDA, TE, engines, mode")

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
