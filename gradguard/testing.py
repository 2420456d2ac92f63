"""Assertions and probes for leak tests: a few lines instead of weakrefs, hand-built models and AST scans.

from gradguard.testing import MemoryProbe, assert_no_graph, assert_released

with MemoryProbe() as probe:
    for mb in range(8):
        output_lst.append(engine.forward_step(batch)[1])
        probe.step()
probe.assert_growth_below(64 * 1024)   # bytes per micro-batch
assert_no_graph(output_lst)
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from ._tools.meter import MemoryMeter, slope
from ._tree.walk import find_graphs
from ._watch.audit import Ignore, audit

__all__ = ["MemoryProbe", "assert_no_graph", "assert_no_retention", "assert_released"]


def assert_no_retention(*, ignore: Ignore = None) -> None:
    """Audit the whole process now (:func:`gradguard.audit`): fail when any live autograd graph is held.

    Call it where no graph should be alive: after ``optimizer.step()``, with the step's own ``loss``
    deleted (or ignored: ``ignore="tests/test_train.py"`` for the test's frame locals).

    Args:
        ignore: Graphs kept on purpose, as for :func:`gradguard.audit`.

    Raises:
        AssertionError: a live graph is held; the message is the audit's table.
        GradGuardError: a bad ``ignore``, naming it.
    """
    report = audit(ignore=ignore)
    if len(report):
        raise AssertionError(f"live autograd graphs are still held:\n{report}")


def assert_no_graph(obj: object, what: str = "object") -> None:
    """Fail when ``obj`` holds a tensor that still carries ``grad_fn``.

    Looks where :func:`gradguard.find_graphs` looks.

    Args:
        obj: Any object: a record, a store, a container of tensors.
        what: What ``obj`` is, in the message.

    Raises:
        AssertionError: listing every such tensor, by path, ``grad_fn``, shape and dtype.
    """
    graphs = find_graphs(obj)
    if graphs:
        lines = "\n".join(
            f"  {g.path or '<the object itself>'}: {g.grad_fn}, shape={g.shape}, {g.dtype}" for g in graphs
        )
        raise AssertionError(f"{what} holds {len(graphs)} tensor(s) carrying an autograd graph:\n{lines}")


def assert_released(refs: weakref.ref[Any] | Iterable[weakref.ref[Any]], what: str = "object") -> None:
    """After a ``gc.collect()``, fail unless every weak reference is dead.

    Args:
        refs: ``weakref.ref(tensor)``, or an iterable of weak references. A tensor passed itself
            would be kept alive by the call, so it is refused.
        what: What the references point to, in the message.

    Raises:
        AssertionError: some referents are still alive, naming how many and their indices.
        TypeError: ``refs`` is a tensor, or an item is not a ``weakref.ref``.
    """
    if isinstance(refs, torch.Tensor):
        raise TypeError(
            "assert_released needs weakref.ref(tensor), not the tensor: the argument itself would keep "
            "the tensor alive. Take the weak reference where the tensor is created, drop your own "
            "references, then call assert_released(ref)."
        )
    items = [refs] if isinstance(refs, weakref.ref) else list(refs)
    for i, ref in enumerate(items):
        if not isinstance(ref, weakref.ref):
            raise TypeError(f"assert_released: item {i} is a {type(ref).__qualname__}, not a weakref.ref")
    gc.collect()
    alive = [i for i, ref in enumerate(items) if ref() is not None]
    if alive:
        raise AssertionError(
            f"{len(alive)} of {len(items)} {what}(s) still alive after gc.collect() (indices {alive[:20]}); "
            "something still references them: a kept record with grad_fn pins its graph's leaves"
        )


class MemoryProbe:
    """Live bytes after each iteration, and their growth per iteration (least-squares slope).

    Call :meth:`step` at the end of each iteration. Use it as a context manager, or through the
    ``gradguard_probe`` pytest fixture.

    Args:
        device: What to measure. ``"cpu"``: the exact live bytes of the tensors created inside the
            probe (as ``gradguard bench`` measures); a CUDA device: ``torch.cuda.memory_allocated()``
            after a synchronize.

    Attributes:
        readings: The readings so far, in bytes: one on entering, then one per :meth:`step`.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self._meter = MemoryMeter(device)
        self.readings: list[int] = []

    def __enter__(self) -> MemoryProbe:
        self._meter.__enter__()
        self.readings = [self._meter.read()]
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._meter.__exit__(*exc_info)

    def _entered(self, what: str) -> None:
        if not self.readings:
            raise RuntimeError(
                f"MemoryProbe.{what}() before the probe was entered: use `with MemoryProbe() as probe:` "
                "(or the gradguard_probe pytest fixture), then call probe.step() once per iteration"
            )

    def step(self) -> int:
        """Take a reading now, at the end of an iteration.

        Returns:
            The reading, in bytes (also appended to :attr:`readings`).

        Raises:
            RuntimeError: the probe was not entered.
        """
        self._entered("step")
        value = self._meter.read()
        self.readings.append(value)
        return value

    @property
    def growth_per_step(self) -> float:
        """Bytes per iteration: the least-squares slope of the readings after each :meth:`step`."""
        return slope(self.readings[1:])

    @property
    def peak(self) -> int:
        """CUDA: the allocator's peak since entering; CPU: the largest reading."""
        return self._meter.peak()

    def assert_growth_below(self, max_bytes_per_step: float) -> None:
        """Fail when memory grew more than ``max_bytes_per_step`` per iteration.

        Args:
            max_bytes_per_step: The most growth per iteration that passes, in bytes
                (:attr:`growth_per_step` is compared with it).

        Raises:
            AssertionError: it grew more, or fewer than 2 :meth:`step` readings were taken.
            RuntimeError: the probe was not entered.
        """
        self._entered("assert_growth_below")
        if len(self.readings) < 3:
            raise AssertionError(
                f"MemoryProbe needs at least 2 step() readings to measure growth, has {len(self.readings) - 1}"
            )
        growth = self.growth_per_step
        if growth > max_bytes_per_step:
            raise AssertionError(
                f"memory grew {growth:,.0f} bytes per iteration over {len(self.readings) - 1} iterations "
                f"(limit {max_bytes_per_step:,.0f}); readings: {self.readings[1:][:10]}"
            )
