"""The no-adapter scenario: the seed's engine with no adapter, where only the watch stands between it and the growth.

The engine is the seed preset's (``pp-last-stage``: Megatron's last stage, a fresh receive buffer per
micro-batch, a checkpointed block, a loss, a backward); it publishes each micro-batch's record
(``{"loss", "model_output": {"log_probs", "entropy"}}``, graph attached) into a plain list,
``self.forward_data_store``, and clears it after the last micro-batch, before ``optimizer.step()``. No
``guard()``, no ``@forward_step``, no engine adapter: the runs are set up as ``gradguard run`` sets a
process up, ``enforce()`` (no engine adapter) and ``watch()``, in one mode each:

* ``unwatched``: the mode ``off``, no watch: the growth per micro-batch, unguarded;
* ``detach``: memory per micro-batch, the micro-batch the watch reported the store at, and the growth per
  micro-batch after that report (the records' own bytes: the graphs are repaired at each boundary);
* ``raise``: the micro-batch whose ``backward()`` raised, and the holder the error names;
* ``warn``: the micro-batch the first warning came at, and how many came.

The gradients of the unwatched and the ``detach`` runs are compared bitwise.
"""

from __future__ import annotations

import gc
import statistics
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

import gradguard

from ..meter import MemoryMeter, slope
from .late_leak import _program
from .runner import grads_equal
from .scenarios import Size, build

__all__ = ["ENGINE", "LEAST", "MODES", "REPORT_WITHIN", "run_no_adapter"]

ENGINE = "pp-last-stage"
"""The scenario whose engine runs without an adapter (the seed preset's)."""

MODES = ("unwatched", "detach", "raise", "warn")

REPORT_WITHIN = 4
"""The micro-batch by which the watch reports the store (this engine publishes a record before its backward:
the store is raised at its fourth)."""

LEAST = REPORT_WITHIN + 4
"""The fewest micro-batches a run needs: the report, and four more to fit the growth after it."""


def _first_line(text: str) -> str:
    """The message's opening sentence (its lines up to the one that ends with the colon before the holders),
    as one line."""
    lines = text.strip().splitlines()
    end = next((i for i, line in enumerate(lines) if line.rstrip().endswith(":")), len(lines) - 1)
    return " ".join(line.strip() for line in lines[: end + 1])


def _one_run(
    mode: str,
    device: torch.device,
    size: Size,
    micro_batches: int,
    tick: Callable[[], None],
    memory_cap: int | None,
) -> tuple[dict[str, Any], list[torch.Tensor | None], tuple[int, int]]:
    scenario = build(ENGINE, device, size)
    scenario.step(micro_batches, [], False)  # warm-up (lazy initialisation), outside the measurement
    for p in scenario.model.parameters():
        p.grad = None
    opt = torch.optim.SGD([p for p in scenario.model.parameters() if p.requires_grad], lr=1e-3)
    allocated: list[int] = []
    times: list[float] = []
    reported_at: int | None = None
    error: str | None = None
    said: list[str] = []
    stopped = False
    # No gc.freeze() here, unlike the other scenarios' runs: the watch searches the collector's objects for
    # a graph's holder, and a frozen object (this function's frame among them) is not one of them.
    gc.collect()
    watched = mode != "unwatched"
    if True:
        # The engine's state lives in a stand-in for the training script, as the late-leak runs' does:
        # gradguard neither searches its own modules and frames for holders nor repairs its own objects.
        engine = types.SimpleNamespace(forward_data_store=[])
        vars(_program())["engine"] = engine
        with (
            MemoryMeter(device) as meter,
            warnings.catch_warnings(record=True) as caught,
            gradguard.enforce(mode=mode if watched else "off", engines="none"),
        ):
            warnings.simplefilter("always")
            scope = gradguard.watch(mode=mode) if watched else None
            meter.read()
            try:
                if scope is not None:
                    scope.__enter__()
                for i in range(micro_batches):
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    start = time.perf_counter()
                    try:
                        scenario.step(i, engine.forward_data_store, False)
                    except gradguard.GraphRetentionError as exc:
                        reported_at, error = i + 1, str(exc)
                        break
                    finally:
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        times.append(time.perf_counter() - start)
                        allocated.append(meter.read())
                        tick()
                    if reported_at is None and scope is not None:
                        if scope.watcher.history() or any(
                            issubclass(w.category, gradguard.GraphRetentionWarning) for w in caught
                        ):
                            reported_at = i + 1
                    if memory_cap is not None and allocated[-1] > memory_cap:
                        stopped = True
                        break
                grads = [p.grad.detach().clone() if p.grad is not None else None for p in scenario.model.parameters()]
                engine.forward_data_store.clear()  # the engine's end of the mini-batch, before the step
                opt.step()
                opt.zero_grad()
            finally:
                if scope is not None:
                    scope.__exit__(None, None, None)
            said = [str(w.message) for w in caught if issubclass(w.category, gradguard.GraphRetentionWarning)]
            history = [] if scope is None else scope.watcher.history()
            run: dict[str, Any] = {
                "micro_batches": micro_batches,
                "growth_bytes_per_microbatch": slope(allocated),
                "peak_bytes": meter.peak(),
                "allocated_bytes": allocated,
                "step_time_median_s": statistics.median(times) if times else 0.0,
            }
            if watched:
                run["reported_at_microbatch"] = reported_at
                run["holders"] = [[e.holder, e.outcome, e.clock] for e in history]
                after = allocated[reported_at:] if reported_at is not None else []
                run["growth_after_report_bytes_per_microbatch"] = slope(after) if len(after) >= 2 else None
            if mode == "raise":
                run["error"] = _first_line(error or "")
            if mode == "warn":
                run["warnings"] = len(said)
                run["warning"] = _first_line(said[0]) if said else ""
            if stopped:
                run["stopped_at_microbatch"] = len(allocated)
                run["memory_cap_bytes"] = memory_cap
            vars(_program()).pop("engine", None)
            del engine
    expected = (scenario.expected_pinned_bytes_per_microbatch, scenario.record_bytes_per_microbatch)
    return run, grads, expected


def run_no_adapter(
    device: torch.device,
    size: Size,
    micro_batches: int,
    tick: Callable[[], None] = lambda: None,
    memory_cap: int | None = None,
) -> dict[str, Any]:
    """The four runs of the no-adapter scenario (:data:`MODES`) and what they are compared against.

    ``memory_cap``: a run whose reading exceeds it stops there (``stopped_at_microbatch``); the gradients
    are then not compared (``grads_equal`` None).
    """
    runs: dict[str, Any] = {}
    grads: dict[str, list[torch.Tensor | None]] = {}
    pinned = record = 0
    for mode in MODES:
        runs[mode], grads[mode], (pinned, record) = _one_run(mode, device, size, micro_batches, tick, memory_cap)
    return {
        "kind": "no-adapter",
        "engine": ENGINE,
        "expected_pinned_bytes_per_microbatch": pinned,
        "record_bytes_per_microbatch": record,
        "grads_equal": grads_equal(*((runs[mode], grads[mode]) for mode in ("unwatched", "detach"))),
        **runs,
    }
