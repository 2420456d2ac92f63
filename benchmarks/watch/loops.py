"""The training loops the benchmark watches, what they keep, and one run's figures.

Every run is ``gradguard.watch(mode="detach")`` with no other argument (``every="auto"``), or the same
steps unwatched. What a run keeps lives in :data:`PROGRAM`, a stand-in for the training script: gradguard
neither searches its own objects for holders nor repairs them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import sys
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradguard
from gradguard._tools.bench.late_leak import LateLeak
from gradguard._tools.bench.scenarios import Size
from gradguard._watch.allocated import AllocatedReader

__all__ = [
    "LEAKS",
    "PROGRAM",
    "Extra",
    "Fast",
    "Memory",
    "Micro",
    "fast_run",
    "frame_local_run",
    "late_run",
    "loop",
    "micro_run",
    "watch_figures",
]

PROGRAM = types.ModuleType("gradguard_watch_benchmark", "the training script of the benchmark's runs")
sys.modules[PROGRAM.__name__] = PROGRAM  # what the runs keep lives here: the program's state, not gradguard's


class Memory:
    """The bytes in use on the run's device after each step (glibc's in-use bytes on CPU, CUDA's allocated)."""

    def __init__(self, device: torch.device) -> None:
        self.read = AllocatedReader(cpu="mallinfo2" if device.type == "cpu" else "off", cuda=device.type == "cuda")
        self.key = "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"
        self.device = device

    def __call__(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.read().get(self.key, 0)


class Fast:
    """The fast step: an MLP 128 wide, batch 64, Adam (about half a millisecond on a CPU core); what the
    program keeps lives in ``state``, registered in :data:`PROGRAM` until :meth:`close`."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.device = device
        self.start = 0
        self.model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.state = types.SimpleNamespace(kept=[], buffer=[], running={"epoch_loss": 0.0}, total=0.0, grad_fns=[])
        self.name = f"run{id(self)}"
        vars(PROGRAM)[self.name] = self.state

    def step(self, extra: Extra, number: int) -> None:
        """One step: forward, backward, ``extra`` (what the program does with the step), optimizer step."""
        x = torch.randn(64, 128, device=self.device)
        out = self.model(x)
        loss = out.pow(2).mean()
        loss.backward()
        extra(self, number, loss, out)
        self.opt.step()
        self.opt.zero_grad()

    def close(self) -> None:
        """Drop the run's state from the program: what it kept is released."""
        vars(PROGRAM).pop(self.name, None)


class Micro:
    """Gradient accumulation: ``micro`` micro-batches a step (an MLP 128 wide, 3 layers, batch 64; about half a
    millisecond to one a micro-batch on a CPU core), each ``loss.backward()`` then ``loss.item()`` kept, then
    ``optimizer.step()``. ``seed``: the seed's shape besides: each micro-batch's input a leaf that requires
    grad (a pipeline stage's receive buffer: 32 KiB, and its gradient), its log-probabilities (256 B), graph
    attached, appended to ``output_lst`` after its backward, and the list cleared before the step. What the
    program keeps lives in ``state``, registered in :data:`PROGRAM` until :meth:`close`."""

    def __init__(self, device: torch.device, micro: int, seed: bool = False) -> None:
        torch.manual_seed(0)
        self.device, self.micro, self.seed = device, micro, seed
        self.model = nn.Sequential(
            nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 16)
        ).to(device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)
        self.state = types.SimpleNamespace(losses=[], output_lst=[])
        self.name = f"micro{id(self)}"
        vars(PROGRAM)[self.name] = self.state

    def microbatch(self, n: int) -> None:
        """Micro-batch ``n`` (from 1); the last of each step clears the records and steps the optimizer."""
        x = torch.randn(64, 128, device=self.device)
        if self.seed:
            x.requires_grad_(True)  # a pipeline stage's receive buffer: a leaf whose .grad the graph keeps
        logp = torch.log_softmax(self.model(x), -1)[:, 0]
        loss = -logp.mean() / self.micro
        loss.backward()
        self.state.losses.append(loss.item())
        if self.seed:
            self.state.output_lst.append({"model_output": {"log_probs": logp}})  # the bug: its graph with it
        if n % self.micro == 0:
            self.state.output_lst.clear()  # the engine's end of the mini-batch, before the step
            self.state.losses.clear()
            self.opt.step()
            self.opt.zero_grad()

    def step(self, number: int) -> None:
        """Step ``number`` (from 1): its ``micro`` micro-batches and the optimizer step."""
        for i in range(1, self.micro + 1):
            self.microbatch((number - 1) * self.micro + i)

    def close(self) -> None:
        vars(PROGRAM).pop(self.name, None)


