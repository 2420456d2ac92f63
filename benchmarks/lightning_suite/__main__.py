"""Run Lightning's loops/optimization/LightningOptimizer tests (the CPU subset) plain and under
gradguard's pytest options; write the wall times, the ratios to plain and the retentions reported.

``python -m benchmarks.lightning_suite LIGHTNING_CHECKOUT`` (from this repository's root; see
``benchmarks/lightning_suite/README.md`` for how to obtain the checkout). Each configuration is one
``python -m pytest`` process in the checkout's ``tests/`` directory, with Lightning's own
configuration (its ``pyproject.toml``), the subset's paths, the deselections below, and the
configuration's options; the installed ``lightning`` is the one tested. The recorder plugin
(``recorder.py``) records every test's outcome and every gradguard warning with its test id.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # `python benchmarks/lightning_suite`: import from the repository root instead
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import collections  # noqa: E402
import datetime  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.field.runner import portable  # noqa: E402
from benchmarks.lightning_suite import recorder  # noqa: E402
from gradguard._tools.bench.machine import machine, machine_line  # noqa: E402

__all__ = ["DESELECTED", "RUNS", "SUBSET", "main"]

ROOT = Path(__file__).resolve().parents[2]

#: The subset, relative to the checkout's ``tests/`` directory (where pytest runs).
SUBSET = (
    "tests_pytorch/loops",
    "tests_pytorch/trainer/optimization",
    "tests_pytorch/core/test_lightning_optimizer.py",
)

_GPU = "needs a CUDA GPU (Lightning's RunIf(min_cuda_gpus=1) skips it on CPU)"
_GPU2 = "needs 2 CUDA GPUs (RunIf(min_cuda_gpus=2) skips it on CPU)"
_STANDALONE = "needs 2 CUDA GPUs and standalone execution (RunIf(min_cuda_gpus=2, standalone=True))"

#: Tests deselected by node id (relative to the checkout root, pytest's rootdir), with the reason.
#: On CPU every one of them skips itself: deselecting them keeps the subset the same on any machine.
#: Without gradguard every other test of the subset passes on CPU (Lightning 2.6.5's tests).
DESELECTED: dict[str, str] = {
    f"tests/tests_pytorch/{nodeid}": reason
    for nodeid, reason in {
        "loops/test_all.py::test_callback_batch_on_device[gpu]": _GPU,
        "loops/test_all.py::test_callback_batch_on_device[mps]": "needs Apple MPS (RunIf(mps=True) skips it)",
        "loops/test_evaluation_loop.py::test_memory_consumption_validation": _GPU,
        "trainer/optimization/test_manual_optimization.py::test_multiple_optimizers_manual_call_counts[kwargs1]": _GPU,
        "trainer/optimization/test_manual_optimization.py::test_multiple_optimizers_manual_amp[gpu]": _GPU,
        "trainer/optimization/test_manual_optimization.py::test_manual_optimization_and_return_tensor": _GPU2,
        "trainer/optimization/test_manual_optimization.py::test_manual_optimization_and_accumulated_gradient": _GPU,
        "trainer/optimization/test_manual_optimization.py::test_multiple_optimizers_step[dict]": _GPU,
        "trainer/optimization/test_manual_optimization.py::test_multiple_optimizers_step[CustomMapping]": _GPU,
        "trainer/optimization/test_manual_optimization.py::"
        "test_step_with_optimizer_closure_with_different_frequencies_ddp": _STANDALONE,
        "trainer/optimization/test_manual_optimization.py::"
        "test_step_with_optimizer_closure_with_different_frequencies_ddp_spawn": _GPU2,
        "trainer/optimization/test_manual_optimization.py::"
        "test_step_with_optimizer_closure_with_different_frequencies_ddp_with_toggle_model": _STANDALONE,
        "trainer/optimization/test_manual_optimization.py::test_multiple_optimizers_logging[16-mixed]": _GPU,
        "trainer/optimization/test_manual_optimization.py::test_multiple_optimizers_logging[32-true]": _GPU,
        "trainer/optimization/test_optimizers.py::test_optimizer_state_on_device": _STANDALONE,
    }.items()
}

#: The configurations: a name and the pytest options it adds.
RUNS: dict[str, list[str]] = {
    "plain": [],
    "auto": ["--gradguard-audit=auto", "--gradguard=warn"],
    "every-step": ["--gradguard-audit=1", "--gradguard=warn"],
}

_HOLDER = re.compile(
    r"^gradguard: (?P<holder>.+)\n  keeps an autograd graph across step boundaries\n  (?P<detail>.+(\n    .+)*)"
)


def _fix(message: str) -> str | None:
    """The warning's fix as one line: its ``fix:`` line and the lines under it (a clause per line at the
    first one's column, a clause's continuation further in)."""
    lines = message.splitlines()
    at = next((i for i, line in enumerate(lines) if line.lstrip().startswith("fix: ")), None)
    if at is None:
        return None
    column = lines[at].index("fix: ") + len("fix: ")
    clauses = [lines[at][column:].strip()]
    for line in lines[at + 1 :]:
        indent = len(line) - len(line.lstrip())
        if indent < column:
            break
        if indent == column:
            clauses.append(line.strip())
        else:
            clauses[-1] += " " + line.strip()
    return "; ".join(clauses)


def _lightning_facts(checkout: Path) -> dict[str, Any]:
    facts: dict[str, Any] = {"checkout": str(checkout)}
    for dist in ("lightning", "pytorch-lightning"):
        try:
            facts[f"installed_{dist.replace('-', '_')}"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            facts[f"installed_{dist.replace('-', '_')}"] = None
    marker = checkout / "LIGHTNING_REF"  # written by the README's extraction recipe
    facts["tests_ref"] = marker.read_text().strip() if marker.is_file() else None
    version = checkout / "src" / "version.info"
    facts["tests_version"] = version.read_text().strip() if version.is_file() else None
    return facts


def _child_env(record: Path, keep_every: int, count_objects: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADGUARD")}  # no process watch, no mode
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env[recorder.RECORD_ENV] = str(record)
    if keep_every > 1:
        env[recorder.KEEP_EVERY_ENV] = str(keep_every)
    if count_objects:
        env[recorder.COUNT_OBJECTS_ENV] = "1"
    return env


def run_suite(
    checkout: Path,
    name: str,
    options: list[str],
    *,
    keep_every: int,
    logs: Path,
    timeout: float | None,
    count_objects: bool = False,
) -> dict[str, Any]:
    """One pytest process; its wall time, outcomes and gradguard warnings (see ``recorder``)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name)  # plain@1/4 -> plain_1_4
    record = logs / f"{stem}.record.json"
    log = logs / f"{stem}.log"
    record.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", *SUBSET, "-p", "benchmarks.lightning_suite.recorder"]
    cmd += ["-p", "no:cacheprovider", "-q", "--color=no"]
    cmd += [f"--deselect={nodeid}" for nodeid in DESELECTED]
    cmd += options
    facts = machine()
    print(f"[{name}] {shlex.join(options) or '(no gradguard option)'}: running ...", flush=True)
    start = time.perf_counter()
    timed_out = False
    with open(log, "w") as out:
        try:
            proc = subprocess.run(
                cmd,
                cwd=checkout / "tests",
                env=_child_env(record, keep_every, count_objects),
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc, timed_out = None, True
    wall = time.perf_counter() - start
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    doc = json.loads(record.read_text()) if record.is_file() else {}
    tests = doc.get("tests", {})
    outcomes = collections.Counter(t["outcome"] for t in tests.values())
    result = {
        "options": options,
        "pytest_args": cmd[3:],  # in the checkout's tests/
        "machine_line": machine_line(facts),
        "keep_every": keep_every,
        "returncode": rc,
        "timed_out": timed_out,
        "wall_s": round(wall, 2),
        "session_s": None if doc.get("session_s") is None else round(doc["session_s"], 2),
        "collected": doc.get("collected"),
        "selected": doc.get("selected"),
        "outcomes": dict(sorted(outcomes.items())),
        "deselected_not_collected": sorted(set(DESELECTED) - set(doc.get("deselected", []))) if doc else [],
        "not_passed": {k: t["outcome"] for k, t in sorted(tests.items()) if t["outcome"] not in ("passed",)},
        "slow_teardowns": {
            k: t["durations"]["teardown"] for k, t in sorted(tests.items()) if t["durations"].get("teardown", 0) >= 1.0
        },
        "durations": {k: sum(t["durations"].values()) for k, t in sorted(tests.items())},
        "live_objects": {k: t["live_objects"] for k, t in tests.items() if "live_objects" in t} or None,
        "warnings": doc.get("warnings", []),
        "retentions": retentions(doc.get("warnings", [])),
        "watch": doc.get("watch"),
        "modules": doc.get("modules"),
        "summary_line": lines[-1] if lines else "",
        "load_avg_1min_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    print(f"[{name}] {result['wall_s']:.1f} s: {result['summary_line']}", flush=True)
    for r in result["retentions"]:
        print(f"[{name}]   retention: {r['holder']} in {', '.join(r['tests'])}", flush=True)
    return result


def retentions(warnings_: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The gradguard warnings grouped by holder (the message itself where it names none)."""
    holders: dict[str, dict[str, Any]] = {}
    for w in warnings_:
        match = _HOLDER.match(w["message"])
        holder = match["holder"] if match else w["message"]
        entry = holders.setdefault(
            holder,
            {
                "holder": holder,
                "category": w["category"],
                "detail": " ".join(match["detail"].split()) if match else None,
                "fix": _fix(w["message"]),
                "tests": [],
                "when": [],  # pytest's: "runtest" (a test, setup to teardown), or "unconfigure" outside one
                "warnings": 0,
            },
        )
        entry["warnings"] += 1
        test = w["nodeid"] or "(outside any test)"
        if test not in entry["tests"]:
            entry["tests"].append(test)
        if w["when"] not in entry["when"]:
            entry["when"].append(w["when"])
    return list(holders.values())


# --------------------------------------------------------------------------------------------------
# The summary
# --------------------------------------------------------------------------------------------------


def _ratio(run: dict[str, Any], plain: dict[str, Any] | None) -> float | None:
    if plain is None or not plain.get("wall_s") or run.get("timed_out"):
        return None
    return round(run["wall_s"] / plain["wall_s"], 2)


def summarize(doc: dict[str, Any]) -> None:
    """Ratios to plain (a sampled run against plain on the same sample) and the estimate for the
    whole subset (plain's whole-subset time times that ratio)."""
    runs = doc["runs"]
    full_plain = runs.get("plain")
    for name, run in runs.items():
        if name.startswith("plain"):
            continue
        k = run.get("keep_every", 1)
        plain = full_plain if k == 1 else runs.get(f"plain@1/{k}")
        run["ratio_to_plain"] = _ratio(run, plain)
        if k > 1 and run["ratio_to_plain"] is not None and full_plain:
            run["estimated_full_wall_s"] = round(full_plain["wall_s"] * run["ratio_to_plain"], 1)
    green = full_plain is not None and not full_plain["not_passed"] and full_plain["returncode"] == 0
    doc["baseline_green"] = green


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(doc: dict[str, Any]) -> str:
    runs = doc["runs"]
    lf = doc["lightning"]
    out = [
        "# Lightning's own tests under gradguard's watch — CPU",
        "",
        f"Machine: {doc['machine_line']}",
        "",
        f"`{doc['command']}`",
        "",
        f"Lightning: tests from {lf.get('tests_ref') or lf.get('tests_version') or 'the checkout'}, run against the "
        f"installed lightning {lf.get('installed_lightning')}. The subset: `{'`, `'.join(SUBSET)}` "
        f"(under `tests/`), {len(DESELECTED)} tests deselected (below). Baseline green (every selected test "
        f"passes plain): **{'yes' if doc.get('baseline_green') else 'NO'}**.",
        "",
    ]
    if doc.get("note"):
        out += [doc["note"], ""]
    out += [
        "| run | pytest options | tests | passed | not passed | wall | ratio to plain | watch: audits / boundaries | "
        "holders reported |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, run in runs.items():
        ratio = run.get("ratio_to_plain")
        ratio_s = "—" if ratio is None else f"{ratio:.2f}×"
        if run.get("estimated_full_wall_s") is not None:
            ratio_s += f" (whole subset ≈ {run['estimated_full_wall_s']:.0f} s)"
        w = run.get("watch")
        watch_s = "—"
        if w:
            per = f", {1000 * w['audit_seconds'] / w['audits']:.0f} ms each" if w["audits"] else ""
            watch_s = f"{w['audits']} / {w['boundaries']} ({w['audit_seconds']:.1f} s auditing{per})"
        sample = "" if run.get("keep_every", 1) == 1 else f" (every {run['keep_every']}th)"
        wall = "timed out" if run.get("timed_out") else f"{run['wall_s']:.1f} s"
        options = f"`{shlex.join(run['options'])}`" if run["options"] else "(none)"
        out.append(
            f"| {name} | {options} | {run['selected']}{sample} | "
            f"{run['outcomes'].get('passed', 0)} | {len(run['not_passed'])} | {wall} | {ratio_s} | {watch_s} | "
            f"{len(run['retentions'])} |"
        )
    out.append("")
    for name, run in runs.items():
        if run["not_passed"]:
            out += [f"Not passed in *{name}*: " + ", ".join(f"`{k}` ({v})" for k, v in run["not_passed"].items()), ""]
    for name, run in runs.items():
        if not run["options"]:
            continue
        out += [f"## Retentions reported: {name}", ""]
        if not run["retentions"]:
            out += ["None.", ""]
            continue
        out += ["| holder | test(s) | alive | fix |", "| --- | --- | --- | --- |"]
        for r in run["retentions"]:
            tests = "<br>".join(f"`{t}`" for t in r["tests"])
            out.append(f"| `{_cell(r['holder'])}` | {tests} | {_cell(r['detail'] or '')} | {_cell(r['fix'] or '')} |")
        out.append("")
    watched = [n for n, r in runs.items() if r["options"]]
    if len(watched) > 1:
        out += ["## Holders by run", ""]
        found = {n: {r["holder"] for r in runs[n]["retentions"]} for n in watched}
        every = sorted(set().union(*found.values()))
        out += ["| holder | " + " | ".join(watched) + " |", "| --- |" + " --- |" * len(watched)]
        for holder in every:
            marks = []
            for n in watched:
                tests = next((r["tests"] for r in runs[n]["retentions"] if r["holder"] == holder), None)
                marks.append("✓" if tests else "—")
            out.append(f"| `{_cell(holder)}` | " + " | ".join(marks) + " |")
        out += [
            "",
            "A sampled run only sees its sample's tests, and a holder's warning is emitted once per process, "
            "so its test id is the first test where an audit found it.",
            "",
        ]
    plain = runs.get("plain")
    header = ["## Where the watch's time goes", ""]
    for name, run in runs.items():
        if not run["options"] or run.get("keep_every", 1) != 1 or not plain or not run["durations"]:
            continue
        out += header
        header = []
        added = sorted(((d - plain["durations"].get(k, 0.0), k) for k, d in run["durations"].items()), reverse=True)[:5]
        total = sum(run["durations"].values()) - sum(plain["durations"].values())
        out += [
            f"*{name}*: the tests' own durations (setup + call + teardown) add up to {total:+.1f} s against plain; "
            "the most added: " + ", ".join(f"`{k}` {d:+.1f} s" for d, k in added),
            "",
        ]
    for name, run in runs.items():
        live = run.get("live_objects")
        if live:
            counts = list(live.values())
            out += [
                f"*{name}* (with `--count-objects`, its wall time is not a figure): objects the collector tracks "
                f"after the first test {counts[0]:,}, after the last {counts[-1]:,}, at most {max(counts):,}.",
                "",
            ]
    if plain and plain["slow_teardowns"]:
        waits = plain["slow_teardowns"]
        out += [
            "## Where plain's time goes",
            "",
            f"{sum(waits.values()):.1f} s of plain's {plain['wall_s']:.1f} s are teardowns of {len(waits)} test(s) "
            "(≥ 1 s each: Lightning's `thread_police` fixture joining left-over DataLoader worker threads, "
            "with a timeout) — the same in every configuration: "
            + ", ".join(f"`{k}` {v:.1f} s" for k, v in waits.items()),
            "",
        ]
    out += ["## Deselected", ""]
    out += [f"* `{nodeid}`: {reason}" for nodeid, reason in DESELECTED.items()]
    out.append("")
    return "\n".join(out)


def _without_note(argv: list[str]) -> list[str]:
    """The command line as recorded: ``--note``'s paragraph is shown in the summary itself."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--note":
            skip = True
        elif not arg.startswith("--note="):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lightning_suite", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "checkout", type=Path, nargs="?", help="the Lightning checkout (its root: tests/ and pyproject.toml)"
    )
    p.add_argument(
        "--runs",
        default="plain,auto,every-step",
        help="comma-separated configurations to run, in order (default: plain,auto,every-step)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar='NAME="PYTEST OPTIONS"',
        help='define or redefine a configuration (e.g. auto="--gradguard-audit=auto --gradguard=warn"); repeatable',
    )
    p.add_argument("--sample-every", type=int, default=1, metavar="K", help="the sample: every K-th test (default 1)")
    p.add_argument(
        "--sampled",
        default="",
        help="comma-separated configurations run on the sample only (plain is then also run on it: plain@1/K)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per pytest process (default: none)")
    p.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/lightning-suite-cpu.json")
    p.add_argument("--md", type=Path, default=ROOT / "benchmarks/results/lightning-suite-cpu.md")
    p.add_argument("--merge", action="store_true", help="keep the runs of the existing --json not run now")
    p.add_argument("--note", default=None, help="a paragraph for the summary (e.g. the machine's conditions)")
    p.add_argument("--logs", type=Path, default=None, help="where pytest's logs go (default: a temporary folder)")
    p.add_argument(
        "--count-objects",
        action="store_true",
        help="a diagnostic: record the live objects (gc-tracked) after each test; costs time, so not for figures",
    )
    p.add_argument(
        "--render", action="store_true", help="only rewrite --md from --json (and --note into it); runs nothing"
    )
    args = p.parse_args(argv)

    if args.render:
        doc = json.loads(args.json.read_text())
        if args.note is not None:
            doc["note"] = args.note
        summarize(doc)
        args.md.write_text(markdown(doc))
        print(f"wrote {args.md}", flush=True)
        return 0
    if args.checkout is None:
        p.error("the Lightning checkout is required (or --render)")
    checkout = args.checkout.resolve()
    if not (checkout / "tests" / "tests_pytorch").is_dir():
        p.error(f"{checkout} has no tests/tests_pytorch: pass the Lightning checkout's root")
    configs = {name: list(opts) for name, opts in RUNS.items()}
    for spec in args.option:
        name, sep, opts = spec.partition("=")
        if not sep or not name:
            p.error(f'--option {spec!r}: expected NAME="OPTIONS"')
        configs[name] = shlex.split(opts)
    names = [n for n in args.runs.split(",") if n]
    sampled = {n for n in args.sampled.split(",") if n}
    for n in [*names, *sampled]:
        if n not in configs:
            p.error(f"unknown configuration {n!r} (known: {', '.join(configs)}; define one with --option)")
    k = args.sample_every
    if sampled and k < 2:
        p.error("--sampled needs --sample-every K with K >= 2")
    plan: list[tuple[str, str, int]] = []  # (result name, configuration, keep_every)
    for n in names:
        if n in sampled:
            if (f"plain@1/{k}", "plain", k) not in plan:
                plan.append((f"plain@1/{k}", "plain", k))
            plan.append((n, n, k))
        else:
            plan.append((n, n, 1))

    logs = args.logs or Path(tempfile.mkdtemp(prefix="lightning-suite-"))
    logs.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"runs": {}}
    if args.merge and args.json.is_file():
        doc = json.loads(args.json.read_text())
    facts = machine()
    doc.update(
        machine=facts,
        machine_line=machine_line(facts),
        command="python -m benchmarks.lightning_suite "
        + shlex.join(_without_note(argv if argv is not None else sys.argv[1:])),
        lightning=_lightning_facts(checkout),
        subset=list(SUBSET),
        deselected=DESELECTED,
    )
    if args.note is not None:
        doc["note"] = args.note
    print(f"machine: {doc['machine_line']}\nlogs: {logs}", flush=True)
    for result_name, config, keep in plan:
        doc["runs"][result_name] = run_suite(
            checkout,
            result_name,
            configs[config],
            keep_every=keep,
            logs=logs,
            timeout=args.timeout,
            count_objects=args.count_objects,
        )
        doc["runs"][result_name]["utc"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        order = [
            *[n for n in doc["runs"] if n.startswith("plain")],
            *[n for n in doc["runs"] if not n.startswith("plain")],
        ]
        doc["runs"] = {n: doc["runs"][n] for n in order}
        summarize(doc)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = portable(doc, [checkout])  # files named from the repository, the checkout or by name
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        args.md.write_text(markdown(doc))
    print(f"wrote {args.json} and {args.md}", flush=True)
    return 0 if doc.get("baseline_green") or "plain" not in doc["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
