"""The command line: build each heap, time the audit against the bare scan in paired rounds, write
the JSON and the Markdown."""

from __future__ import annotations

import os
import sys

if not __package__:  # `python benchmarks/audit`: import the package from the repository root instead
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import gradguard  # noqa: E402
from benchmarks.audit import heap  # noqa: E402
from gradguard._heap import holders as _holders  # noqa: E402
from gradguard._heap.census import live_graph_tensors  # noqa: E402
from gradguard._policy import table as _table
from gradguard._tools.bench.machine import measuring  # noqa: E402

__all__ = ["main"]

SIZES = (100_000, 1_000_000, 3_000_000)
CLEAN_RATIO = 3.0  # audit / bare scan, a heap without graphs
LEAK_SECONDS = 2.0  # an audit finding one list of 100 leaked records in a 10^6-object heap
LEAK_SIZE = 1_000_000


def bare_scan() -> list[torch.Tensor]:
    """The floor: every object the collector tracks, filtered to tensors, as anyone would write it."""
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def c_scan() -> list[Any]:
    """A stricter floor: the same filter run at C speed (the way the audit filters)."""
    kinds = frozenset({torch.Tensor, *torch.Tensor.__subclasses__()})
    objects = gc.get_objects()
    return list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired(candidate: Callable[[], Any], baselines: Sequence[Callable[[], Any]], rounds: int) -> dict[str, Any]:
    """``rounds`` rounds, each timing the candidate and every baseline once, in an order that rotates;
    gc disabled while timing. Per baseline: the median of the within-round ratios."""
    times: list[list[float]] = [[] for _ in range(1 + len(baselines))]
    sides = [candidate, *baselines]
    enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            order = list(range(len(sides)))
            order = order[r % len(order) :] + order[: r % len(order)]
            for i in order:
                times[i].append(_time(sides[i]))
    finally:
        if enabled:
            gc.enable()
    out: dict[str, Any] = {"rounds": rounds, "candidate_s": _stats(times[0])}
    out["baselines"] = [
        {"s": _stats(t), "ratio": statistics.median(c / b for c, b in zip(times[0], t))} for t in times[1:]
    ]
    return out


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "best": min(values), "worst": max(values)}


def audit_counting_passes() -> tuple[gradguard.RetentionReport, int]:
    """One audit, and how many heap passes (``gc.get_referrers`` calls or referent sweeps) its path search made."""
    passes = 0
    original = _holders._Search.referrers

    def counted(self: Any, frontier: list[Any], frontier_ids: set[int]) -> list[Any]:
        nonlocal passes
        passes += 1
        return original(self, frontier, frontier_ids)

    _holders._Search.referrers = counted  # type: ignore[method-assign]
    try:
        return gradguard.audit(), passes
    finally:
        _holders._Search.referrers = original  # type: ignore[method-assign]


def clean_case(size: int, rounds: int, say: Callable[[str], None]) -> dict[str, Any]:
    reached = heap.fill(size)
    report = gradguard.audit()
    if len(report) or report.untraced:
        raise RuntimeError(f"the clean heap holds graphs: {report}")
    result = paired(gradguard.audit, [bare_scan, c_scan], rounds)
    ratio = result["baselines"][0]["ratio"]
    entry = {
        "case": "clean",
        "target_objects": size,
        "live_objects": reached,
        **result,
        "ratio": ratio,
        "ratio_vs_c_scan": result["baselines"][1]["ratio"],
        "target_ratio": CLEAN_RATIO,
        "passed": ratio <= CLEAN_RATIO,
    }
    say(
        f"  clean heap, {reached:,} objects: audit {result['candidate_s']['median'] * 1e3:.1f} ms, bare scan "
        f"{result['baselines'][0]['s']['median'] * 1e3:.1f} ms, "
        f"C-speed scan {result['baselines'][1]['s']['median'] * 1e3:.1f} ms: "
        f"{ratio:.2f}× ({'ok' if entry['passed'] else 'MISSED'}), {entry['ratio_vs_c_scan']:.2f}× the C-speed scan"
    )
    return entry


