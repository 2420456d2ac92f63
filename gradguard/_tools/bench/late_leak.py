"""A clean training run that starts leaking at a given step: the late leak the memory trigger must catch.

:class:`LateLeak` wraps one of the bench's scenarios in a training loop. A *step* is ``micro_batches``
micro-batches of the scenario's guarded path (inside ``gradguard.enforce(mode="detach")``; the records
are kept in the step's store and dropped when the step ends, as the engines do), then
``optimizer.step()`` (the step boundary) and ``zero_grad``. Until step ``start`` the loop is clean. From
step ``start`` on (steps count from 1), each step also appends to ``history``, the state of the
trainer as a logging branch or an evaluation callback would keep it, a loss whose backward has already
run through a fresh leaf: the graph is dead (nothing can backward through it again), and it pins the
leaf and its ``.grad``, ``bytes_per_step`` together. That is the shape of the field's leak (a record
of a backwarded micro-batch keeps its receive buffer and the buffer's gradient), at a size that does
not depend on the scenario's.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

import gradguard

from ..._policy import validate
from ..._watch.allocated import AllocatedReader
from .scenarios import Size, build

__all__ = ["BYTES_PER_STEP", "PROGRAM", "LateLeak", "run_late_leak"]

PROGRAM = "gradguard_bench_program"
"""The module that stands for the training script whose state a run keeps."""

_runs = itertools.count(1)


def _program() -> types.ModuleType:
    module = sys.modules.get(PROGRAM)
    if not isinstance(module, types.ModuleType):
        module = sys.modules[PROGRAM] = types.ModuleType(PROGRAM, "the training script of gradguard bench's runs")
    return module


BYTES_PER_STEP = 256 * 1024
"""What each leaking step pins by default: the issue's 256 KiB leak."""


