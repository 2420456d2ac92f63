"""The per-device memory figure the trigger reads: what each CPU figure follows, the fallbacks, CUDA without
a GPU (a stand-in torch), and that the reader never imports torch itself."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import types
from typing import Any

import pytest
import torch

import gradguard
from gradguard import GradGuardError
from gradguard._watch import allocated as _allocated
from gradguard._watch.allocated import RESCAN, AllocatedReader, mallinfo2_reader, statm_reader

MiB = 1 << 20
mallinfo2 = mallinfo2_reader()
needs_mallinfo2 = pytest.mark.skipif(mallinfo2 is None, reason="glibc's mallinfo2 is not the allocator in use here")
statm = statm_reader()
needs_statm = pytest.mark.skipif(statm is None, reason="no /proc/self/statm here")


def _fields() -> tuple[int, int]:
    function = __import__("ctypes").CDLL(None).mallinfo2
    function.restype = _allocated.Mallinfo2
    info = function()
    return int(info.uordblks), int(info.hblkhd)


@needs_mallinfo2
@pytest.mark.parametrize("nbytes", [256 * 1024, 4 * MiB, 64 * MiB])
def test_mallinfo2_follows_a_cpu_tensor_to_within_a_page(nbytes: int) -> None:
    assert mallinfo2 is not None
    torch.ones(nbytes // 4)  # first calls initialise caches of torch that then stay
    before = mallinfo2()
    t = torch.ones(nbytes // 4)
    grown = mallinfo2() - before
    del t
    shrunk = before - mallinfo2()
    assert nbytes <= grown < nbytes + 8192
    assert abs(shrunk) < 8192


@needs_mallinfo2
def test_the_same_tensor_size_lands_in_either_field_so_only_their_sum_follows_it() -> None:
    """glibc maps a large chunk itself (``hblkhd``) until a freed mapped chunk raises its threshold; then the
    same size comes from the heap (``uordblks``). 24 MiB sits under glibc's highest threshold (32 MiB)."""
    nbytes = 24 * MiB
    moved = set()
    for _ in range(2):
        before = _fields()
        t = torch.ones(nbytes // 4)
        after = _fields()
        del t
        heap, mapped = after[0] - before[0], after[1] - before[1]
        assert heap + mapped >= nbytes
        moved.add("heap" if heap >= nbytes else "mapped")
    # Whether the first one is mapped depends on what this process freed before; after it, the heap serves.
    assert "heap" in moved


@needs_statm
def test_statm_follows_touched_pages() -> None:
    assert statm is not None
    before = statm()
    # A mapping of its own: a tensor may reuse pages glibc kept resident from what earlier tests freed.
    pages = mmap.mmap(-1, 64 * MiB)
    pages.write(b"\x01" * (64 * MiB))  # touched: resident
    assert statm() - before >= 60 * MiB
    pages.close()
    assert statm() % os.sysconf("SC_PAGE_SIZE") == 0


def test_the_reader_reads_cpu_by_the_best_figure_here_and_says_which() -> None:
    reader = AllocatedReader()
    readings = reader()
    if reader.cpu_source is None:
        assert readings == {} and "no figure" in reader.describe()
    else:
        assert set(readings) == {"cpu"} and readings["cpu"] > 0  # torch is CPU-only here: no CUDA key
        assert {"mallinfo2": "mallinfo2", "statm": "statm"}[reader.cpu_source] in reader.describe()
    assert AllocatedReader(cpu="off")() == {}


def test_without_mallinfo2_the_reader_falls_back_to_statm_and_without_both_has_no_cpu_figure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_allocated, "mallinfo2_reader", lambda: None)
    reader = AllocatedReader()
    assert reader.cpu_source == ("statm" if statm is not None else None)
    monkeypatch.setattr(_allocated, "statm_reader", lambda: None)
    reader = AllocatedReader()
    assert reader.cpu_source is None and reader() == {}
    assert "cpu: no figure (neither glibc's mallinfo2 nor /proc/self/statm here)" in reader.describe()
    assert AllocatedReader(cpu="mallinfo2").cpu_source is None  # asked for one that is missing: none, no other


def test_a_bad_cpu_setting_names_the_value_and_what_is_accepted() -> None:
    with pytest.raises(GradGuardError, match=r"cpu='rss' is not accepted; accepted: 'auto', 'mallinfo2', 'statm'"):
        AllocatedReader(cpu="rss")


def test_statm_missing_file_is_none(tmp_path: Any) -> None:
    assert statm_reader(str(tmp_path / "absent")) is None


# --------------------------------------------------------------------------------------------------
# CUDA, through a stand-in torch
# --------------------------------------------------------------------------------------------------


