"""Merge the device run's bench reports into one JSON, one Markdown table and one PNG.

``python benchmarks/device/summarize.py --out DIR --label cuda --steps STEPS.tsv NAME=REPORT.json ...``
writes ``DIR/bench-LABEL.json`` (every report under ``runs``, the steps with their exit status and
time), ``DIR/bench-LABEL.md`` (the steps, one row per scenario and run, the verdicts, the seed
preset's CUDA targets) and ``DIR/bench-LABEL.png`` (allocated bytes per micro-batch, every scenario
of every run). A report that is missing (its step failed or was skipped) is listed as such: the
summary says what ran and what did not. Exit status 0, or 1 when no report could be read.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from gradguard._tools.bench.report import NO_ADAPTER_HEADER, late_table, no_adapter_rows, verdicts

MiB = 2**20


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def read_steps(path: Path | None) -> list[dict[str, Any]]:
    """``name<TAB>rc<TAB>seconds<TAB>command`` lines (run.sh's record of each step)."""
    if path is None or not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        name, rc, seconds, command = (line.split("\t", 3) + ["", "", ""])[:4]
        steps.append({"name": name, "rc": rc, "seconds": float(seconds or 0), "command": command})
    return steps


def seed_targets(report: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The ``seed-pp4`` preset's CUDA targets, per scenario: ``(target, met, figure)``."""
    out = []
    for name, r in report["scenarios"].items():
        if r.get("kind") == "no-adapter":
            u = r["unwatched"]["growth_bytes_per_microbatch"]
            d = r["detach"]["growth_after_report_bytes_per_microbatch"]
            ratio = d / u if d is not None and u > 0 else float("inf")
            out.append(
                (f"{name}: detach slope after the report ≤ 1% of the unwatched slope", ratio <= 0.01, f"{ratio:.4%}")
            )
            continue
        u, g = r["unguarded"], r["guarded"]
        slope_u, slope_g = u["growth_bytes_per_microbatch"], g["growth_bytes_per_microbatch"]
        ratio = slope_g / slope_u if slope_u > 0 else float("inf")
        out.append((f"{name}: guarded slope ≤ 1% of the unguarded slope", ratio <= 0.01, f"{ratio:.4%}"))
        alloc = g["allocated_bytes"]
        drift = alloc[-1] - alloc[0] if alloc else 0
        records = r["record_bytes_per_microbatch"] * max(len(alloc) - 1, 0)
        flat = drift <= records + 0.01 * r["expected_pinned_bytes_per_microbatch"]
        out.append(
            (
                f"{name}: guarded memory independent of the micro-batch count",
                flat,
                f"last − first reading {drift / MiB:.2f} MiB over {len(alloc)} micro-batches "
                f"(the records themselves: {records / MiB:.2f} MiB); peak {g['peak_bytes'] / MiB:.0f} MiB "
                f"vs unguarded {u['peak_bytes'] / MiB:.0f} MiB",
            )
        )
        t = g["step_time_median_s"] / u["step_time_median_s"] if u["step_time_median_s"] else float("inf")
        out.append((f"{name}: step time guarded/unguarded ≤ 1.01", t <= 1.01, f"{t:.3f}"))
    return out


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"# gradguard bench — {summary['label']} (benchmarks/device/run.sh)",
        "",
        f"{summary['generated']}; gradguard {summary['versions']['gradguard']}, megatron-core "
        f"{summary['versions']['megatron-core']}.",
        "",
        f"machine: {summary['machine']}",
        "",
        "| step | exit | seconds | command |",
        "|---|---|---|---|",
    ]
    for s in summary["steps"]:
        command = s["command"]
        if " -m " in command:  # drop the environment and interpreter run.sh puts in front (the JSON has them)
            command = "python -m " + command.split(" -m ", 1)[1]
        lines.append(f"| {s['name']} | {s['rc']} | {s['seconds']:.1f} | `{command}` |")
    lines += [
        "",
        "| run | scenario | run | micro-batches | growth / micro-batch | record / micro-batch | analytic pin "
        "| peak | step (median) | grads |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run_name, report in summary["runs"].items():
        if report is None:
            lines.append(f"| {run_name} | (no report: the step failed or did not run) | | | | | | | | |")
            continue
        for name, r in report.get("scenarios", {}).items():
            if r.get("kind") == "no-adapter":
                continue  # its own table, below
            for run in ("unguarded", "guarded"):
                x = r[run]
                done = len(x["allocated_bytes"])
                count = f"{done}" + (
                    f" (stopped at the memory cap, of {x['micro_batches']})" if done < x["micro_batches"] else ""
                )
                grads = (
                    ""
                    if run == "unguarded"
                    else {True: "bitwise equal", False: "DIFFER", None: "not compared"}[r["grads_equal"]]
                )
                lines.append(
                    f"| {run_name} | {name} | {run} | {count} | {x['growth_bytes_per_microbatch']:,.0f} B "
                    f"| {r['record_bytes_per_microbatch']:,} B | {r['expected_pinned_bytes_per_microbatch']:,} B "
                    f"| {x['peak_bytes'] / MiB:,.1f} MiB | {x['step_time_median_s'] * 1e3:.2f} ms | {grads} |"
                )
    for run_name, report in summary["runs"].items():
        for name, r in (report or {}).get("scenarios", {}).items():
            if r.get("kind") != "no-adapter":
                continue
            lines += [
                "",
                f"{run_name} / {name}: {r['engine']}'s engine with no adapter, only the watch; "
                f"{r['unwatched']['micro_batches']} micro-batches, record {r['record_bytes_per_microbatch']:,} B, "
                f"analytic pin {r['expected_pinned_bytes_per_microbatch']:,} B per micro-batch:",
                "",
                "| " + " | ".join(NO_ADAPTER_HEADER) + " |",
                "|" + "---|" * len(NO_ADAPTER_HEADER),
                *("| " + " | ".join(row) + " |" for row in no_adapter_rows(r)),
            ]
    lines += ["", "Verdicts:", ""]
    for run_name, report in summary["runs"].items():
        if report is None:
            continue
        for name, r in report.get("scenarios", {}).items():
            for check, ok, detail in verdicts(r):
                mark = "" if check.startswith("step") else (" ✓" if ok else " ✗")
                lines.append(f"- {run_name} / {name}: {check}: {detail}{mark}")
        if run_name in ("seed-pp4", "no-adapter"):
            for check, ok, detail in seed_targets(report):
                lines.append(f"- {run_name} / {check}: {detail} {'✓' if ok else '✗'}")
    for run_name, report in summary["runs"].items():
        if report is not None and "late_leak" in report:
            lines += ["", f"A leak that starts late ({run_name}):", "", "```", late_table(report), "```"]
            lines += ["", f"![memory after each step, a leak starting late](late-leak-{summary['label']}.png)"]
    lines += ["", f"![allocated bytes after each micro-batch](bench-{summary['label']}.png)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the output folder")
    parser.add_argument("--label", required=True, help="cuda or cpu: names the files bench-LABEL.*")
    parser.add_argument("--steps", type=Path, help="run.sh's steps file")
    parser.add_argument("reports", nargs="*", metavar="NAME=REPORT.json")
    args = parser.parse_args(argv)
    runs: dict[str, Any] = {}
    for item in args.reports:
        name, sep, path = item.partition("=")
        if not sep or not name:
            parser.error(f"{item!r}: expected NAME=REPORT.json")
        try:
            runs[name] = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"summarize: {name}: no report ({exc})", file=sys.stderr)
            runs[name] = None
    read = [r for r in runs.values() if r is not None]
    summary = {
        "label": args.label,
        "generated": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": read[0]["machine"] if read else "(no report)",
        "device": read[0]["device"] if read else None,
        "torch": read[0]["torch"] if read else None,
        "versions": {d: _version(d) for d in ("gradguard", "megatron-core")},
        "steps": read_steps(args.steps),
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"bench-{args.label}"
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(summary))
    if read:
        from gradguard._tools.bench.report import late_plot, plot

        growth = {f"{n} / {s}": r for n, rep in runs.items() if rep for s, r in rep.get("scenarios", {}).items()}
        if growth:
            plot(
                {"device": summary["device"], "torch": summary["torch"], "scenarios": growth},
                str(stem.with_suffix(".png")),
            )
        for rep in runs.values():
            if rep is not None and "late_leak" in rep:
                late_plot(rep, str(args.out / f"late-leak-{args.label}.png"))
    print(f"summarize: wrote {stem}.json, {stem}.md" + (f", {stem}.png" if read else " (no plot: no report)"))
    return 0 if read else 1


if __name__ == "__main__":
    raise SystemExit(main())
