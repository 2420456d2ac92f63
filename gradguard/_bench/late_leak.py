"""A clean training run that starts leaking at a given step: the late leak the memory trigger must catch.

:class:`LateLeak` wraps one of the bench's scenarios in a training loop. A *step* is ``micro_batches``
micro-batches of the scenario's guarded path (inside ``gradguard.enforce(mode="detach")``; the records
are kept in the step's store and dropped when the step ends, as the engines do), then
``optimizer.step()`` (the step boundary) and ``zero_grad``. Until step ``start`` the loop is clean. From
step ``start`` on (steps count from 1), each step also appends to ``history``, an attribute of the
trainer as a logging branch or an evaluation callback would keep it, a loss whose backward has already
run through a fresh leaf: the graph is dead (nothing can backward through it again), and it pins the
leaf and its ``.grad``, ``bytes_per_step`` together. That is the shape of the field's leak (a record
of a backwarded micro-batch keeps its receive buffer and the buffer's gradient), at a size that does
not depend on the scenario's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import gradguard

from .._errors import GradGuardError
from .scenarios import Size, build

__all__ = ["LateLeak"]


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
        bytes_per_step: int = 256 * 1024,
        micro_batches: int = 1,
    ) -> None:
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 1):
            raise GradGuardError(f"start={start!r} is not accepted; accepted: a step number >= 1, or None")
        if (
            isinstance(bytes_per_step, bool)
            or not isinstance(bytes_per_step, int)
            or bytes_per_step < 8
            or bytes_per_step % 8
        ):
            raise GradGuardError(f"bytes_per_step={bytes_per_step!r} is not accepted; accepted: a multiple of 8 >= 8")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise GradGuardError(f"micro_batches={micro_batches!r} is not accepted; accepted: a whole number >= 1")
        self.device = torch.device(device)
        self.scenario = build(name, self.device, size or Size())
        self.start = start
        self.bytes_per_step = bytes_per_step
        self.micro_batches = micro_batches
        self.optimizer = torch.optim.SGD([p for p in self.scenario.model.parameters() if p.requires_grad], lr=1e-4)
        self.history: list[dict[str, Any]] = []
        self.steps = 0
        self._microbatch = 0

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