def micro_run(device: torch.device, micro: int, steps: int, watched: bool) -> dict[str, Any]:
    """``steps`` steps of ``micro`` micro-batches of the seed's shape (after one clean warm-up step), memory read
    after each micro-batch: ``steps`` and ``memory`` count micro-batches, and ``reported_at`` (watched) is the
    micro-batch after which the watch's history first held a holder (1 is the first measured micro-batch)."""
    run = Micro(device, micro)
    run.step(1)  # warm-up, unwatched, clean
    run.seed = True
    memory = Memory(device)
    reported: list[int] = []

    def step(n: int) -> None:
        run.microbatch(n)
        if watched and not reported and _current_history():
            reported.append(n)

    out = loop(step, steps * micro, memory, watched, run.close)
    if watched:
        out["reported_at"] = reported[0] if reported else None
        out["micro_batches_a_step"] = micro
    return out


_SCOPES: list[Any] = []  # the watch scope of the run in progress (loop() sets it), for micro_run's reading


def _current_history() -> bool:
    return bool(_SCOPES and _SCOPES[-1].watcher.history())


Extra = Callable[[Fast, int, torch.Tensor, torch.Tensor], None]
"""What the program does with a step: ``(run, step number, loss, output)``, after the backward."""

LEAKS: dict[str, Extra] = {}
"""The programs by name: leaks, clean runs and the cost storms."""


def _program(name: str) -> Callable[[Extra], Extra]:
    def register(fn: Extra) -> Extra:
        LEAKS[name] = fn
        return fn

    return register


def _eval_forward(run: Fast) -> None:
    run.state.kept.append(run.model(torch.randn(64, 128, device=run.device)))  # no torch.no_grad(): the bug


