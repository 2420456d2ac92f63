"""Bytes in use per device, read at each step boundary for a small fraction of an audit: the memory trigger's input.

:class:`AllocatedReader` returns ``{"cpu": bytes, "cuda:0": bytes, ...}`` for the devices it can read.
Each figure counts what is allocated now, not what the allocator keeps cached, so it moves by the
bytes of whatever stays alive across a boundary. CPU: glibc's ``mallinfo2()`` in-use bytes where
glibc's allocator is the one in use, else the resident set from ``/proc/self/statm``, else none;
CUDA: the caching allocator's allocated bytes of each device the process has used. Given a
``share`` of the wall time, the reader skips a reading that would cost more (and returns ``{}``).
Why these sources, and what a reading costs: ``docs/how-it-works.md`` (*The memory figure*).

The reader never imports torch: it reads CUDA only when ``torch`` is already in ``sys.modules`` (or
given), never initialises CUDA and never synchronises. It is not thread-safe to share one reader
between threads that read at the same time.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Literal

from .._policy import validate
from .governor import Ration
from .tuning import CUDA_RESCAN as RESCAN

__all__ = [
    "CPU",
    "RESCAN",
    "AllocatedReader",
    "CpuSource",
    "Mallinfo2",
    "in_use",
    "mallinfo2",
    "mallinfo2_reader",
    "statm_reader",
]

CPU = "cpu"

CpuSource = Literal["mallinfo2", "statm"]

_PROBE_BYTES = 1 << 20


class Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mallinfo2() -> Mallinfo2 | None:
    """glibc's whole ``struct mallinfo2`` now (the count of free chunks its walk visits, ...), or ``None``
    where there is no ``mallinfo2``."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.argtypes = []
    function.restype = Mallinfo2
    result: Mallinfo2 = function()
    return result


def mallinfo2_reader() -> Callable[[], int] | None:
    """A function returning glibc's in-use bytes (``uordblks + hblkhd``), or ``None`` where that figure
    would not be honest: no ``mallinfo2`` (not glibc, or glibc < 2.33), or an allocation made through
    ``posix_memalign`` (what torch's CPU allocator calls) does not show in it."""
    try:
        libc = ctypes.CDLL(None)
        mallinfo2 = libc.mallinfo2
        memalign = libc.posix_memalign
        free = libc.free
    except (OSError, AttributeError):
        return None
    mallinfo2.argtypes = []
    mallinfo2.restype = Mallinfo2
    memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
    memalign.restype = ctypes.c_int
    free.argtypes = [ctypes.c_void_p]
    free.restype = None

    def read() -> int:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    # Another thread may free or allocate between the two readings: a few tries before giving up.
    for _ in range(3):
        pointer = ctypes.c_void_p()
        before = read()
        if memalign(ctypes.byref(pointer), 64, _PROBE_BYTES) != 0:
            return None
        after = read()
        free(pointer)
        if _PROBE_BYTES <= after - before < 2 * _PROBE_BYTES:
            return read
    return None


