"""The memory trigger's evidence: the per-boundary memory figure of clean and leaking training runs.

``python -m benchmarks.trigger [--steps N] [--json PATH] [--md PATH] [--noise PATH] [--series PATH]``
(from the repository root; ``--from-series PATH`` summarizes a ``--series`` file again without running).
For each of ``gradguard bench``'s scenarios (CPU, default size, torch on one thread) a *training
step* is ``--micro-batches`` micro-batches of the scenario's guarded step (inside
``gradguard.enforce(mode="detach")``, the records kept in the step's store, emptied when the step
ends, as the engines do) and one ``optimizer.step()``: a step boundary. At each boundary, from
torch's optimizer step post hook (where the watch runs), both CPU figures are read and each reading
is timed: glibc's in-use bytes (``mallinfo2``) and the resident set (``/proc/self/statm``).

Each scenario runs twice, each run in a fresh process: clean for ``--steps`` steps, and the same from
step ``--leak-start`` on leaking ``--leak-bytes`` per step (:class:`gradguard._tools.bench.late_leak.LateLeak`:
the trainer keeps each step's backwarded loss, whose dead graph pins a fresh leaf and its gradient).

The figures are replayed through the trigger (:mod:`gradguard._watch.trigger`: its default settings for
glibc's figure, ``floor=RESIDENT_FLOOR`` for the resident set) with a model of the watch around it: the
start-up check audits the first boundary, every request is audited (the watch holds those to a share
of the wall time), an audit stamps what it sees, so the leak is found two boundaries after the audit
that first saw it, and in ``warn`` mode the same leak found again is not new. Reported per scenario:
the audits the trigger asks for on the clean run, the boundary it asks for the first on the leaking run
and where the leak is reported, the audits it asks for over the rest of the leaking run (back-off),
the noise of each figure, and the cost of a reading.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # `python benchmarks/trigger.py`: import from the repository root instead
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

from gradguard._tools.bench.late_leak import LateLeak  # noqa: E402
from gradguard._tools.bench.machine import measuring  # noqa: E402
from gradguard._tools.bench.report import write_json  # noqa: E402
from gradguard._watch.allocated import AllocatedReader, mallinfo2_reader, statm_reader  # noqa: E402
from gradguard._watch.allocated import mallinfo2 as whole_mallinfo2  # noqa: E402
from gradguard._watch.trigger import RESIDENT_FLOOR, Trigger, TriggerSettings  # noqa: E402

__all__ = ["main", "record"]

SCENARIOS = ("pp-last-stage", "lora-checkpoint", "megatron-gpt")


def _unavailable(name: str) -> str | None:
    if name == "megatron-gpt":
        from gradguard._tools.bench.megatron_gpt import unavailable

        return unavailable()
    return None


def record(name: str, steps: int, micro_batches: int, leak_start: int | None, leak_bytes: int) -> dict[str, Any]:
    """One run of scenario ``name``: the figures and reading costs at each of its ``steps`` boundaries."""
    trainer = LateLeak(name, "cpu", start=leak_start, bytes_per_step=leak_bytes, micro_batches=micro_batches)
    mallinfo2, statm = mallinfo2_reader(), statm_reader()
    reader = AllocatedReader()
    assert mallinfo2 is not None and statm is not None, "this study needs glibc's mallinfo2 and /proc/self/statm"
    keys = ("mallinfo2", "statm", "mallinfo2_ns", "statm_ns", "reader_ns", "free_chunks")
    series: dict[str, list[int]] = {k: [] for k in keys}
    clock = time.perf_counter_ns
    order = [("mallinfo2", mallinfo2), ("statm", statm)]

    def at_boundary(optimizer: Any, args: Any, kwargs: Any) -> None:
        # The first reading after a step finds the caches cold: the two figures take turns at being first.
        order.reverse()
        for key, read in [*order, ("reader", reader)]:
            t0 = clock()
            value = read()
            series[f"{key}_ns"].append(clock() - t0)
            if key != "reader":
                series[key].append(value)  # type: ignore[arg-type]
        info = whole_mallinfo2()
        series["free_chunks"].append(0 if info is None else int(info.ordblks + info.smblks))

    handle = register_optimizer_step_post_hook(at_boundary)
    start = time.perf_counter()
    try:
        with trainer.scope():
            for _ in range(steps):
                trainer.step()
    finally:
        handle.remove()
    elapsed = time.perf_counter() - start
    return {"series": series, "elapsed_s": elapsed, "step_ms": 1e3 * elapsed / steps, "reader": reader.describe()}


# --------------------------------------------------------------------------------------------------
# Replaying the trigger
# --------------------------------------------------------------------------------------------------


def replay(
    figures: Sequence[int], leak_start: int | None = None, settings: TriggerSettings | None = None
) -> dict[str, Any]:
    """The trigger's requests over one series of CPU figures (boundary ``b`` is ``figures[b - 1]``), with
    the model of the watch of the module documentation."""
    trigger = Trigger(settings or TriggerSettings())
    requested: list[int] = []
    audited: list[int] = []
    reported: int | None = None
    seen_at: int | None = None  # the first audit that saw the leak's graph alive (and stamped it)
    for b, figure in enumerate(figures, start=1):
        request = trigger.observe({"cpu": figure})
        if request is not None:
            requested.append(b)
        if not (b == 1 or request is not None or (seen_at is not None and b == seen_at + 2)):
            continue
        new = False
        if leak_start is not None and b >= leak_start:
            if seen_at is None:
                seen_at = b
            elif reported is None and b >= seen_at + 2:
                reported, new = b, True
        audited.append(b)
        trigger.audited(new)
    return {
        "requested": requested,
        "audits": audited,
        "reported": reported,
        "first_request": next((b for b in requested if leak_start is None or b >= leak_start), None),
    }


def _noise(figures: list[int], skip: int = 2) -> dict[str, Any]:
    """How far a clean run's figure rises above its own running minimum of the last 64 boundaries, and the
    largest step between two boundaries, after the first ``skip`` boundaries."""
    tail = figures[skip:]
    over = []
    for i, v in enumerate(tail):
        over.append(v - min(tail[max(0, i - 63) : i + 1]))
    steps = [b - a for a, b in zip(tail, tail[1:])]
    return {
        "first": figures[0],
        "last": figures[-1],
        "drift_after_first_two": figures[-1] - figures[skip],
        "over_low_water_max": max(over),
        "over_low_water_p99": sorted(over)[int(0.99 * (len(over) - 1))],
        "largest_rise": max(steps),
        "largest_fall": min(steps),
    }


def _cost(ns: list[int]) -> dict[str, float]:
    s = sorted(ns)
    return {"median_us": s[len(s) // 2] / 1e3, "p99_us": s[int(0.99 * (len(s) - 1))] / 1e3, "max_us": s[-1] / 1e3}


def summarize(name: str, clean: dict[str, Any], leaky: dict[str, Any], leak_start: int) -> dict[str, Any]:
    """The compact figures of one scenario."""
    out: dict[str, Any] = {"scenario": name, "step_ms": clean["step_ms"], "reader": clean["reader"]}
    for figure, settings in (("mallinfo2", TriggerSettings()), ("statm", TriggerSettings(floor=RESIDENT_FLOOR))):
        c, leak = clean["series"][figure], leaky["series"][figure]
        leaking = replay(leak, leak_start, settings)
        requests = replay(c, settings=settings)["requested"]
        out[figure] = {
            "floor": settings.floor,
            "noise": _noise(c),
            "clean_requests": requests,
            "clean_requests_per_1000_steps": 1000 * len(requests) / len(c),
            "leak_growth_per_step": statistics.median(b - a for a, b in zip(leak[leak_start:], leak[leak_start + 1 :])),
            "leak_first_request": leaking["first_request"],
            "leak_reported": leaking["reported"],
            "leak_requests": len(leaking["requested"]),
            "leak_request_boundaries": leaking["requested"],
        }
    out["cost"] = {"clean": _costs(clean["series"]), "leaking_last_100": _costs(leaky["series"], last=100)}
    return out


def _costs(series: dict[str, list[int]], last: int | None = None) -> dict[str, Any]:
    """Reading costs: each CPU figure read first after the step (cold caches) and right after the other one,
    and the whole reader read third; with the free chunks glibc's ``mallinfo2`` walks."""
    n = len(series["mallinfo2_ns"])
    first = 2 if last is None else max(2, n - last)  # the first two boundaries: lazy initialisation
    statm_first = [i for i in range(first, n) if i % 2 == 0]  # at_boundary alternates the order
    mallinfo2_first = [i for i in range(first, n) if i % 2 == 1]
    chunks = series["free_chunks"][first:]
    return {
        "mallinfo2_first": _cost([series["mallinfo2_ns"][i] for i in mallinfo2_first]),
        "mallinfo2_second": _cost([series["mallinfo2_ns"][i] for i in statm_first]),
        "statm_first": _cost([series["statm_ns"][i] for i in statm_first]),
        "statm_second": _cost([series["statm_ns"][i] for i in mallinfo2_first]),
        "reader_third": _cost(series["reader_ns"][first:]),
        "free_chunks_median": statistics.median(chunks),
        "mallinfo2_first_ns_per_free_chunk": statistics.median(
            series["mallinfo2_ns"][i] / max(1, series["free_chunks"][i]) for i in mallinfo2_first
        ),
    }