def leak_case(rounds: int, say: Callable[[str], None]) -> dict[str, Any]:
    heap.FILLER.clear()
    heap.unleak()
    heap.leak(100)
    reached = heap.fill(LEAK_SIZE)
    report, passes = audit_counting_passes()
    found = {e.holder: e.tensors for e in report}
    expected = {"benchmarks.audit.heap:LEAKED[*]['loss']": 100, "benchmarks.audit.heap:LEAKED[*]['logits']": 100}
    if found != expected:
        raise RuntimeError(f"the audit did not find the leak as expected: {found}\n{report}")
    targets = len(live_graph_tensors(set()))
    result = paired(gradguard.audit, [bare_scan], rounds)
    seconds = result["candidate_s"]["median"]
    entry = {
        "case": "leak",
        "target_objects": LEAK_SIZE,
        "live_objects": reached,
        **result,
        "graph_tensors": targets,
        "entries": len(report),
        "heap_passes": passes,
        "seconds": seconds,
        "target_seconds": LEAK_SECONDS,
        "passed": seconds <= LEAK_SECONDS,
        "report": str(report),
    }
    say(
        f"  one list of 100 leaked records in {reached:,} objects: audit {seconds:.3f} s "
        f"({'ok' if entry['passed'] else 'MISSED'}; target {LEAK_SECONDS:g} s), {targets} graph tensors, "
        f"{passes} heap passes, bare scan {result['baselines'][0]['s']['median'] * 1e3:.1f} ms"
    )
    heap.unleak()
    return entry