def statm_reader(path: str = "/proc/self/statm") -> Callable[[], int] | None:
    """A function returning the resident set in bytes from ``/proc/self/statm``, or ``None`` where the
    file cannot be read. The file stays open; a forked child reopens its own."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        fd = os.open(path, os.O_RDONLY)
        os.pread(fd, 128, 0)
    except (OSError, ValueError, AttributeError):
        return None
    opened = [fd, os.getpid()]

    def read() -> int:
        if opened[1] != os.getpid():  # /proc/self was resolved by the parent
            opened[0], opened[1] = os.open(path, os.O_RDONLY), os.getpid()
        return int(os.pread(opened[0], 128, 0).split()[1]) * page

    return read


class AllocatedReader:
    """``reader()``: bytes in use now per device, ``{"cpu": n, "cuda:0": m, ...}``.

    Args:
        cpu: ``"auto"`` (``mallinfo2`` where it is honest, else ``statm``, else no CPU figure),
            ``"mallinfo2"`` or ``"statm"`` (that one or none), or ``"off"``.
        cuda: Whether to read the CUDA devices in use.
        torch: The torch module to read CUDA through; by default the one in ``sys.modules`` at each
            reading, so a process that never imported torch reads none.
        share: The most of the wall time the readings may take (a reading that would cost more returns
            ``{}``), or ``None`` to read at every call.
        clock: The clock that budget is kept with, in seconds.

    Attributes:
        skipped: The calls that read nothing for the budget.
        cpu_source: ``"mallinfo2"``, ``"statm"``, or ``None`` when there is no CPU figure.

    Raises:
        GradGuardError: a bad ``cpu`` or ``share``, naming the value and what is accepted.
    """

    def __init__(
        self,
        cpu: str = "auto",
        cuda: bool = True,
        torch: ModuleType | None = None,
        share: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if cpu not in ("auto", "mallinfo2", "statm", "off"):
            raise validate.refusal("cpu", cpu, "'auto', 'mallinfo2', 'statm', 'off'")
        if share is not None:
            validate.number(share, what="share", accepted="a number > 0 and <= 1, or None", ok=_fraction, text=False)
        self.share = share
        self._clock = clock
        self._ration = Ration(share) if share is not None else None
        self.skipped = 0
        self.seconds = 0.0
        """Wall time the readings took (with a ``share``)."""
        self.cpu_source: CpuSource | None = None
        self._cpu: Callable[[], int] | None = None
        if cpu in ("auto", "mallinfo2"):
            self._cpu = mallinfo2_reader()
            self.cpu_source = "mallinfo2" if self._cpu is not None else None
        if self._cpu is None and cpu in ("auto", "statm"):
            self._cpu = statm_reader()
            self.cpu_source = "statm" if self._cpu is not None else None
        self.cuda = cuda
        self._torch = torch
        self._stats: Callable[[int], dict[str, int]] | None = None
        self._devices: list[int] | None = None  # every CUDA device index, once CUDA is initialised
        self._used: list[int] = []
        self._readings = 0

    def __call__(self) -> dict[str, int]:
        now = self._clock()
        ration = self._ration
        if ration is None:
            out = self._read()
            self.seconds += self._clock() - now
            return out
        if now < ration.next:
            self.skipped += 1
            return {}
        out = self._read()
        end = self._clock()
        ration.ran(now, end)
        self.seconds += end - now
        return out

    def _read(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self._cpu is not None:
            out[CPU] = self._cpu()
        if self.cuda:
            self._read_cuda(out)
        return out

    def next_due(self) -> float:
        """The clock's time from which a call reads again (``-inf``: at once; with no ``share``, always)."""
        return -math.inf if self._ration is None else self._ration.next

    def describe(self) -> str:
        """What the figures are, in one line (what is off, and why, included)."""
        cpu = {
            "mallinfo2": "cpu: glibc mallinfo2 in-use bytes",
            "statm": "cpu: resident set (/proc/self/statm; glibc's mallinfo2 not available or not in use)",
            None: "cpu: no figure (neither glibc's mallinfo2 nor /proc/self/statm here)",
        }[self.cpu_source]
        cuda = "cuda: allocated bytes of each device in use" if self.cuda else "cuda: not read"
        return f"{cpu}; {cuda}"

    def short(self) -> str:
        """What the figures are, in a few words."""
        cpu = {"mallinfo2": "glibc's in-use bytes", "statm": "the resident set", None: ""}[self.cpu_source]
        return " and ".join(part for part in (cpu, "CUDA's allocated bytes" if self.cuda else "") if part)

    def _read_cuda(self, out: dict[str, int]) -> None:
        torch = self._torch or sys.modules.get("torch")
        if torch is None:
            return
        cuda = getattr(torch, "cuda", None)
        if cuda is None or not cuda.is_initialized():
            return
        if self._stats is None:
            self._stats = _allocated_stats(torch)
            self._devices = list(range(cuda.device_count()))
        stats = self._stats
        if self._readings % RESCAN == 0:
            self._used = [d for d in self._devices or () if stats(d)["peak"] > 0]
        self._readings += 1
        for d in self._used:
            out[f"cuda:{d}"] = stats(d)["current"]


def _fraction(share: float) -> bool:
    return 0 < share <= 1


def _allocated_stats(torch: ModuleType) -> Callable[[int], dict[str, int]]:
    """``stats(d)`` -> ``{"current": bytes, "peak": bytes}`` of CUDA device ``d``'s allocated bytes."""
    raw = getattr(torch._C, "_cuda_memoryStats", None)
    if raw is not None:
        return lambda d: raw(d)["allocated_bytes"]["all"]

    # torch moved its private binding: the public functions (slower: they flatten every counter)
    def public(d: int) -> dict[str, int]:
        return {"current": torch.cuda.memory_allocated(d), "peak": torch.cuda.max_memory_allocated(d)}

    return public


_exact: AllocatedReader | None = None


def in_use() -> int | None:
    """Bytes in use now, summed over the CPU (glibc's in-use bytes only: the resident set is too coarse to
    measure what one repair gave back) and every CUDA device in use; ``None`` where neither can be read.
    For measuring a repair: costs a walk of glibc's free lists, so it is not read at every boundary."""
    global _exact
    if _exact is None:
        _exact = AllocatedReader(cpu="mallinfo2")
    readings = _exact()
    return sum(readings.values()) if readings else None