class FakeCuda:
    """What the reader touches of torch: ``cuda.is_initialized``, ``cuda.device_count`` and the stats binding."""

    def __init__(self, allocated: dict[int, int], devices: int = 4) -> None:
        self.initialized = False
        self.allocated = allocated
        self.devices = devices
        self.peak: dict[int, int] = {}
        self.calls: list[int] = []
        self.cuda = types.SimpleNamespace(is_initialized=lambda: self.initialized, device_count=lambda: self.devices)
        self._C = types.SimpleNamespace(_cuda_memoryStats=self._stats)

    def _stats(self, device: int) -> dict[str, Any]:
        assert self.initialized, "read before CUDA was initialised"
        self.calls.append(device)
        current = self.allocated.get(device, 0)
        self.peak[device] = max(self.peak.get(device, 0), current)
        return {"allocated_bytes": {"all": {"current": current, "peak": self.peak[device]}}}


def test_cuda_is_read_only_once_initialised_and_only_for_devices_in_use() -> None:
    fake = FakeCuda({0: 5 * MiB, 2: 7 * MiB})
    reader = AllocatedReader(cpu="off", torch=fake)  # type: ignore[arg-type]
    assert reader() == {} and fake.calls == []  # not initialised: nothing read, nothing initialised
    fake.initialized = True
    assert reader() == {"cuda:0": 5 * MiB, "cuda:2": 7 * MiB}
    fake.calls.clear()
    fake.allocated[0] = 6 * MiB
    assert reader() == {"cuda:0": 6 * MiB, "cuda:2": 7 * MiB}
    assert fake.calls == [0, 2]  # between scans, the devices in use only


def test_a_cuda_device_first_used_later_is_found_at_the_next_scan() -> None:
    fake = FakeCuda({0: MiB})
    fake.initialized = True
    reader = AllocatedReader(cpu="off", torch=fake)  # type: ignore[arg-type]
    assert reader() == {"cuda:0": MiB}
    fake.allocated[3] = 2 * MiB
    seen = [reader() for _ in range(RESCAN)]
    assert seen[-2] == {"cuda:0": MiB}
    assert seen[-1] == {"cuda:0": MiB, "cuda:3": 2 * MiB}


def test_cuda_off_or_a_cpu_only_torch_reads_nothing() -> None:
    fake = FakeCuda({0: MiB})
    fake.initialized = True
    assert AllocatedReader(cpu="off", cuda=False, torch=fake)() == {}  # type: ignore[arg-type]
    assert fake.calls == []
    assert AllocatedReader(cpu="off")() == {}  # this torch is a CPU build: CUDA is never initialised


def test_the_reader_never_imports_torch_itself(tmp_path: Any) -> None:
    """The module and its one import (``_errors``) load without the package's ``__init__``, which imports torch."""
    package = os.path.dirname(gradguard.__file__)
    script = textwrap.dedent(
        f"""
        import sys, types
        stub = types.ModuleType("gradguard")
        stub.__path__ = [{package!r}]
        sys.modules["gradguard"] = stub
        from gradguard._watch.allocated import AllocatedReader
        reader = AllocatedReader()
        readings = reader()
        assert "torch" not in sys.modules, "the reader imported torch"
        print(reader.cpu_source, sorted(readings))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    source = AllocatedReader().cpu_source
    assert out.strip() == f"{source} {['cpu'] if source else []}"


# --------------------------------------------------------------------------------------------------
# The reading budget, with a stand-in clock and CPU figure
# --------------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def budgeted(share: float, cost: list[float]) -> tuple[AllocatedReader, Clock]:
    """A reader whose CPU reading takes ``cost[0]`` seconds of the stand-in clock."""
    clock = Clock()
    reader = AllocatedReader(cpu="off", cuda=False, share=share, clock=clock)

    def cpu() -> int:
        clock.now += cost[0]
        return 42

    reader._cpu = cpu
    return reader, clock


def test_a_reading_within_its_share_of_the_step_is_taken_at_every_boundary() -> None:
    reader, clock = budgeted(0.001, [20e-6])  # 20 µs against 25 ms steps: 0.08%
    for _ in range(100):
        clock.now += 0.025
        assert reader() == {"cpu": 42}
    assert reader.skipped == 0


def test_an_expensive_reading_is_spread_out_to_its_share() -> None:
    reader, clock = budgeted(0.001, [20e-6])
    taken = []
    for _ in range(1000):
        clock.now += 0.005  # 5 ms steps: a 20 µs reading fits 0.1% at most at one boundary in four
        taken.append(bool(reader()))
    assert taken[0] and 0.75 * 250 <= sum(taken) <= 250
    assert sum(taken) * 20e-6 <= 0.001 * clock.now
    assert reader.skipped == 1000 - sum(taken)


def test_one_slow_reading_does_not_stall_the_budget() -> None:
    """A reading preempted for 10 ms: the budget goes by the cheapest of the last three."""
    cost = [20e-6]
    reader, clock = budgeted(0.001, cost)
    for step in range(50):
        clock.now += 0.030
        cost[0] = 0.010 if step == 10 else 20e-6
        assert reader() == {"cpu": 42}, f"skipped at step {step}"


def test_a_bad_share_names_the_value_and_what_is_accepted() -> None:
    for bad in (0, 1.5, "0.1", True):
        with pytest.raises(GradGuardError, match=r"share=.* is not accepted; accepted: a number > 0 and <= 1, or None"):
            AllocatedReader(share=bad)  # type: ignore[arg-type]