def markdown(doc: dict[str, Any]) -> str:
    """The summary as a Markdown page: the machine line, the method, one table per figure."""
    leak = doc["settings"]["leak_start"]
    steps = doc["settings"]["steps"]
    lines = [
        "# gradguard memory trigger — CPU",
        "",
        f"Machine: {doc['machine_line']}",
        "",
        f"`{doc['settings']['command']}` ({doc['settings']['elapsed_s']} s)",
        "",
        _METHOD,
        "",
    ]
    for figure, title in (("mallinfo2", "glibc's in-use bytes (mallinfo2)"), ("statm", "resident set (statm)")):
        floor = doc["scenarios"][0][figure]["floor"] if doc["scenarios"] else 0
        lines += [
            f"## {title}, floor {floor // 1024:,} KiB",
            "",
            f"| scenario | step | clean: most above the low-water mark | clean: requests in {steps} steps | leak: "
            f"growth per step | leak from step {leak}: first request | reported | "
            "leak: requests in all |",
            "|" + " --- |" * 8,
        ]
        for e in doc["scenarios"]:
            m = e[figure]
            lines.append(
                f"| {e['scenario']} | {e['step_ms']:.1f} ms | {m['noise']['over_low_water_max'] / 1024:,.1f} KiB "
                f"| {len(m['clean_requests'])} | {m['leak_growth_per_step'] / 1024:,.1f} KiB | "
                f"{m['leak_first_request']} | {m['leak_reported']} | "
                f"{m['leak_requests']} |"
            )
        lines.append("")
    lines += [
        "## What a reading costs (median, µs)",
        "",
        "| scenario | run | mallinfo2, first after the step | mallinfo2, second | statm, first | statm, second "
        "| free chunks (mallinfo2 walks them) |",
        "|" + " --- |" * 7,
    ]
    for e in doc["scenarios"]:
        for run, label in (("clean", "clean"), ("leaking_last_100", "leaking, last 100 steps")):
            c = e["cost"][run]
            lines.append(
                f"| {e['scenario']} | {label} | {c['mallinfo2_first']['median_us']:,.1f} | "
                f"{c['mallinfo2_second']['median_us']:,.1f} | {c['statm_first']['median_us']:,.1f} | "
                f"{c['statm_second']['median_us']:,.1f} | {c['free_chunks_median']:,.0f} |"
            )
    skipped = "".join(f"\n\nSkipped {name}: {why}" for name, why in doc["skipped"])
    return "\n".join(lines) + skipped + "\n"