def boundary_case(rounds: int, say: Callable[[str], None]) -> dict[str, Any]:
    """What an audit costs at a clean step boundary: the step's own loss, backward done, still a local."""
    heap.FILLER.clear()
    reached = heap.fill(LEAK_SIZE)
    model = heap.leak(1)
    heap.unleak()
    loss = model(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    report, passes = audit_counting_passes()
    if [e.holder for e in report] != ["benchmarks/audit/__main__.py in boundary_case: loss"]:
        raise RuntimeError(f"expected the step's loss only:\n{report}")
    result = paired(gradguard.audit, [bare_scan], rounds)
    entry = {
        "case": "boundary",
        "target_objects": LEAK_SIZE,
        "live_objects": reached,
        **result,
        "graph_tensors": 1,
        "heap_passes": passes,
        "seconds": result["candidate_s"]["median"],
        "passed": None,
    }
    say(
        f"  a clean step boundary (the step's loss a local) in {reached:,} objects: audit "
        f"{entry['seconds'] * 1e3:.1f} ms, bare scan {result['baselines'][0]['s']['median'] * 1e3:.1f} ms "
        f"({result['baselines'][0]['ratio']:.2f}×)"
    )
    del loss
    return entry


def text(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["case", "live objects", "audit", "bare scan", "ratio", "target", "", "vs C-speed scan", "heap passes"]
    rows = []
    for e in doc["cases"]:
        base = e["baselines"][0]["s"]["median"]
        if e["case"] == "clean":
            rows.append(
                [
                    "no graph held",
                    f"{e['live_objects']:,}",
                    f"{e['candidate_s']['median'] * 1e3:.1f} ms",
                    f"{base * 1e3:.1f} ms",
                    f"{e['ratio']:.2f}×",
                    f"≤ {e['target_ratio']:g}×",
                    "✓" if e["passed"] else "✗",
                    f"{e['ratio_vs_c_scan']:.2f}×",
                    "0",
                ]
            )
        elif e["case"] == "boundary":
            rows.append(
                [
                    "a step boundary: the step's loss a local",
                    f"{e['live_objects']:,}",
                    f"{e['seconds'] * 1e3:.1f} ms",
                    f"{base * 1e3:.1f} ms",
                    f"{e['baselines'][0]['ratio']:.2f}×",
                    "(info)",
                    "",
                    "",
                    str(e["heap_passes"]),
                ]
            )
        else:
            rows.append(
                [
                    f"1 list of 100 leaked records ({e['graph_tensors']} graph tensors)",
                    f"{e['live_objects']:,}",
                    f"{e['seconds']:.3f} s",
                    f"{base * 1e3:.1f} ms",
                    f"{e['candidate_s']['median'] / base:.2f}×",
                    f"≤ {e['target_seconds']:g} s",
                    "✓" if e["passed"] else "✗",
                    "",
                    str(e["heap_passes"]),
                ]
            )
    return header, rows


METHOD = (
    "Each round times `gradguard.audit()` and the baselines once each, in a rotating order, with the cycle "
    "collector disabled while timing; {rounds} rounds per case, medians shown. *bare scan*: "
    "`[o for o in gc.get_objects() if isinstance(o, torch.Tensor)]`; *ratio*: the median of the within-round "
    "ratios audit / bare scan. *C-speed scan*: the same filter run with `itertools.compress` over exact types, "
    "the way the audit filters (a stricter floor). Live objects: `len(gc.get_objects())` once the heap is built "
    "(instances with a dict attribute, dicts, lists, in lists of 1000). Heap passes: the number of "
    "`gc.get_referrers` / referent sweeps the path search made for that audit."
)


def markdown(doc: dict[str, Any]) -> str:
    header, rows = text(doc)
    leak = next((e for e in doc["cases"] if e["case"] == "leak"), None)
    parts = [
        "# gradguard.audit() cost — CPU",
        "",
        f"Machine: {doc['machine_line']}",
        "",
        f"`{doc['settings']['command']}` ({doc['settings']['elapsed_s']:g} s)",
        "",
        METHOD.format(rounds=doc["settings"]["rounds"]),
        "",
        _table.markdown(header, rows),
        "",
    ]
    if leak is not None:
        parts += ["The leak case's report:", "", "```", leak["report"], "```", ""]
    if doc.get("notes"):
        parts += ["## Notes", "", *(f"- {n}" for n in doc["notes"]), ""]
    return "\n".join(parts)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.audit", description="what gradguard.audit() costs")
    p.add_argument("--rounds", type=int, default=7, help="paired rounds per case (default 7)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="clean heap sizes (default 1e5 1e6 3e6)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds, heaps of 1e5 and 3e5")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--md", metavar="PATH", help="write the results as Markdown")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.rounds, args.sizes = 2, [100_000, 300_000]
    global LEAK_SIZE
    if args.quick:
        LEAK_SIZE = 300_000
    warnings.simplefilter("ignore", FutureWarning)  # isinstance() on every object wakes deprecated module attributes
    with measuring("cpu") as (facts, line):
        t0 = time.perf_counter()
        cases = []
        for size in sorted(args.sizes):
            cases.append(clean_case(size, args.rounds, lambda s: print(s, flush=True)))
        cases.append(leak_case(args.rounds, lambda s: print(s, flush=True)))
        cases.append(boundary_case(args.rounds, lambda s: print(s, flush=True)))
        heap.FILLER.clear()
    notes = [
        f"The {c['target_objects']:,}-object heap cannot be had: a process with torch and gradguard imported already "
        f"tracks {c['live_objects']:,} objects, so that row is measured on that heap."
        for c in cases
        if c["case"] == "clean" and c["live_objects"] > 1.05 * c["target_objects"]
    ]
    argv_shown = sys.argv[1:] if argv is None else list(argv)
    doc = {
        "schema": 1,
        "machine": facts,
        "machine_line": line,
        "settings": {
            "command": shlex.join(["python", "-m", "benchmarks.audit", *argv_shown]),
            "rounds": args.rounds,
            "sizes": sorted(args.sizes),
            "elapsed_s": round(time.perf_counter() - t0, 1),
            "load_avg_1min_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        },
        "cases": cases,
        "targets_met": all(c["passed"] for c in cases if c["passed"] is not None),
        "notes": notes,
    }
    header, rows = text(doc)
    print()
    print(_table.text(header, rows))
    for path, content in ((args.json, json.dumps(doc, indent=1) + "\n"), (args.md, markdown(doc))):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(content)
            print(f"wrote {path}")
    for note in notes:
        print(f"note: {note}")
    return 1 if args.strict and not doc["targets_met"] else 0


if __name__ == "__main__":
    sys.exit(main())
