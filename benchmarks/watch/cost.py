"""What the watch costs, as ratios measured side by side: the same steps unwatched and under
``gradguard.watch(mode="detach")``, alternating, several rounds, in CPU time and wall time; and the floor
of its hot path.

A cost case is a run of steps with no per-step reading of the benchmark's own (no memory figure, no timer
around the watch's code): only the watch's work differs between the two runs of a pair. Each round
runs one pair, the unwatched run first in even rounds and last in odd ones, so that a drift of the
machine's speed falls on both sides.
"""

from __future__ import annotations

import collections
import functools
import gc
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

import gradguard
from gradguard._graph.stamps import FRESH, Stamp

from .loops import LEAKS, Extra, Fast, Micro, watch_figures

__all__ = ["MICRO_MS", "MIN_STEP_MS", "STORMS", "fast_cost", "floor", "late_cost", "micro_cost", "side_by_side"]

STORMS = ("kept-exception", "cycles", "gc-off", "grad-fn-kept")
"""The cost storms: correct programs whose steps' graphs outlive the step (until the collector runs, or
as nodes no tensor holds)."""


MIN_STEP_MS = {"cost/clean-4mb": 10.0}
"""The shortest unwatched step a case's target is stated for, in milliseconds."""

MICRO_MS = {"cost/clean-64mb": (0.5, 2.0)}
"""The unwatched micro-batch's range a case's target is stated for, in milliseconds."""


def _timed(body: Callable[[], None], watched: bool, gc_off: bool = False) -> dict[str, Any]:
    """``body()`` (the steps), unwatched or inside ``gradguard.watch(mode="detach")``: ``wall_s`` and
    ``cpu_s`` of the whole (the watch's entry and exit included) and, watched, its figures. ``gc_off``:
    the collector disabled for the run (re-enabled after it, whatever happens)."""
    gc.collect()
    if gc_off:
        gc.disable()
    try:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        if watched:
            with gradguard.watch(mode="detach") as scope:
                body()
        else:
            body()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        if gc_off:
            gc.enable()
    out: dict[str, Any] = {"wall_s": wall, "cpu_s": cpu}
    if watched:
        out.update(watch_figures(scope.watcher, wall))
    return out


def fast_cost(
    device: torch.device, program: str | Extra, steps: int, watched: bool, prepare: Callable[[Fast], None] | None = None
) -> dict[str, Any]:
    """One run of ``steps`` fast steps of ``program`` (a name in :data:`~.loops.LEAKS`, or the step's
    extra itself), after 3 warm-up steps; ``prepare(run)`` sets the program's state up before them."""
    run = Fast(device)
    extra = LEAKS[program] if isinstance(program, str) else program
    for _ in range(3):
        run.step(LEAKS["clean"], 0)
    if prepare is not None:
        prepare(run)

    def body() -> None:
        for n in range(1, steps + 1):
            run.step(extra, n)

    out = _timed(body, watched, gc_off=program == "gc-off")
    out["steps"] = steps
    run.close()
    return out


def late_cost(name: str, device: torch.device, steps: int, micro_batches: int, watched: bool) -> dict[str, Any]:
    """One run of ``steps`` clean steps of ``gradguard bench``'s scenario ``name``, ``micro_batches`` a
    step, after 2 warm-up steps (both sides inside the scenario's guarded scope, as the late cases run)."""
    from gradguard._tools.bench.late_leak import LateLeak
    from gradguard._tools.bench.scenarios import Size

    run = LateLeak(name, device, Size(), start=None, micro_batches=micro_batches)
    with run.scope():
        for _ in range(2):
            run.step()

        def body() -> None:
            for _ in range(steps):
                run.step()

        out = _timed(body, watched)
    out["steps"] = steps
    run.close()
    return out


def micro_cost(device: torch.device, micro: int, steps: int, watched: bool) -> dict[str, Any]:
    """One run of ``steps`` correct steps of ``micro`` micro-batches (gradient accumulation, each micro-batch's
    ``loss.item()`` kept), after one warm-up step: every backward is a micro-batch boundary of the watch."""
    run = Micro(device, micro)
    run.step(1)

    def body() -> None:
        for n in range(2, steps + 2):
            run.step(n)

    out = _timed(body, watched)
    out["steps"] = steps
    out["micro_batches_a_step"] = micro
    run.close()
    return out


def side_by_side(run: Callable[[bool], dict[str, Any]], rounds: int) -> dict[str, Any]:
    """``rounds`` pairs of ``run(False)`` and ``run(True)``, alternating which goes first.

    Returns:
        ``pairs`` (each ``{"unwatched": ..., "watched": ..., "wall": ratio, "cpu": ratio}``), the median
        ratios ``wall`` and ``cpu`` (watched over unwatched), ``step_ms``: the median unwatched step, and
        ``extra_us``: the median pair's extra CPU time per step, and ``extra_us_after_start``: the same
        with the start-up check's seconds taken off (what a longer run pays a step, that fixed cost aside).
    """
    pairs = []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {watched: run(watched) for watched in order}
        plain, watched = got[False], got[True]
        pairs.append(
            {
                "unwatched": plain,
                "watched": watched,
                "wall": watched["wall_s"] / plain["wall_s"],
                "cpu": watched["cpu_s"] / max(plain["cpu_s"], 1e-9),
            }
        )
    return {
        "pairs": pairs,
        "wall": statistics.median(p["wall"] for p in pairs),
        "cpu": statistics.median(p["cpu"] for p in pairs),
        "step_ms": statistics.median(1e3 * p["unwatched"]["wall_s"] / p["unwatched"]["steps"] for p in pairs),
        "extra_us": statistics.median(1e6 * _extra(p) / p["unwatched"]["steps"] for p in pairs),
        "extra_us_after_start": statistics.median(
            1e6 * (_extra(p) - p["watched"]["startup_s"]) / p["unwatched"]["steps"] for p in pairs
        ),
    }


