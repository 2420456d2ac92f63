"""The heap search holds the program's other threads: a tuple another thread is still building is never seen
with a reference of the search's while that thread goes on (CPython refuses to resize it then, and memory
may be corrupted), and the switch interval is put back exactly as it was."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
from _helpers import env

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


def test_a_search_lock_held_elsewhere_is_not_taken_without_waiting() -> None:
    lock = SearchLock()
    taken = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert taken.wait(30)
        assert not lock.acquire(blocking=False)
        assert lock.locked() and not lock.owned()
    finally:
        release.set()
        holder.join()


def test_the_wait_for_another_threads_search_is_not_the_waiters_work() -> None:
    # Both threads charged the one search: the waiter's audit took the other's search as its own cost.
    taken = threading.Event()

    def hold() -> None:
        with search_lock:
            taken.set()
            time.sleep(0.5)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert taken.wait(30)
        wall, work = time.perf_counter(), work_clock()
        with search_lock:
            pass
        wall, work = time.perf_counter() - wall, work_clock() - work
    finally:
        holder.join()
    assert wall > 0.3 and work < 0.1, (wall, work)
