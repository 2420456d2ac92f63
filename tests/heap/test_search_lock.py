"""The heap search holds the program's other threads: a tuple another thread is still building is never seen
with a reference of the search's while that thread goes on (CPython refuses to resize it then, and memory
may be corrupted), and the switch interval is put back exactly as it was."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _helpers import env

import gradguard
from gradguard._heap.hold import SearchLock, search_lock, work_clock

# A thread builds tuples from a generator that sleeps between items (the tuple is half built while it waits
# for the interpreter lock); the main thread trains with a leak under the watch and audits besides, so
# searches start right after one another while that thread waits.
_SCRIPT = textwrap.dedent(
    """
    import threading, time, torch, gradguard
    failures, stop = [], threading.Event()
    def items():
        for i in range(3):
            yield i
            time.sleep(0.0005)
    def build():
        while not stop.is_set():
            try:
                tuple(items())
            except SystemError as error:
                failures.append(repr(error))
                return
    builder = threading.Thread(target=build)
    builder.start()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), 0.01)
    kept = []
    try:
        with gradguard.watch(every=1, mode="warn"):
            for step in range(30):
                loss = model(torch.randn(8, 64)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                kept.append(loss)
                gradguard.audit()
    finally:
        stop.set()
        builder.join()
    print("failures:", failures)
    """
)


def test_a_tuple_another_thread_builds_is_left_alone() -> None:
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _SCRIPT], capture_output=True, text=True, env=env(), timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "failures: []" in done.stdout, done.stdout + done.stderr


def test_the_switch_interval_is_put_back_after_nested_holds() -> None:
    lock = SearchLock()
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.002)
    try:
        with lock:
            assert sys.getswitchinterval() > 60
            with lock:
                assert lock.owned() and lock.locked()
            assert sys.getswitchinterval() > 60
        assert sys.getswitchinterval() == pytest.approx(0.002)
        assert not lock.locked() and not lock.owned()
    finally:
        sys.setswitchinterval(before)


@contextlib.contextmanager
def _held_elsewhere(lock: SearchLock, seconds: float = 30) -> Iterator[None]:
    """``lock`` held by another thread for ``seconds`` (or until the block ends) while the block runs."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(seconds)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert taken.wait(30)
        yield
    finally:
        release.set()
        holder.join()


def test_a_search_lock_held_elsewhere_is_not_taken_without_waiting() -> None:
    lock = SearchLock()
    with _held_elsewhere(lock):
        assert not lock.acquire(blocking=False)
        assert lock.locked() and not lock.owned()


def test_the_wait_for_another_threads_search_is_not_the_waiters_work() -> None:
    # Both threads charged the one search: the waiter's audit took the other's search as its own cost.
    with _held_elsewhere(search_lock, seconds=0.5):
        wall, work = time.perf_counter(), work_clock()
        with search_lock:
            pass
        wall, work = time.perf_counter() - wall, work_clock() - work
    assert wall > 0.3 and work < 0.1, (wall, work)


def test_a_search_reads_nothing_from_the_operating_system(monkeypatch: pytest.MonkeyPatch) -> None:
    # Such a call releases the interpreter lock: the program's threads ran while the search held their objects
    # (a file name resolved to spell a frame's holder; a watched four-thread training crashed, memory corrupted).
    calls: list[str] = []
    for name in ("getcwd", "lstat", "stat", "scandir", "listdir", "readlink"):

        def spy(*args: object, _real: Any = getattr(os, name), _name: str = name, **kwargs: object) -> Any:  # noqa: B008
            if search_lock.owned():
                calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, spy)
    x = torch.ones(3, requires_grad=True)
    kept = [x * 2]  # a frame local's graph: its holder is spelled with this file's name
    report = gradguard.audit()
    assert any(entry.holder.endswith("kept[*]") for entry in report), [entry.holder for entry in report]
    assert calls == [] and kept


def test_a_search_waits_for_the_backwards_running_in_other_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # The search reads graphs' saved tensors, which the autograd engine frees as a backward runs through them,
    # with no lock of theirs: a search beside another thread's backward crashed a watched four-thread training.
    from gradguard._watch import audit as audit_module
    from gradguard._watch import backwards

    steps = 20
    progress, seen, started = [0], [], threading.Event()
    census = audit_module.live_graph_tensors
    main = threading.get_ident()

    def counted(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == main:
            seen.append(progress[0])
        return census(*args, **kwargs)

    def slow_hook(grad: torch.Tensor) -> torch.Tensor:
        started.set()
        for _ in range(steps):
            progress[0] += 1
            time.sleep(0.01)
        return grad

    def train() -> None:
        x = torch.ones(3, requires_grad=True)
        x.register_hook(slow_hook)
        (x * 2).sum().backward()

    monkeypatch.setattr(audit_module, "live_graph_tensors", counted)
    handle = backwards.listen(lambda roots, nested: None)
    worker = threading.Thread(target=train)
    try:
        worker.start()
        assert started.wait(30)
        gradguard.audit()
    finally:
        worker.join(30)
        handle.remove()
    assert seen == [steps]