_METHOD = (
    "A training step: the scenario's guarded micro-batch step (`gradguard bench`, CPU, default size, torch on one "
    "thread), then `optimizer.step()`; both CPU figures are read from torch's optimizer step post hook, where the "
    "watch runs, each run in a fresh process. The leaking run keeps, from its start step, each step's backwarded "
    "loss whose dead graph pins a fresh leaf and its gradient. *Requests*: the trigger's default rule replayed over "
    "the figures with a model of the watch (the backstop audits boundaries 1 and 2 only; a leak is found once an "
    "earlier audit saw its graph alive, or, held by a variable, once it survived two boundaries; found again it is "
    "not new, as in warn mode). *Most above the low-water mark*: over the last 64 boundaries, after the first two. "
    "Costs are of one reading timed inside the hook; the two figures take turns at being read first after the step. "
    "Timings come from a machine shared with other work: indicative."
)


def _child(spec: str) -> int:
    """``--child NAME,STEPS,MICRO_BATCHES,LEAK_START,LEAK_BYTES,PATH``: one run, its figures written to PATH."""
    name, steps, micro_batches, leak_start, leak_bytes, path = spec.split(",", 5)
    torch.set_num_threads(1)
    start = None if leak_start == "none" else int(leak_start)
    result = record(name, int(steps), int(micro_batches), start, int(leak_bytes))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