def _extra(pair: dict[str, Any]) -> float:
    return float(pair["watched"]["cpu_s"] - pair["unwatched"]["cpu_s"])


def cost_cases(
    device: torch.device, scenario: str, clean_steps: int, mb_steps: int, storm_steps: int, micro_steps: int = 40
) -> Iterator[tuple[str, float, Callable[[bool], dict[str, Any]]]]:
    """``(case, target ratio, run(watched))`` for the clean steps and the storms."""
    yield "cost/clean-0.5ms", 1.02, lambda w: fast_cost(device, "clean", clean_steps, w)
    yield "cost/clean-4mb", 1.003, lambda w: late_cost(scenario, device, mb_steps, 4, w)
    yield "cost/clean-64mb", 1.02, lambda w: micro_cost(device, 64, micro_steps, w)
    for storm in STORMS:
        yield f"storm/{storm}", 1.05, functools.partial(fast_cost, device, storm, storm_steps)


def floor(device: torch.device, steps: int) -> dict[str, float]:
    """The current design's minimum of the watch's hot path, timed inside the fast step, unwatched.

    ``stamp_us``: one root's stamp at its barest: reading a fresh loss's ``grad_fn`` (the first read
    creates its Python object) and putting one shared token in its ``metadata`` dict; ``token_us``: making
    that token once a step (an object referenced weakly, in an epoch-ordered deque). ``signals_us``:
    the boundary's barest signals: torch's node counter, 4 parameters' ``Tensor._use_count()`` and one
    weak reference's dereference. Microseconds per step, each (the timer's own read included, as in the
    watch's account). ``timeline_us``: one point of the watch's timeline (its folding amortized), the
    cost the series adds per boundary of each clock, beside the watch's own figures."""
    run = Fast(device)
    key = object()
    ref = weakref.ref(run.model)
    params = list(run.model.parameters())[:4]
    use_count = getattr(torch.Tensor, "_use_count")  # noqa: B009  private: not in torch's stubs
    stamp = signals = made = 0.0
    books: collections.deque[tuple[int, Any]] = collections.deque(maxlen=8)
    warm = 50
    for n in range(warm + steps):
        loss = run.model(torch.randn(64, 128, device=device)).pow(2).mean()
        loss.backward()
        t = time.perf_counter()
        token = Stamp()
        token.epoch, token.kind = n, FRESH
        books.append((n, weakref.ref(token)))
        a = time.perf_counter()
        loss.grad_fn.metadata[key] = token
        b = time.perf_counter()
        run.opt.step()
        run.opt.zero_grad()
        c = time.perf_counter()
        torch.autograd._get_sequence_nr()
        for p in params:
            use_count(p)
        ref()
        d = time.perf_counter()
        if n >= warm:
            made += a - t
            stamp += b - a
            signals += d - c
    search_ms, objects = _search_floor(run)
    run.close()
    figures = {
        "stamp_us": 1e6 * stamp / steps,
        "token_us": 1e6 * made / steps,
        "signals_us": 1e6 * signals / steps,
        "steps": steps,
        "search_ms": search_ms,
        "objects": objects,
    }
    timeline = _timeline_floor()
    if timeline is not None:
        figures["timeline_us"] = timeline
    return figures


def _timeline_floor(points: int = 200_000) -> float | None:
    """Microseconds per :meth:`Timeline.point` over ``points`` boundaries, the folding included; ``None`` for a
    gradguard that has no timeline (an older commit ``benchmarks.versus`` measures)."""
    try:
        from gradguard._watch.timeline import Timeline
    except ModuleNotFoundError:
        return None

    timeline = Timeline()
    point = timeline.point
    start = time.perf_counter()
    for i in range(points):
        point("micro", i >> 2, i, 1 << 30, 1000, 0.001 * i)
    return 1e6 * (time.perf_counter() - start) / points


def _search_floor(run: Fast) -> tuple[float, int]:
    """The least one search of the heap for a graph's holder costs in this process: one pass over the
    collector's objects that keeps the tensors, and one ``gc.get_referrers`` pass for a kept output (an
    audit makes at least one of each). Milliseconds, the best of three; and the objects the collector
    tracks."""
    out = run.model(torch.randn(64, 128, device=run.device))
    kinds = {torch.Tensor, torch.nn.Parameter}
    best, objects = float("inf"), 0
    for _ in range(3):
        start = time.perf_counter()
        found = gc.get_objects()
        objects = len(found)
        tensors = [o for o in found if type(o) in kinds]
        del found, tensors
        gc.get_referrers(out)
        best = min(best, time.perf_counter() - start)
    del out
    return 1e3 * best, objects
