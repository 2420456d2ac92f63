"""Honest memory readings: exact live tensor bytes on CPU, the caching allocator's count on CUDA.

CPU: a ``TorchDispatchMode`` keeps a weak reference to every tensor an operator returns while it is
active; a reading sums the storages (each once) of those still alive. A tensor's Python object lives
as long as C++ holds the tensor (saved for backward, held by a graph node), so liveness of the
weak reference is liveness of the tensor. Resident set size is never used: glibc's allocator keeps
freed pages, so RSS lies both ways. Only tensors created inside the meter are seen; the peak on CPU
is the largest reading taken, not an allocator high-water mark.

CUDA: ``torch.cuda.memory_allocated()`` after a synchronize; the peak is
``torch.cuda.max_memory_allocated()`` since the meter was entered.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MemoryMeter", "slope", "storage_bytes"]


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an iterable of tensors)."""
    seen: dict[tuple[Any, int], int] = {}
    for t in tensors:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            seen[("tensor", id(t))] = t.numel() * t.element_size()
            continue
        if storage.data_ptr():
            seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def slope(values: list[int]) -> float:
    """Least-squares slope of ``values`` against their index (bytes per micro-batch)."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


class _LiveTensors(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.refs.append(weakref.ref(out))
        elif isinstance(out, (tuple, list)):
            self.refs.extend(weakref.ref(t) for t in out if isinstance(t, torch.Tensor))
        return out

    def live_bytes(self) -> int:
        alive = [(r, t) for r in self.refs if (t := r()) is not None]
        self.refs = [r for r, _ in alive]
        return storage_bytes(t for _, t in alive)


class MemoryMeter:
    """``with MemoryMeter(device) as m: ...; m.read()`` — live bytes now; ``m.peak()`` — the peak.

    ``device`` is ``"cpu"`` (exact live tensor bytes, see the module docstring) or ``"cuda"``.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"MemoryMeter measures 'cpu' or 'cuda', not {self.device}")
        self._mode: _LiveTensors | None = None
        self._peak = 0

    def __enter__(self) -> MemoryMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = _LiveTensors()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc_info)

    def read(self) -> int:
        """Live bytes now (collects garbage first, so unreachable cycles are not counted)."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            value = torch.cuda.memory_allocated(self.device)
        else:
            assert self._mode is not None, "read() outside the meter's with block"
            value = self._mode.live_bytes()
        self._peak = max(self._peak, value)
        return value

    def peak(self) -> int:
        """CUDA: the allocator's high-water mark; CPU: the largest reading taken."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return self._peak
