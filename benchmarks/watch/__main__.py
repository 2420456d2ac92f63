"""``python -m benchmarks.watch``: run every case, print the checks and tables, write the results."""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from benchmarks.watch import __doc__ as DOC
from benchmarks.watch.cost import MICRO_MS, MIN_STEP_MS, cost_cases, floor, side_by_side
from benchmarks.watch.library import library_leak
from benchmarks.watch.loops import fast_run, frame_local_run, late_run, micro_run
from benchmarks.watch.report import COST_HEADER, HEADER, cost_rows, floor_text, markdown, plot, row, row_text
from gradguard._tools.bench.machine import measuring
from gradguard._tools.bench.report import write_json

__all__ = ["SCENARIOS", "main", "measure"]

SCENARIOS = ("pp-last-stage", "lora-checkpoint", "megatron-gpt")


def _cases(args: argparse.Namespace) -> Iterator[tuple[str, str, Callable[[bool], dict[str, Any]]]]:
    """The leak and clean cases: ``(case, kind, run(watched))``; ``kind``: ``leak from N`` or ``clean``."""
    device = torch.device(args.device)
    for name in args.scenario:
        yield (
            f"late/{name}",
            f"leak from {args.late_start}",
            functools.partial(
                late_run, name, device, args.late_steps, args.late_start, micro_batches=args.micro_batches
            ),
        )
        yield (
            f"late/{name} clean",
            "clean",
            functools.partial(late_run, name, device, args.clean_steps // 4, None, micro_batches=args.micro_batches),
        )
    fast, growth = (args.fast_steps, args.fast_start), (args.growth_steps, args.growth_start)
    for case, program, (steps, start) in (
        ("fast/eval-forward", "eval-forward", fast),
        ("growth-then-leak", "growth-then-leak", growth),
        ("thread-backward", "thread-backward", fast),
    ):
        yield case, f"leak from {start}", functools.partial(fast_run, device, program, steps, start)
    yield "frame-local", f"leak from {fast[1]}", functools.partial(frame_local_run, device, *fast)
    yield "short-6", "leak from 1", lambda w: fast_run(device, "running-loss", 6, 1, w)
    yield "short-30", "leak from 1", lambda w: fast_run(device, "metric", 30, 1, w)
    yield "micro/seed", "leak from 1", lambda w: micro_run(device, args.seed_micro_batches, 1, w)
    yield "fast/clean", "clean", lambda w: fast_run(device, "clean", args.clean_steps, 0, w)
    yield "sawtooth", "clean", lambda w: fast_run(device, "sawtooth", args.clean_steps, 0, w)


def measure(args: argparse.Namespace, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every case's entry, each printed with its checks as it ends."""
    entries: list[dict[str, Any]] = []

    def done(entry: dict[str, Any]) -> None:
        entries.append(entry)
        say(row_text(entry))

    def wanted(case: str) -> bool:
        return not args.only or case.startswith(tuple(args.only))

    for case, kind, run in _cases(args):
        if not wanted(case):
            continue
        entry = {"case": case, "kind": kind, "unwatched": run(False), "watched": run(True)}
        done({**entry, "unit": "micro-batch"} if case.startswith("micro/") else entry)
    device = torch.device(args.device)
    cases = cost_cases(device, args.mb_scenario, args.cost_steps, args.mb_steps, args.storm_steps, args.micro_steps)
    for case, target, run in cases:
        if not wanted(case):
            continue
        figures = side_by_side(run, args.rounds)
        steps = figures["pairs"][0]["unwatched"]["steps"]
        entry = {"case": case, "kind": "cost", "target": target, "steps": steps, "quick": args.quick, **figures}
        if case in MIN_STEP_MS:
            entry["min_step_ms"] = MIN_STEP_MS[case]
        if case in MICRO_MS:
            entry["micro_ms_range"] = MICRO_MS[case]
            entry["micro_batches_a_step"] = micro = figures["pairs"][0]["unwatched"]["micro_batches_a_step"]
            entry["micro_ms"] = figures["step_ms"] / micro
        done(entry)
    shorter = None
    if not wanted("library-leak/"):
        return entries
    for steps, figures in library_leak(args.device, args.library_steps, args.rounds).items():
        entry = {"case": f"library-leak/{steps}", "kind": "library leak", "target": 1.05, "steps": steps}
        entry.update(quick=args.quick, shorter=shorter, **figures)
        done(entry)
        shorter = {"steps": steps, "cpu": figures["cpu"], "wall": figures["wall"]}
    return entries


def _steps(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if len(values) != 2 or not 0 < values[0] < values[1]:
        raise argparse.ArgumentTypeError("two step counts, the shorter first: 200,800")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 (a missed check is printed and written, not an error)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.watch", description=DOC.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--scenario", action="append", choices=SCENARIOS, help="late leaks: default all that run here")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--late-steps", type=int, default=600)
    p.add_argument("--late-start", type=int, default=300)
    p.add_argument("--fast-steps", type=int, default=600)
    p.add_argument("--fast-start", type=int, default=300)
    p.add_argument("--growth-steps", type=int, default=600)
    p.add_argument("--growth-start", type=int, default=400)
    p.add_argument("--clean-steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3, help="cost: pairs of an unwatched and a watched run")
    p.add_argument("--cost-steps", type=int, default=3000, help="cost/clean-0.5ms: steps a run")
    p.add_argument("--mb-steps", type=int, default=200, help="cost/clean-4mb: steps a run")
    p.add_argument("--mb-scenario", default="lora-checkpoint", choices=SCENARIOS, help="cost/clean-4mb: its scenario")
    p.add_argument("--storm-steps", type=int, default=2000, help="storm/*: steps a run")
    p.add_argument("--micro-steps", type=int, default=40, help="cost/clean-64mb: steps (of 64 micro-batches) a run")
    p.add_argument("--seed-micro-batches", type=int, default=256, help="micro/seed: micro-batches of its one step")
    p.add_argument("--library-steps", type=_steps, default=[200, 800], help="library-leak: two run lengths")
    p.add_argument("--only", action="append", metavar="PREFIX", help="only the cases whose name starts so")
    p.add_argument("--quick", action="store_true", help="a smoke run: one scenario, short runs, ratios not judged")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--md", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.scenario = args.scenario or ["pp-last-stage"]
        args.late_steps, args.late_start, args.fast_steps, args.fast_start = 40, 20, 40, 20
        args.growth_steps, args.growth_start, args.clean_steps, args.micro_batches = 430, 405, 60, 1
        args.rounds, args.cost_steps, args.mb_steps, args.storm_steps = 1, 200, 10, 150
        args.library_steps = [30, 60]
        args.micro_steps, args.seed_micro_batches = 3, 32
    args.scenario = args.scenario or [s for s in SCENARIOS if _unavailable(s) is None]
    with measuring(args.device) as (facts, line):
        t0 = time.perf_counter()
        entries = measure(args, lambda s: print(s, flush=True))
        settings = {
            "command": shlex.join(["python", "-m", "benchmarks.watch", *(sys.argv[1:] if argv is None else argv)]),
            "torch_threads": torch.get_num_threads(),
            "rounds": args.rounds,
            "quick": args.quick,
            "elapsed_s": round(time.perf_counter() - t0, 1),
        }
        figures = floor(torch.device(args.device), max(args.clean_steps, 500))
    doc = {"device": args.device.upper(), "machine": facts, "machine_line": line, "settings": settings}
    doc["cases"] = entries
    doc["floor"] = figures
    print(floor_text(figures))
    print(_table_text(HEADER, [row(e) for e in entries if e["kind"] not in ("cost", "library leak")]))
    print(_table_text(COST_HEADER, cost_rows(entries, figures)))
    if args.json:
        write_json(args.json, doc)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(markdown(doc, DOC.split("\n\n", 1)[1]))
    if args.plot:
        plot(doc, args.plot)
    return 0


def _table_text(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    from gradguard._policy import table

    return table.text(tuple(header), [tuple(r) for r in rows])


def _unavailable(name: str) -> str | None:
    if name == "megatron-gpt":
        from gradguard._tools.bench.megatron_gpt import unavailable

        return unavailable()
    return None


if __name__ == "__main__":
    sys.exit(main())
