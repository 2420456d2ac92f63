"""The command line: select, build each selected group, time its cases, write the JSON and Markdown."""

from __future__ import annotations

import os
import sys

if not __package__:  # `python benchmarks/overhead`: import the package from the repository root instead
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.overhead import cases, report, timing  # noqa: E402
from gradguard._tools.bench.machine import measuring  # noqa: E402

__all__ = ["main", "run"]


def run(
    selection: Sequence[tuple[cases.Group, frozenset[str]]],
    rounds: int,
    batch_ms: float,
    micro_batches: int,
    say: Callable[[str], None] = print,
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Build each selected group in turn, time its cases inside its setup, tear it down.

    Returns the JSON entries and ``(group, reason)`` for each group that could not be built here.
    """
    entries: list[dict[str, Any]] = []
    skipped: list[tuple[str, str]] = []
    for group, names in selection:
        try:
            with group.setup(names) as built:
                for case in built:
                    if case.check is not None:
                        case.check()
                    paired = timing.measure(
                        [(case.candidate, case.arg), (case.baseline, case.arg)], rounds, batch_ms, case.reset
                    )
                    step = None
                    if case.share is not None:
                        step = case.share.step(micro_batches)
                        if step.publishes_per_microbatch != case.share.calls_per_microbatch:
                            raise RuntimeError(
                                f"{case.name}: the scenario published {step.publishes_per_microbatch:g} records per "
                                f"micro-batch, the case assumes {case.share.calls_per_microbatch}"
                            )
                    e = report.entry(case, paired, step)
                    entries.append(e)
                    verdict = {True: "ok", False: "MISSED", None: e["decision"] or ""}[e["passed"]]
                    say(
                        f"  {case.name}: {e['candidate_us']['median']:.3f} vs {e['baseline_us']['median']:.3f} µs, "
                        f"paired {e['paired']['ratio']:.3f}× ({e['paired']['delta_us']:+.2f} µs) {verdict}"
                    )
        except cases.Unavailable as exc:
            skipped.append((group.title, str(exc)))
            say(f"  skipped {group.title}: {exc}")
    return entries, skipped


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead", description="gradguard's per-call overhead, paired, in one run"
    )
    p.add_argument("--rounds", type=int, default=201, help="interleaved rounds per case (default 201)")
    p.add_argument("--batch-ms", type=float, default=5.0, help="milliseconds per timed batch (default 5)")
    p.add_argument(
        "--micro-batches", type=int, default=32, help="guarded micro-batch steps timed per share scenario (default 32)"
    )
    p.add_argument("--quick", action="store_true", help="a smoke run: 5 rounds, 1 ms batches, 4 micro-batches")
    p.add_argument(
        "--only",
        action="append",
        metavar="TEXT",
        help="only cases whose name or group contains TEXT (case-insensitive; repeatable); nothing else is built",
    )
    p.add_argument("--list", action="store_true", help="print the groups and case names and exit")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--md", metavar="PATH", help="write the results as Markdown")
    p.add_argument("--strict", action="store_true", help="exit 1 when a budget is missed")
    p.add_argument(
        "--from-json", metavar="PATH", help="measure nothing: render the tables of a run's JSON (with --md: rewrite it)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.batch_ms, args.micro_batches = 5, 1.0, 4
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.batch_ms <= 0:
        p.error("--batch-ms must be > 0")
    if args.micro_batches < 1:
        p.error("--micro-batches must be >= 1")
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            doc = json.load(f)
        _write(doc, None, args.md)
        return 0
    selection = cases.select(args.only)
    if args.list:
        for group, names in selection:
            print(group.title)
            for name in (n for n in group.names if n in names):
                print(f"  {name}")
        return 0
    if not selection:
        p.error(f"--only {args.only} matches no case; see --list")

    with measuring("cpu") as (facts, line):
        t0 = time.perf_counter()
        entries, skipped = run(
            selection, args.rounds, args.batch_ms, args.micro_batches, lambda s: print(s, flush=True)
        )
        settings = {
            "command": shlex.join(["python", "-m", "benchmarks.overhead", *(sys.argv[1:] if argv is None else argv)]),
            "rounds": args.rounds,
            "batch_ms": args.batch_ms,
            "micro_batches": args.micro_batches,
            "only": args.only,
            "torch_threads": torch.get_num_threads(),
            "elapsed_s": round(time.perf_counter() - t0, 1),
            "load_avg_1min_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        }
    doc = report.document(entries, skipped, settings, facts, line)
    print()
    _write(doc, args.json, args.md)
    return 1 if args.strict and not doc["budgets_met"] else 0


def _write(doc: dict[str, Any], json_path: str | None, md_path: str | None) -> None:
    print(report.text(doc))
    for path, content in ((json_path, json.dumps(doc, indent=1) + "\n"), (md_path, report.markdown(doc))):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(content)
            print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