def _run(name: str, args: argparse.Namespace, leak_start: int | None) -> dict[str, Any]:
    """One run in a fresh process: the resident set and the heap start from the same state each time."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        spec = f"{name},{args.steps},{args.micro_batches},{leak_start or 'none'},{args.leak_bytes},{path}"
        subprocess.run([sys.executable, "-m", "benchmarks.trigger", "--child", spec], cwd=root, check=True)
        with open(path, encoding="utf-8") as f:
            result: dict[str, Any] = json.load(f)
    return result


def _noise_file(runs: dict[str, Any]) -> dict[str, Any]:
    """The clean runs' figures, compact: per scenario the first figure and then the change at each boundary
    (glibc's in-use bytes; the resident set in pages of 4096 bytes)."""
    out: dict[str, Any] = {"machine_line": runs["machine_line"], "settings": runs["settings"], "scenarios": {}}
    for name, r in runs["runs"].items():
        entry = {}
        for figure, unit in (("mallinfo2", 1), ("statm", 4096)):
            values = [v // unit for v in r["clean"]["series"][figure]]
            deltas = [b - a for a, b in zip(values, values[1:])]
            entry[figure] = {"unit_bytes": unit, "first": values[0], "deltas": deltas}
        out["scenarios"][name] = entry
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.trigger", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", action="append", choices=SCENARIOS, help="default: all that run here")
    p.add_argument("--steps", type=int, default=2000, help="boundaries per run (default 2000)")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per training step (default 1)")
    p.add_argument("--leak-start", type=int, default=500, help="the leaking run's first leaking step (default 500)")
    p.add_argument("--leak-bytes", type=int, default=256 * 1024, help="bytes the leak pins per step (256 KiB)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 24 steps, the leak from step 12")
    p.add_argument("--json", metavar="PATH", help="the summary")
    p.add_argument("--md", metavar="PATH", help="the summary as Markdown")
    p.add_argument("--series", metavar="PATH", help="every figure and cost of every run (large)")
    p.add_argument("--noise", metavar="PATH", help="the clean runs' figures, compact (the tests' recorded noise)")
    p.add_argument("--from-series", metavar="PATH", help="summarize a --series file again instead of running")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child)
    if args.quick:
        args.steps, args.leak_start = 24, 12
    if args.from_series:
        with open(args.from_series, encoding="utf-8") as f:
            runs = json.load(f)
    else:
        runs = _measure(args)
    entries = [
        summarize(name, r["clean"], r["leaky"], runs["settings"]["leak_start"]) for name, r in runs["runs"].items()
    ]
    for entry in entries:
        m = entry["mallinfo2"]
        print(
            f"  {entry['scenario']}: step {entry['step_ms']:.1f} ms; clean: {len(m['clean_requests'])} requests; "
            f"leak from {runs['settings']['leak_start']}: first request {m['leak_first_request']}, reported "
            f"{m['leak_reported']}, {m['leak_requests']} "
            f"requests in all; a reading {entry['cost']['clean']['mallinfo2_first']['median_us']:.1f} µs "
            "first after a step",
            flush=True,
        )
    doc = {
        "machine": runs["machine"],
        "machine_line": runs["machine_line"],
        "settings": runs["settings"],
        "trigger_settings": dataclasses.asdict(TriggerSettings()),
        "scenarios": entries,
        "skipped": runs["skipped"],
    }
    if args.json:
        write_json(args.json, doc)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(markdown(doc))
    if args.noise:
        with open(args.noise, "w", encoding="utf-8") as f:
            json.dump(_noise_file(runs), f, separators=(",", ":"))
            f.write("\n")
    if args.series and not args.from_series:
        with open(args.series, "w", encoding="utf-8") as f:
            json.dump(runs, f)
    return 0


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every run the arguments ask for, with the machine's facts."""
    with measuring("cpu") as (facts, line):
        t0 = time.perf_counter()
        skipped, runs = [], {}
        for name in args.scenario or SCENARIOS:
            reason = _unavailable(name)
            if reason:
                skipped.append((name, reason))
                print(f"  skipped {name}: {reason}", flush=True)
                continue
            runs[name] = {"clean": _run(name, args, None), "leaky": _run(name, args, args.leak_start)}
            print(f"  {name}: measured", flush=True)
        settings = {
            "command": shlex.join(["python", "-m", "benchmarks.trigger", *sys.argv[1:]]),
            "steps": args.steps,
            "micro_batches": args.micro_batches,
            "leak_start": args.leak_start,
            "leak_bytes": args.leak_bytes,
            "elapsed_s": round(time.perf_counter() - t0, 1),
        }
    return {"machine": facts, "machine_line": line, "settings": settings, "runs": runs, "skipped": skipped}


if __name__ == "__main__":
    sys.exit(main())