@_program("clean")
def _clean(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    pass


@_program("eval-forward")
def _eval_from(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    if step >= run.start:
        _eval_forward(run)


@_program("growth-then-leak")
def _growth_then_leak(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    if step <= 300:
        run.state.buffer.append(torch.randn(64, 128, device=run.device))  # detached: legitimate growth
    if step >= run.start:
        _eval_forward(run)


@_program("sawtooth")
def _sawtooth(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    run.state.buffer.append(torch.randn(64, 128, device=run.device))
    if step % 50 == 0:
        run.state.buffer.clear()


@_program("running-loss")
def _running_loss(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    run.state.running["epoch_loss"] += loss  # the bug: the loss with its graph


@_program("metric")
def _metric(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    run.state.total = run.state.total + (out - 1).pow(2).sum()  # the bug: the output's graph, every step


@_program("kept-exception")
def _kept_exception(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    try:
        raise ValueError(f"step {step}: a caught, kept exception")
    except ValueError as e:
        last = e  # noqa: F841  the frame holds it, its traceback the frame: a cycle that holds ``out``


@_program("cycles")
def _cycles(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    a: dict[str, Any] = {}
    a["self"] = a
    a["out"] = out  # held, with its graph, until the collector runs


@_program("gc-off")
def _gc_off(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    _cycles(run, step, loss, out)
    if step % 50 == 0:
        gc.collect()  # the program's manual collection (the run disables the collector)


@_program("grad-fn-kept")
def _grad_fn_kept(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    run.state.grad_fns.append(loss.grad_fn)  # nodes no tensor holds


@functools.cache
def _worker() -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread, made at the first use."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gradguard-watch-benchmark")


@_program("thread-backward")
def _thread_backward(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
    if step >= run.start:
        extra = run.model(torch.randn(64, 128, device=run.device)).pow(2).mean()
        _worker().submit(extra.backward).result()  # an auxiliary loss backwarded in a worker thread
        run.state.kept.append(extra)  # the bug: kept with its graph


class _Trainer:
    """A trainer a function makes and keeps in its local while it trains (``trainer = Trainer()`` in
    ``main()``): its ``history`` is reached from that running frame only."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.history: list[torch.Tensor] = []

    def keep(self, run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
        if step >= self.start:
            self.history.append(loss)  # the bug: the loss with its graph


def _warmed(device: torch.device, start: int) -> tuple[Fast, Memory]:
    """A fast run whose leak starts at ``start``, after 3 warm-up steps, and its memory reader."""
    run = Fast(device)
    run.start = start
    for _ in range(3):  # warm-up, unwatched, before the run's state exists: lazy initialisation
        run.step(_clean, 0)
    return run, Memory(device)


def frame_local_run(device: torch.device, steps: int, start: int, watched: bool) -> dict[str, Any]:
    """``steps`` fast steps whose losses from ``start`` go into the history of a trainer held by this
    function's local (after 3 warm-up steps)."""
    run, memory = _warmed(device, start)
    trainer = _Trainer(start)
    return loop(functools.partial(run.step, trainer.keep), steps, memory, watched, run.close)


def fast_run(device: torch.device, leak: str, steps: int, start: int, watched: bool) -> dict[str, Any]:
    """``steps`` fast steps of program ``leak`` (from step ``start`` where it starts), after 3 warm-up steps."""
    run, memory = _warmed(device, start)
    return loop(lambda n: run.step(LEAKS[leak], n), steps, memory, watched, run.close)


def late_run(
    name: str, device: torch.device, steps: int, start: int | None, watched: bool, micro_batches: int
) -> dict[str, Any]:
    """``steps`` steps of ``gradguard bench``'s scenario ``name`` that keep each step's loss from ``start``."""
    run = LateLeak(name, device, Size(), start=start, micro_batches=micro_batches)
    memory = Memory(device)
    with run.scope():
        for _ in range(2):
            run.step()  # warm-up
        run.start = None if start is None else start + 2  # count the leak's start from the measured steps
        return loop(lambda n: run.step(), steps, memory, watched, run.close)


def loop(
    step: Callable[[int], object], steps: int, memory: Memory, watched: bool, close: Callable[[], None]
) -> dict[str, Any]:
    """Run ``step(1..steps)``, reading ``memory`` after each: ``steps``, ``wall_s``, ``memory`` and, when
    ``watched``, :func:`watch_figures`."""
    gc.collect()
    figures: list[int] = []
    scope = gradguard.watch(mode="detach") if watched else contextlib.nullcontext()
    _SCOPES.append(scope)
    start = time.perf_counter()
    try:
        with scope:
            for n in range(1, steps + 1):
                step(n)
                figures.append(memory())
    finally:
        _SCOPES.pop()
    wall = time.perf_counter() - start
    out: dict[str, Any] = {"steps": steps, "wall_s": wall, "memory": figures}
    if watched:
        out.update(watch_figures(scope.watcher, wall))  # type: ignore[union-attr]
    close()
    gc.collect()
    return out


def watch_figures(w: Any, wall: float) -> dict[str, Any]:
    """What a watcher did in a run of ``wall`` seconds, by the governor's account (no timer of the
    benchmark's own around the watch's code: it would add its cost).

    ``share_after_start``: the watch's whole time after the start-up check (audits, reads, repairs,
    stamps and signals) over the wall time after it; ``own_share``: ``own_seconds`` over the wall time;
    ``stamp_us``: microseconds per backward's roots stamped; ``below_us``: microseconds per backward of
    stamping below the roots (when due: a share of the wall time); ``boundary_us``: microseconds of the
    constant-time work per boundary, the memory readings aside; ``read_us``: microseconds of memory
    reading per boundary (a reading is due by time, within its share of the wall time: on a long step,
    at every boundary)."""
    g = w._governor
    history = w.history()
    after = max(wall - g.startup, 1e-9)
    return {
        "reported_at": min((e.found_at for e in history), default=None),
        "holders": [(e.holder, e.outcome) for e in history],
        "audits": w.audits,
        "searches": w.searches,
        "memory_audits": w.memory_audits,
        "boundaries": w.boundaries,
        "backwards": g.backwards,
        "audit_s": w.audit_seconds,
        "read_s": w.read_seconds,
        "startup_s": g.startup,
        "spent_s": g.spent,
        "stamping_s": g.stamping,
        "below_s": g.below,
        "signals_s": g.signals,
        "own_s": w.own_seconds,
        "own_share": w.own_seconds / max(wall, 1e-9),
        "share_after_start": (g.spent + g.hot) / after,
        "stamp_us": 1e6 * g.stamping / max(1, g.backwards),
        "below_us": 1e6 * g.below / max(1, g.backwards),
        "boundary_us": 1e6 * (g.signals - w.read_seconds) / max(1, w.boundaries),
        "read_us": 1e6 * w.read_seconds / max(1, w.boundaries),
        "summary": w.summary(),
    }
