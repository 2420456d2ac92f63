"""The step-boundary watch's cost per audited step, and its share of step time at the default ``every``.

``python -m benchmarks.watch [--json PATH] [--md PATH]`` (from the repository root). For each of
``gradguard bench``'s scenarios (CPU, default size, torch on one thread), a *training step* is
``--micro-batches`` micro-batches of the scenario's guarded step (the records kept in the step's store,
emptied when the step ends, as the engines do) and one ``optimizer.step()``: the step boundary.

* *every=1*: interleaved rounds of one step without the watch and one step inside
  ``gradguard.watch(every=1, mode="warn")`` (order alternating; one watcher across the rounds, so
  every audit after the first compares with the previous one). The cost per audited step is the
  median of the within-round differences; the watcher's own measurement of its audits is reported
  beside it.
* *every="auto" on time alone*: ``--auto-seconds`` of steps inside ``gradguard.watch(memory=False)``
  (the schedule where no memory figure can be read); the share is the audits' time over the run's
  wall time, in total and after the first two boundaries (which that schedule always audits), with
  how many audits ran. The default, with the memory trigger, is measured by ``gradguard bench
  --late-leak`` (a clean run's share, and a leak that starts late).

The loops are clean, so every audit finds nothing to act on: what is measured is the search.
Its cost grows with the number of live objects in the process, reported per scenario.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # `python benchmarks/watch.py`: import from the repository root instead
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import gc  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import gradguard  # noqa: E402
from gradguard._policy import table as _table  # noqa: E402
from gradguard._tools.bench.machine import measuring  # noqa: E402
from gradguard._tools.bench.report import write_json  # noqa: E402
from gradguard._tools.bench.scenarios import Size, build  # noqa: E402

__all__ = ["main", "measure"]

SCENARIOS = ("pp-last-stage", "lora-checkpoint", "megatron-gpt")
TARGET_SHARE = 0.01


def _trainer(name: str, micro_batches: int) -> tuple[Callable[[], None], Any]:
    """One training step of scenario ``name`` (its guarded path) and a context it must run in."""
    scenario = build(name, torch.device("cpu"), Size())
    params = [p for p in scenario.model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-4)
    counter = [0]
    scope = gradguard.enforce(mode="detach", engines=list(scenario.engines) or "none", audit=0)

    def step() -> None:
        if scenario.run is not None:
            scenario.run(micro_batches, True, lambda: None)
        else:
            store = scenario.new_store(True)
            for _ in range(micro_batches):
                scenario.step(counter[0], store, True)
                counter[0] += 1
            del store
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, scope


def _timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def measure(
    name: str, micro_batches: int, rounds: int, auto_seconds: float, say: Callable[[str], None]
) -> dict[str, Any]:
    """The figures of one scenario (see the module documentation)."""
    step, scope = _trainer(name, micro_batches)
    with scope:
        for _ in range(3):
            step()  # warm-up: lazy initialisation, first allocations
        gc.collect()
        objects = len(gc.get_objects())
        every1 = gradguard.watch(every=1, mode="warn")
        bare: list[float] = []
        watched: list[float] = []
        for r in range(rounds):
            sides = ((bare, None), (watched, every1))
            for times, watching in sides if r % 2 == 0 else sides[::-1]:
                if watching is None:
                    times.append(_timed(step))
                else:
                    with watching:
                        times.append(_timed(step))
        watcher = every1.watcher
        assert watcher.audits == rounds and not watcher.history(), "a clean loop: every step audited, no leak"
        diffs = [w - b for w, b in zip(watched, bare)]
        step_s = statistics.median(bare)
        cost_s = statistics.median(diffs)
        own_s = watcher.audit_seconds / watcher.audits
        say(f"  {name}: step {step_s * 1e3:.1f} ms, audited step +{cost_s * 1e3:.1f} ms (own {own_s * 1e3:.1f} ms)")

        auto = gradguard.watch(mode="warn", memory=False)  # every="auto", on time alone
        with auto:
            start = time.perf_counter()
            step()
            step()
            after_two = time.perf_counter()
            two_s = auto.watcher.audit_seconds
            steps = 2
            while time.perf_counter() - start < auto_seconds:
                step()
                steps += 1
            end = time.perf_counter()
        w = auto.watcher
        elapsed, steady = end - start, end - after_two
        share = w.audit_seconds / elapsed
        steady_share = (w.audit_seconds - two_s) / steady if steady > 0 else 0.0
        say(f"    auto: {w.audits} audits in {steps} steps, share {share:.2%}, after the first two {steady_share:.2%}")
    return {
        "scenario": name,
        "micro_batches_per_step": micro_batches,
        "live_objects": objects,
        "rounds": rounds,
        "step_median_ms": step_s * 1e3,
        "step_best_ms": min(bare) * 1e3,
        "audited_step_median_ms": statistics.median(watched) * 1e3,
        "cost_per_audited_step_ms": cost_s * 1e3,
        "cost_per_audited_step_x_step": cost_s / step_s,
        "audit_own_ms": own_s * 1e3,
        "every_for_1pct": max(1, round(cost_s / (TARGET_SHARE * step_s))),
        "auto": {
            "steps": steps,
            "audits": w.audits,
            "elapsed_s": elapsed,
            "audit_s": w.audit_seconds,
            "share": share,
            "share_after_first_two": steady_share,
            "first_two_audits_s": two_s,
        },
    }


def _unavailable(name: str) -> str | None:
    if name == "megatron-gpt":
        from gradguard._tools.bench.megatron_gpt import unavailable

        return unavailable()
    return None


def _rows(doc: dict[str, Any]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    header = (
        "scenario",
        "live objects",
        "step (bare)",
        "audited step",
        "cost per audited step",
        "every for 1%",
        "auto: audits / steps",
        "auto: share",
        "after the first two",
    )
    rows = [
        (
            e["scenario"],
            f"{e['live_objects']:,}",
            f"{e['step_median_ms']:.1f} ms",
            f"{e['audited_step_median_ms']:.1f} ms",
            f"+{e['cost_per_audited_step_ms']:.1f} ms ({e['cost_per_audited_step_x_step']:.2f}× a step)",
            str(e["every_for_1pct"]),
            f"{e['auto']['audits']} / {e['auto']['steps']}",
            f"{e['auto']['share']:.2%}",
            f"{e['auto']['share_after_first_two']:.2%}",
        )
        for e in doc["scenarios"]
    ]
    return header, rows


def text(doc: dict[str, Any]) -> str:
    """The results as a text table."""
    header, rows = _rows(doc)
    return _table.text(header, rows) if rows else "(no scenario ran)"


def markdown(doc: dict[str, Any]) -> str:
    """The results as a Markdown page, with the machine line and the method."""
    header, rows = _rows(doc)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    skipped = "".join(f"\n\nSkipped {name}: {why}" for name, why in doc["skipped"])
    return (
        "# gradguard step-boundary watch — CPU\n\n"
        f"Machine: {doc['machine_line']}\n\n"
        f"`{doc['settings']['command']}` ({doc['settings']['elapsed_s']} s)\n\n"
        f"{_METHOD}\n\n" + "\n".join(lines) + skipped + "\n"
    )


_METHOD = (
    "A training step: the scenario's guarded micro-batch step (`gradguard bench`, CPU, default size, torch on "
    "one thread) repeated for the micro-batches of one step, then `optimizer.step()`. *audited step*: the same "
    "step inside `gradguard.watch(every=1)`, interleaved with bare steps; *cost per audited step*: the median "
    "of the within-round differences. *every for 1%*: the `every` at which that cost is 1% of a step. *auto*: "
    "a run inside `gradguard.watch(memory=False)` (`every='auto'` on time alone, the schedule without a memory "
    "figure): the audits' own time over the run's wall time, in total and after the first two boundaries "
    "(always audited, so that a leak shows at the second). The default schedule, with the memory trigger, is "
    "measured by `gradguard bench --late-leak`."
)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.watch", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", action="append", choices=SCENARIOS, help="default: all that run here")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per training step (default 4)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds for every=1 (default 15)")
    p.add_argument("--auto-seconds", type=float, default=45.0, help="wall time of the every='auto' run (default 45 s)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 3 rounds, a 2 s auto run, 1 micro-batch")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--md", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.auto_seconds, args.micro_batches = 3, 2.0, 1
    with measuring("cpu") as (facts, line):
        t0 = time.perf_counter()
        entries, skipped = [], []
        for name in args.scenario or SCENARIOS:
            reason = _unavailable(name)
            if reason:
                skipped.append((name, reason))
                print(f"  skipped {name}: {reason}", flush=True)
                continue
            say = lambda s: print(s, flush=True)  # noqa: E731
            entries.append(measure(name, args.micro_batches, args.rounds, args.auto_seconds, say))
        settings = {
            "command": shlex.join(["python", "-m", "benchmarks.watch", *(sys.argv[1:] if argv is None else argv)]),
            "micro_batches": args.micro_batches,
            "rounds": args.rounds,
            "auto_seconds": args.auto_seconds,
            "torch_threads": torch.get_num_threads(),
            "elapsed_s": round(time.perf_counter() - t0, 1),
        }
    doc = {"machine": facts, "machine_line": line, "settings": settings, "scenarios": entries, "skipped": skipped}
    print()
    print(text(doc))
    if args.json:
        write_json(args.json, doc)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
