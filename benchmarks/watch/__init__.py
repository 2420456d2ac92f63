"""The watch under its defaults: when each kind of leak is reported, what ``detach`` does to memory, and
what a clean run pays.

``python -m benchmarks.watch [--device cpu|cuda] [--quick] [--json PATH] [--md PATH] [--plot PATH]`` (from
the repository root). Every run is ``gradguard.watch()`` with no argument but the mode: ``every="auto"``.

Leaks (each run twice in one process: unwatched, then inside ``watch(mode="detach")``):

* ``late/<scenario>``: ``gradguard bench``'s scenarios (4 micro-batches and ``optimizer.step()`` a step)
  that keep, from step ``--late-start``, each step's backwarded loss with a fresh 128 KiB leaf and its
  gradient (256 KiB a step, object state);
* ``fast/eval-forward``: a step of about a millisecond (an MLP, 128 wide, batch 64, Adam) that keeps,
  from step ``--fast-start``, an evaluation forward run without ``no_grad`` (its saved activations);
* ``growth-then-leak``: the fast step filling a detached replay buffer (32 KiB a step) until step 300,
  then keeping an evaluation forward from step 400;
* ``short-6`` and ``short-30``: a trainer that adds each loss to ``self.running['epoch_loss']`` (6 steps),
  and one that adds each step's squared error, graph included, to a metric's state (30 steps), from step 1.

Clean runs (watched and unwatched, the same steps): ``fast/clean`` and ``late/<scenario>`` clean, and
``sawtooth`` (the fast step filling a detached buffer for 50 steps, then clearing it).

Figures: the boundary each leak was reported at; the bytes in use after each step (glibc's in-use bytes
on CPU, CUDA's allocated bytes), unwatched and under ``detach``; for clean runs the watch's share of the
wall time after the start-up check (its audits and memory readings, by its own accounting), its own
microseconds per boundary (its code at boundaries and backwards, timed from inside, audits excluded),
heap searches per 1000 steps, and the wall time against the unwatched run. Last, the floor of the
watch's own time: one root's stamp and the boundary's constant-time signals at their barest, timed inside
the fast step, unwatched.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # `python benchmarks/watch.py`: import from the repository root instead
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import shlex  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gradguard  # noqa: E402
from gradguard._graph.held import HeldParameters  # noqa: E402
from gradguard._graph.stamps import Ledger  # noqa: E402
from gradguard._policy import table as _table  # noqa: E402
from gradguard._policy.message import human  # noqa: E402
from gradguard._tools.bench.late_leak import LateLeak  # noqa: E402
from gradguard._tools.bench.machine import measuring  # noqa: E402
from gradguard._tools.bench.report import write_json  # noqa: E402
from gradguard._tools.bench.scenarios import Size  # noqa: E402
from gradguard._watch import watcher as _watcher  # noqa: E402
from gradguard._watch.allocated import AllocatedReader  # noqa: E402

__all__ = ["main"]

SCENARIOS = ("pp-last-stage", "lora-checkpoint", "megatron-gpt")
PROGRAM = types.ModuleType("gradguard_watch_benchmark", "the training script of the benchmark's runs")
sys.modules[PROGRAM.__name__] = PROGRAM  # what the runs keep lives here: the program's state, not gradguard's


# --------------------------------------------------------------------------------------------------
# What is measured around the watch
# --------------------------------------------------------------------------------------------------


class Own:
    """The watch's own time at boundaries and backwards, timed from inside (its methods wrapped), audits
    excluded (their time is the watcher's ``audit_seconds``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._originals: list[tuple[str, Any]] = []

    def __enter__(self) -> Own:
        for name in ("_boundary", "_on_backward"):
            original = getattr(_watcher.Watcher, name)
            self._originals.append((name, original))

            def timed(watcher: Any, *args: Any, _original: Any = original) -> Any:
                start = time.perf_counter()
                try:
                    return _original(watcher, *args)
                finally:
                    self.seconds += time.perf_counter() - start

            setattr(_watcher.Watcher, name, timed)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals:
            setattr(_watcher.Watcher, name, original)


class Memory:
    """The bytes in use on the run's device after each step."""

    def __init__(self, device: torch.device) -> None:
        self.read = AllocatedReader(cpu="mallinfo2" if device.type == "cpu" else "off", cuda=device.type == "cuda")
        self.key = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
        self.device = device

    def __call__(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.read().get(self.key, 0)


# --------------------------------------------------------------------------------------------------
# The training loops
# --------------------------------------------------------------------------------------------------


class Fast:
    """The fast step: an MLP 128 wide, batch 64, Adam; what the program keeps lives in ``state``."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.device = device
        self.model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.state = types.SimpleNamespace(kept=[], buffer=[], running={"epoch_loss": 0.0}, total=0.0)
        self.name = f"run{id(self)}"
        vars(PROGRAM)[self.name] = self.state

    def step(self, extra: Callable[[Fast, int, torch.Tensor, torch.Tensor], None], number: int) -> None:
        x = torch.randn(64, 128, device=self.device)
        out = self.model(x)
        loss = out.pow(2).mean()
        loss.backward()
        extra(self, number, loss, out)
        self.opt.step()
        self.opt.zero_grad()

    def close(self) -> None:
        vars(PROGRAM).pop(self.name, None)


def _eval_forward(run: Fast) -> None:
    run.state.kept.append(run.model(torch.randn(64, 128, device=run.device)))  # no torch.no_grad(): the bug


LEAKS: dict[str, Callable[[Fast, int, torch.Tensor, torch.Tensor], None]] = {}


def _leak(name: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    def register(fn: Callable[..., None]) -> Callable[..., None]:
        LEAKS[name] = fn
        return fn

    return register


@_leak("clean")
def _clean(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    pass


@_leak("eval-forward")
def _eval_from(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    if step >= run.start:  # type: ignore[attr-defined]
        _eval_forward(run)


@_leak("growth-then-leak")
def _growth_then_leak(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    if step <= 300:
        run.state.buffer.append(torch.randn(64, 128, device=run.device))  # detached: legitimate growth
    if step >= run.start:  # type: ignore[attr-defined]
        _eval_forward(run)


@_leak("sawtooth")
def _sawtooth(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    run.state.buffer.append(torch.randn(64, 128, device=run.device))
    if step % 50 == 0:
        run.state.buffer.clear()


@_leak("running-loss")
def _running_loss(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    run.state.running["epoch_loss"] += loss  # the bug: the loss with its graph


@_leak("metric")
def _metric(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    run.state.total = run.state.total + (out - 1).pow(2).sum()  # the bug: the output's graph, every step


# --------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------


def _fast_run(device: torch.device, leak: str, steps: int, start: int, watched: bool) -> dict[str, Any]:
    run = Fast(device)
    run.start = start  # type: ignore[attr-defined]
    memory = Memory(device)
    for _ in range(3):  # warm-up, unwatched, before the run's state exists: lazy initialisation
        run.step(_clean, 0)
    return _loop(lambda n: run.step(LEAKS[leak], n), steps, memory, watched, run.close)


def _late_run(
    name: str, device: torch.device, steps: int, start: int | None, watched: bool, micro_batches: int
) -> dict[str, Any]:
    run = LateLeak(name, device, Size(), start=start, micro_batches=micro_batches)
    memory = Memory(device)
    with run.scope():
        for _ in range(2):
            run.step()  # warm-up
        run.start = None if start is None else start + 2  # count the leak's start from the measured steps
        return _loop(lambda n: run.step(), steps, memory, watched, run.close)


def _loop(
    step: Callable[[int], None], steps: int, memory: Memory, watched: bool, close: Callable[[], None]
) -> dict[str, Any]:
    gc.collect()
    figures: list[int] = []
    scope = gradguard.watch(mode="detach") if watched else contextlib.nullcontext()
    own = Own() if watched else contextlib.nullcontext()
    first_audit = 0.0
    start = time.perf_counter()
    with own, scope:
        for n in range(1, steps + 1):
            step(n)
            if n == 1 and watched:
                first_audit = scope.watcher.audit_seconds  # type: ignore[union-attr]
            figures.append(memory())
    wall = time.perf_counter() - start
    out: dict[str, Any] = {"steps": steps, "wall_s": wall, "memory": figures}
    if watched:
        w = scope.watcher  # type: ignore[union-attr]
        history = w.history()
        after = max(wall - first_audit, 1e-9)
        out.update(
            reported_at=min((e.found_at for e in history), default=None),
            holders=[(e.holder, e.outcome) for e in history],
            audits=w.audits,
            searches=w.searches,
            memory_audits=w.memory_audits,
            audit_s=w.audit_seconds,
            read_s=w.read_seconds,
            first_audit_s=first_audit,
            share_after_start=(w.audit_seconds - first_audit + w.read_seconds) / after,
            own_us_per_boundary=1e6 * max(0.0, own.seconds - w.audit_seconds) / max(1, w.boundaries),  # type: ignore[union-attr]
            summary=w.summary(),
        )
    close()
    gc.collect()
    return out


# --------------------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------------------


def _cases(args: argparse.Namespace) -> Iterator[tuple[str, str, Callable[[bool], dict[str, Any]]]]:
    """``(case, kind, run(watched))``; ``kind``: ``leak`` (a start) or ``clean``."""
    device = torch.device(args.device)
    for name in args.scenario:
        yield (
            f"late/{name}",
            f"leak from {args.late_start}",
            lambda w, n=name: _late_run(n, device, args.late_steps, args.late_start, w, args.micro_batches),
        )
        yield (
            f"late/{name} clean",
            "clean",
            lambda w, n=name: _late_run(n, device, args.clean_steps // 4, None, w, args.micro_batches),
        )
    yield (
        "fast/eval-forward",
        f"leak from {args.fast_start}",
        lambda w: _fast_run(device, "eval-forward", args.fast_steps, args.fast_start, w),
    )
    yield (
        "growth-then-leak",
        f"leak from {args.growth_start}",
        lambda w: _fast_run(device, "growth-then-leak", args.growth_steps, args.growth_start, w),
    )
    yield "short-6", "leak from 1", lambda w: _fast_run(device, "running-loss", 6, 1, w)
    yield "short-30", "leak from 1", lambda w: _fast_run(device, "metric", 30, 1, w)
    yield "fast/clean", "clean", lambda w: _fast_run(device, "clean", args.clean_steps, 0, w)
    yield "sawtooth", "clean", lambda w: _fast_run(device, "sawtooth", args.clean_steps, 0, w)


def floor(device: torch.device, steps: int) -> dict[str, float]:
    """The barest form of the watch's work at each step, timed inside the fast step, unwatched: one
    stamp on the backward's root (a fresh ledger's, on the loss's node), and the boundary's
    constant-time signals (torch's node counter, the sampled parameters' reference count, the oldest
    stamp alive). Microseconds per step, each."""
    run = Fast(device)
    ledger = Ledger()
    held = HeldParameters((run.opt,))
    stamp = signals = 0.0
    warm = 50
    for n in range(warm + steps):
        loss = run.model(torch.randn(64, 128, device=device)).pow(2).mean()
        loss.backward()
        a = time.perf_counter()
        ledger.place(loss.grad_fn, n)
        b = time.perf_counter()
        run.opt.step()
        run.opt.zero_grad()
        c = time.perf_counter()
        torch.autograd._get_sequence_nr()
        held()
        ledger.old(n - 3)
        d = time.perf_counter()
        if n >= warm:
            stamp += b - a
            signals += d - c
    run.close()
    return {"stamp_us": 1e6 * stamp / steps, "signals_us": 1e6 * signals / steps, "steps": steps}


def measure(args: argparse.Namespace, say: Callable[[str], None]) -> list[dict[str, Any]]:
    entries = []
    for case, kind, run in _cases(args):
        plain = run(False)
        watched = run(True)
        entry = {"case": case, "kind": kind, "unwatched": plain, "watched": watched}
        entries.append(entry)
        say(_row_text(entry))
    return entries


def _start(kind: str) -> int | None:
    return int(kind.rsplit(" ", 1)[1]) if kind.startswith("leak from") else None


def _slope(values: Sequence[int]) -> float:
    """Least-squares bytes per step."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def _rate(n: float) -> str:
    """A signed byte rate: ``+1.5 MiB``, ``-384 B``."""
    return ("-" if n < 0 else "+") + human(int(abs(n)))


def verdicts(entry: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """``(check, passed, detail)`` per target of the issue this benchmark proves."""
    w, plain = entry["watched"], entry["unwatched"]
    start = _start(entry["kind"])
    checks = []
    if start is not None:
        reported = w["reported_at"]
        checks.append(
            (
                "reported within 3 boundaries of its start",
                reported is not None and reported - start <= 3 - (1 if start == 1 else 0),
                f"started at {start}, reported at {reported}",
            )
        )
        if reported is not None and w["steps"] >= reported + 20 and any(o == "repaired" for _, o in w["holders"]):
            tail = w["memory"][reported + 5 :]
            checks.append(
                (
                    "detach: memory stops growing within 5 boundaries of the report",
                    _slope(tail) < 0.1 * max(1.0, _slope(plain["memory"][start:])),
                    f"{_rate(_slope(tail))}/step after {reported + 5} vs {_rate(_slope(plain['memory'][start:]))}"
                    "/step unwatched",
                )
            )
    else:
        checks.append(("clean: nothing reported", not w["holders"], str(w["holders"] or "none")))
        checks.append(
            (
                "clean: share of the wall time after the start-up check <= 0.1%",
                w["share_after_start"] <= 0.001,
                f"{w['share_after_start']:.3%}",
            )
        )
        checks.append(
            (
                "clean: <= 5 us of the watch's own time per boundary",
                w["own_us_per_boundary"] <= 5.0,
                f"{w['own_us_per_boundary']:.1f} us",
            )
        )
    return checks


def _row(entry: dict[str, Any]) -> tuple[str, ...]:
    w, plain = entry["watched"], entry["unwatched"]
    start = _start(entry["kind"])
    step_ms = 1e3 * plain["wall_s"] / plain["steps"]
    if start is not None:
        after = (w["reported_at"] or w["steps"]) + 5
        return (
            entry["case"],
            f"{step_ms:.2f} ms",
            str(start),
            str(w["reported_at"]) if w["reported_at"] is not None else "—",
            ", ".join(sorted({o for _, o in w["holders"]})) or "—",
            f"{_rate(_slope(plain['memory'][start - 1 :]))}",
            f"{_rate(_slope(w['memory'][after:]))}" if w["steps"] > after + 2 else "—",
            "",
            "",
            "",
            "",
        )
    searches = 1000 * max(0, w["searches"]) / w["steps"]
    return (
        entry["case"],
        f"{step_ms:.2f} ms",
        "clean",
        "—",
        "—",
        "—",
        "—",
        f"{w['share_after_start']:.3%}",
        f"{w['own_us_per_boundary']:.1f} us",
        f"{searches:.1f}",
        f"{w['wall_s'] / plain['wall_s']:.3f}×",
    )


HEADER = (
    "case",
    "step",
    "leak from",
    "reported at",
    "outcome",
    "memory/step unwatched",
    "memory/step detach, 5 after the report",
    "share after start-up",
    "own time per boundary",
    "heap searches per 1000 steps",
    "wall vs unwatched",
)


def _row_text(entry: dict[str, Any]) -> str:
    checks = "; ".join(f"{'ok' if ok else 'MISSED'} {c}: {d}" for c, ok, d in verdicts(entry))
    return f"  {entry['case']}: {checks}"


def markdown(doc: dict[str, Any]) -> str:
    rows = [_row(e) for e in doc["cases"]]
    table = _table.markdown(HEADER, rows)
    checks = "\n".join(
        f"- {e['case']}: {'ok' if ok else '**MISSED**'} {c} ({d})" for e in doc["cases"] for c, ok, d in verdicts(e)
    )
    return (
        f"# The watch under its defaults — {doc['device']}\n\n"
        f"Machine: {doc['machine_line']}\n\n"
        f"`{doc['settings']['command']}` ({doc['settings']['elapsed_s']} s)\n\n"
        f"{__doc__.split(chr(10) + chr(10), 1)[1]}\n{table}\n\n{checks}\n"
        + (f"\n{_floor_text(doc['floor'])}\n" if "floor" in doc else "")
    )


def _floor_text(figures: dict[str, float]) -> str:
    return (
        f"The floor (the fast step, unwatched, {figures['steps']} steps): one stamp on a backward's root "
        f"{figures['stamp_us']:.1f} us; the boundary's constant-time signals at their barest "
        f"{figures['signals_us']:.1f} us."
    )


def plot(doc: dict[str, Any], path: str) -> None:
    """Memory after each step, unwatched and under ``detach``, for each leak; the leak's start and report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    leaks = [e for e in doc["cases"] if _start(e["kind"]) is not None]
    fig, axes = plt.subplots(len(leaks), 1, figsize=(9, 2.6 * len(leaks)), squeeze=False)
    for ax, e in zip(axes[:, 0], leaks):
        for side, label in (("unwatched", "unwatched"), ("watched", "watch(mode='detach')")):
            values = e[side]["memory"]
            ax.plot(range(1, len(values) + 1), [(v - values[0]) / 2**20 for v in values], label=label)
        ax.axvline(_start(e["kind"]), color="grey", linestyle=":", label="the leak starts")
        reported = e["watched"]["reported_at"]
        if reported is not None:
            ax.axvline(reported, color="red", linestyle="--", label="reported")
        ax.set_title(e["case"], fontsize=9)
        ax.set_ylabel("MiB since step 1")
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.watch", description=__doc__.split("\n\n")[0])
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
    p.add_argument("--quick", action="store_true", help="a smoke run: one scenario, short runs")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--md", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.scenario = args.scenario or ["pp-last-stage"]
        args.late_steps, args.late_start, args.fast_steps, args.fast_start = 40, 20, 40, 20
        args.growth_steps, args.growth_start, args.clean_steps, args.micro_batches = 430, 405, 60, 1
    args.scenario = args.scenario or [s for s in SCENARIOS if _unavailable(s) is None]
    with measuring(args.device) as (facts, line):
        t0 = time.perf_counter()
        entries = measure(args, lambda s: print(s, flush=True))
        settings = {
            "command": shlex.join(["python", "-m", "benchmarks.watch", *(sys.argv[1:] if argv is None else argv)]),
            "torch_threads": torch.get_num_threads(),
            "elapsed_s": round(time.perf_counter() - t0, 1),
        }
    doc = {"device": args.device.upper(), "machine": facts, "machine_line": line, "settings": settings}
    doc["cases"] = entries
    doc["floor"] = floor(torch.device(args.device), args.clean_steps)
    print(_floor_text(doc["floor"]))
    print(_table.text(HEADER, [_row(e) for e in entries]))
    if args.json:
        write_json(args.json, doc)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(markdown(doc))
    if args.plot:
        plot(doc, args.plot)
    return 0


def _unavailable(name: str) -> str | None:
    if name == "megatron-gpt":
        from gradguard._tools.bench.megatron_gpt import unavailable

        return unavailable()
    return None


if __name__ == "__main__":
    sys.exit(main())