class LateLeak:
    """Scenario ``name`` on ``device`` in a training loop that starts leaking at step ``start``.

    ``start=None`` never leaks. ``bytes_per_step``: what each leaking step pins (a positive multiple of
    8: a float32 leaf of half of it and its gradient). ``step()`` runs one training step and returns its
    number; ``steps`` is how many ran; ``history`` holds what leaked. Run the steps inside ``scope()``
    (the guarded path's ``enforce``), which also lets the optimizer step hooks of a watch see them.
    A bad ``start``, ``bytes_per_step`` or ``micro_batches`` is a :class:`GradGuardError`.
    """

    def __init__(
        self,
        name: str,
        device: torch.device | str = "cpu",
        size: Size | None = None,
        *,
        start: int | None,
        bytes_per_step: int = BYTES_PER_STEP,
        micro_batches: int = 1,
    ) -> None:
        if start is not None:
            validate.whole(start, what="start", least=1, accepted="a step number >= 1, or None", text=False)
        if (
            isinstance(bytes_per_step, bool)
            or not isinstance(bytes_per_step, int)
            or bytes_per_step < 8
            or bytes_per_step % 8
        ):
            raise validate.refusal("bytes_per_step", bytes_per_step, "a multiple of 8 >= 8")
        validate.whole(micro_batches, what="micro_batches", least=1, text=False)
        self.device = torch.device(device)
        self.scenario = build(name, self.device, size or Size())
        self.start = start
        self.bytes_per_step = bytes_per_step
        self.micro_batches = micro_batches
        self.optimizer = torch.optim.SGD([p for p in self.scenario.model.parameters() if p.requires_grad], lr=1e-4)
        # What the program keeps lives in a stand-in for its training script: gradguard neither
        # searches its own objects for holders nor repairs them, and would find no leak of its own.
        self.name = f"run{next(_runs)}"
        self._state = types.SimpleNamespace(history=[])
        vars(_program())[self.name] = self._state
        weakref.finalize(self, vars(_program()).pop, self.name, None)  # a run dropped without close()
        self.steps = 0
        self._microbatch = 0

    @property
    def history(self) -> list[dict[str, Any]]:
        """What leaked: the records of the leaking steps (``program:runN.history``)."""
        return self._state.history  # type: ignore[no-any-return]

    def close(self) -> None:
        """Drop the run's state from the stand-in program: what it kept is released."""
        vars(_program()).pop(self.name, None)
        self._state.history.clear()

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """The guarded path's scope: ``gradguard.enforce(mode="detach")`` with the scenario's engines."""
        return gradguard.enforce(mode="detach", engines=list(self.scenario.engines) or "none", audit=0)

    def step(self) -> int:
        """One training step (see the module documentation); its number, from 1."""
        self.steps += 1
        scenario = self.scenario
        if self.start is not None and self.steps >= self.start:
            self._leak()
        if scenario.run is not None:
            scenario.run(self.micro_batches, True, lambda: None)
        else:
            store = scenario.new_store(True)
            for _ in range(self.micro_batches):
                scenario.step(self._microbatch, store, True)
                self._microbatch += 1
            del store
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.steps

    def _leak(self) -> None:
        leaf = torch.randn(self.bytes_per_step // 8, device=self.device, requires_grad=True)
        loss = (leaf * leaf).mean()
        loss.backward()
        self.history.append({"step": self.steps, "loss": loss})


def run_late_leak(
    name: str,
    device: torch.device,
    size: Size,
    *,
    start: int,
    steps: int,
    clean_steps: int,
    micro_batches: int = 4,
    tick: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """The late-leak measurement of one scenario, as ``gradguard bench --late-leak`` reports it.

    A step is ``micro_batches`` micro-batches and the optimizer's step, as with gradient
    accumulation.

    * ``unwatched`` / ``watched``: ``steps`` steps of a run that starts leaking at ``start``, without
      and inside ``gradguard.watch(mode="detach")`` (``every="auto"``: the memory trigger and the
      backstop): the memory figure after each step (``memory``), and, watched, the step at which an
      audit found the leak (``reported_at``), what the watch did (``outcome``), its audits (and how
      many the memory trigger asked for).
    * ``clean``: ``clean_steps`` clean steps, unwatched then watched (each after a short warm-up):
      their wall times, the watch's own accounting of its audits and readings (``share``: of the
      watched run's wall time), and how many audits the backstop and the trigger made.

    The figure is the watch's own (:class:`gradguard._watch.allocated.AllocatedReader`: glibc's in-use
    bytes on CPU, the caching allocator's allocated bytes on CUDA), read by the bench after each step.
    """
    reader = AllocatedReader(cuda=device.type == "cuda")
    figure = "cuda:0" if device.type == "cuda" else "cpu"

    def leaking(watched: bool) -> dict[str, Any]:
        run = LateLeak(name, device, size, start=start, micro_batches=micro_batches)
        memory: list[int] = []
        watching = gradguard.watch(mode="detach") if watched else contextlib.nullcontext()
        with run.scope(), watching:
            for _ in range(steps):
                run.step()
                memory.append(reader().get(figure, 0))
                tick()
        out: dict[str, Any] = {"memory": memory}
        if watched:
            watcher = watching.watcher  # type: ignore[union-attr]
            found = [e for e in watcher.history() if e.holder.endswith(".history[*]['loss']")]
            out.update(
                reported_at=found[0].found_at if found else None,
                outcome=found[0].outcome if found else None,
                holder=found[0].holder if found else None,
                audits=watcher.audits,
                memory_audits=watcher.memory_audits,
            )
        run.close()
        gc.collect()
        return out

    def clean(watched: bool) -> dict[str, Any]:
        run = LateLeak(name, device, size, start=None, micro_batches=micro_batches)
        with run.scope():
            for _ in range(_WARMUP):
                run.step()
        watching = gradguard.watch(mode="detach") if watched else contextlib.nullcontext()
        with run.scope(), watching:
            began = time.perf_counter()
            for _ in range(clean_steps):
                run.step()
                tick()
            wall = time.perf_counter() - began
        out: dict[str, Any] = {"wall_s": wall, "step_s": wall / clean_steps}
        if watched:
            watcher = watching.watcher  # type: ignore[union-attr]
            spent = watcher.audit_seconds + watcher.read_seconds
            out.update(
                audits=watcher.audits,
                memory_audits=watcher.memory_audits,
                backstop_audits=watcher.audits - watcher.memory_audits,
                audit_s=watcher.audit_seconds,
                read_s=watcher.read_seconds,
                share=spent / wall,
                holders=len(watcher.history()),
            )
        run.close()
        gc.collect()
        return out

    unwatched, watched = leaking(False), leaking(True)
    plain, kept = clean(False), clean(True)
    return {
        "leak_start": start,
        "steps": steps,
        "bytes_per_step": BYTES_PER_STEP,
        "micro_batches": micro_batches,
        "figure": reader.describe(),
        "unwatched": unwatched,
        "watched": watched,
        "clean": {"steps": clean_steps, "unwatched": plain, "watched": kept},
    }


_WARMUP = 20
