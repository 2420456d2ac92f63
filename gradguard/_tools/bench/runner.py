"""Run each scenario unguarded and guarded, side by side, and collect the numbers of the JSON schema."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import gradguard

from ..meter import MemoryMeter, slope
from .scenarios import Size, build

__all__ = ["grads_equal", "run_scenario"]


class _MemoryCapReached(Exception):
    """Raised from a reading above the memory cap: it unwinds the run (an engine's loop included)."""


def _one_run(
    name: str,
    device: torch.device,
    size: Size,
    micro_batches: int,
    guarded: bool,
    tick: Callable[[], None],
    memory_cap: int | None = None,
) -> tuple[dict[str, Any], list[torch.Tensor | None], tuple[int, int]]:
    scenario = build(name, device, size)
    # warm-up (lazy initialisation), outside the measurement
    if scenario.run is not None:
        scenario.run(2, False, lambda: None)
    else:
        scenario.step(micro_batches, [], guarded)
    for p in scenario.model.parameters():
        p.grad = None
    allocated: list[int] = []
    times: list[float] = []
    start = 0.0

    def after_microbatch() -> None:
        nonlocal start
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        allocated.append(meter.read())
        tick()
        if memory_cap is not None and allocated[-1] > memory_cap:
            raise _MemoryCapReached
        start = time.perf_counter()

    engines = list(scenario.engines) if guarded and scenario.engines else "none"
    stopped = False
    # Each reading collects garbage: freezing what exists (an engine's import leaves ~400k objects)
    # keeps that collection to what the run creates.
    gc.collect()
    gc.freeze()
    try:
        # The guarded run pins the mode, so a GRADGUARD in the environment cannot turn it into another one.
        with MemoryMeter(device) as meter, gradguard.enforce(mode="detach" if guarded else "off", engines=engines):
            meter.read()
            try:
                if scenario.run is not None:
                    start = time.perf_counter()
                    store = scenario.run(micro_batches, guarded, after_microbatch)
                else:
                    store = scenario.new_store(guarded)
                    for i in range(micro_batches):
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        start = time.perf_counter()
                        scenario.step(i, store, guarded)
                        after_microbatch()
            except _MemoryCapReached:
                store, stopped = None, True
            run = {
                "micro_batches": micro_batches,
                "growth_bytes_per_microbatch": slope(allocated),
                "peak_bytes": meter.peak(),
                "allocated_bytes": allocated,
                "step_time_median_s": statistics.median(times),
            }
            if stopped:
                run["stopped_at_microbatch"] = len(allocated)
                run["memory_cap_bytes"] = memory_cap
            grads = [p.grad.detach().clone() if p.grad is not None else None for p in scenario.model.parameters()]
            del store
    finally:
        gc.unfreeze()
    expected = (scenario.expected_pinned_bytes_per_microbatch, scenario.record_bytes_per_microbatch)
    return run, grads, expected


def run_scenario(
    name: str,
    device: torch.device,
    size: Size,
    micro_batches: int,
    tick: Callable[[], None] = lambda: None,
    memory_cap: int | None = None,
) -> dict[str, Any]:
    """Both runs of one scenario and what they are compared against, as the JSON schema has it.

    ``memory_cap``: a run whose reading exceeds it stops there (``stopped_at_microbatch`` and
    ``memory_cap_bytes`` in its figures); the gradients are then not compared (``grads_equal`` None).
    """
    unguarded, grads_u, (pinned, record) = _one_run(name, device, size, micro_batches, False, tick, memory_cap)
    guarded, grads_g, _ = _one_run(name, device, size, micro_batches, True, tick, memory_cap)
    return {
        "expected_pinned_bytes_per_microbatch": pinned,
        "record_bytes_per_microbatch": record,
        "grads_equal": grads_equal((unguarded, grads_u), (guarded, grads_g)),
        "unguarded": unguarded,
        "guarded": guarded,
    }


def grads_equal(*runs: tuple[dict[str, Any], list[torch.Tensor | None]]) -> bool | None:
    """Whether the runs' gradients (each run's figures and gradients) are bitwise equal; ``None`` when a run
    stopped at the memory cap (its gradients are not the whole mini-batch's)."""
    if any("stopped_at_microbatch" in figures for figures, _ in runs):
        return None
    (_, first), *others = runs
    return all(len(grads) == len(first) and all(map(_same, first, grads)) for _, grads in others)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Both ``None``, or both tensors equal bitwise."""
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
