"""``gradguard.stats()``: per-site counters, the once-per-site byte estimate, the table, the log, and
consistency under concurrent appends."""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import _helpers
import pytest
import torch
from _helpers import clean, lineno

import gradguard
from gradguard._boundary import publish as _publish

HERE = os.path.abspath(__file__)
UNRESOLVED = "(no graph: site not resolved)"


def record(n: int = 256) -> dict[str, Any]:
    """Two graph-carrying tensors over one fresh leaf of ``n`` float32 (pins ``4 n`` bytes)."""
    return _helpers.record(1.0, n)


class CountingPinnedBytes:
    """A spy standing in for ``gradguard._boundary.publish.released_bytes``, the per-site estimate."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = _publish.released_bytes

    def __call__(self, obj: Any) -> int:
        self.calls += 1
        return int(self.real(obj))


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> CountingPinnedBytes:
    counting = CountingPinnedBytes()
    monkeypatch.setattr(_publish, "released_bytes", counting)
    return counting


def test_per_site_records_tensors_and_bytes(spy: CountingPinnedBytes) -> None:
    store = gradguard.guard([], name="output_lst")
    for _ in range(10):
        line_a = lineno() + 1
        store.append(record())
    line_b = lineno() + 1
    store.extend([record(), record(), clean()])
    for _ in range(4):
        store.append(clean())

    rows = gradguard.stats()
    assert isinstance(rows, gradguard.Stats)
    assert set(rows) == {
        ("output_lst", f"{HERE}:{line_a}"),
        ("output_lst", f"{HERE}:{line_b}"),
        ("output_lst", UNRESOLVED),
    }
    a = rows[("output_lst", f"{HERE}:{line_a}")]
    assert isinstance(a, gradguard.SiteStats)
    assert (a.store, a.site) == ("output_lst", f"{HERE}:{line_a}")
    assert a.records == 10
    assert a.tensors_detached == 20  # two tensors per record
    # what a detach releases: the shared leaf once per record, and the gradient backward would give it
    assert a.pinned_bytes_per_record == 2 * 256 * 4
    assert a.pinned_bytes_released == 10 * 2 * 256 * 4
    b = rows[("output_lst", f"{HERE}:{line_b}")]
    assert (b.records, b.tensors_detached, b.pinned_bytes_released) == (2, 4, 2 * 2 * 1024)
    assert rows[("output_lst", UNRESOLVED)].records == 5  # 1 from extend + 4 appends
    assert rows[("output_lst", UNRESOLVED)].tensors_detached == 0
    assert spy.calls == 2  # one estimate per site, not per record


def test_pinned_bytes_estimated_once_for_many_appends_from_one_line(spy: CountingPinnedBytes) -> None:
    store = gradguard.guard([], name="once")
    for _ in range(50):
        store.append(record())
    assert spy.calls == 1
    (row,) = [s for s in gradguard.stats().values() if s.site != UNRESOLVED]
    assert row.records == 50 and row.pinned_bytes_released == 50 * row.pinned_bytes_per_record


def test_clean_records_never_estimate_nor_walk_frames(
    spy: CountingPinnedBytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_frames(*args: Any) -> None:
        raise AssertionError("site attribution ran for a clean record")

    monkeypatch.setattr("gradguard._boundary.publish.caller", no_frames)
    store = gradguard.guard([], name="clean_only")
    for _ in range(20):
        store.append(clean())
    store.extend([clean(), clean()])
    assert spy.calls == 0
    assert gradguard.stats() == {("clean_only", UNRESOLVED): gradguard.SiteStats("clean_only", UNRESOLVED, records=22)}


def test_stores_are_kept_apart() -> None:
    first = gradguard.guard([], name="first")
    second = gradguard.guard({}, name="second")
    # fmt: off
    line = lineno() + 1
    first.append(record()); second["k"] = record()  # noqa: E702 - one line, two stores
    # fmt: on
    rows = gradguard.stats()
    assert rows[("first", f"{HERE}:{line}")].records == 1
    assert rows[("second", f"{HERE}:{line}")].records == 1


def test_one_line_is_one_row_whatever_the_code_object() -> None:
    """Sites are keyed by code object and instruction offset on the hot path; rows stay file:line."""
    store = gradguard.guard([], name="one_row")
    # fmt: off
    line = lineno() + 1
    store.append(record()); store.append(record())  # noqa: E702 - two appends, one line
    # fmt: on
    # fresh code objects, dropped after each exec: an id reused by a later code object must not
    # carry its records into another file's row
    for i in range(40):
        filename = "<generated-a>" if i % 2 else "<generated-b>"
        exec(compile("store.append(record())", filename, "exec"), {"store": store, "record": record})
    rows = gradguard.stats()
    assert rows[("one_row", f"{HERE}:{line}")].records == 2
    assert rows[("one_row", "<generated-a>:1")].records == 20
    assert rows[("one_row", "<generated-b>:1")].records == 20
    assert len(rows) == 3


def test_stats_is_a_snapshot() -> None:
    store = gradguard.guard([], name="snap")
    store.append(clean())
    snapshot = gradguard.stats()
    store.append(clean())
    assert snapshot[("snap", UNRESOLVED)].records == 1
    snapshot[("snap", UNRESOLVED)].records = 99
    assert gradguard.stats()[("snap", UNRESOLVED)].records == 2


def test_str_is_a_readable_table() -> None:
    store = gradguard.guard([], name="forward_data_store")
    for _ in range(3):
        line = lineno() + 1
        store.append(record(1024))
    store.append(clean())
    table = str(gradguard.stats())
    lines = table.splitlines()
    assert len(lines) == 4  # header, rule, two rows
    for column in ("store", "site", "records", "tensors detached", "released (est.)"):
        assert column in lines[0]
    assert set(lines[1].replace(" ", "")) == {"-"}
    graph_row = next(row for row in lines[2:] if f"{HERE}:{line}" in row)
    assert graph_row.split()[0] == "forward_data_store"
    assert graph_row.split()[2:4] == ["3", "6"]  # records, tensors detached
    assert "24.0 KiB" in graph_row  # 3 records x (a 4 KiB leaf and its 4 KiB gradient)
    clean_row = next(row for row in lines[2:] if UNRESOLVED in row)
    assert clean_row.startswith("forward_data_store") and " 1 " in clean_row
    assert str(gradguard.Stats()).splitlines()[0].split()[0] == "store"  # empty: header only


def test_reset_stats_clears_everything() -> None:
    store = gradguard.guard([], name="reset")
    store.append(record())
    store.append(clean())
    assert len(gradguard.stats()) == 2
    gradguard.reset_stats()
    assert gradguard.stats() == {}
    assert str(gradguard.stats()).count("\n") == 1  # header and rule only


def test_debug_log_on_first_seen_site(caplog: pytest.LogCaptureFixture) -> None:
    store = gradguard.guard([], name="logged")
    with caplog.at_level(logging.DEBUG, logger="gradguard"):
        for _ in range(5):
            line = lineno() + 1
            store.append(record())
        store.append(clean())
    ours = [r for r in caplog.records if r.name == "gradguard" and "first" in r.getMessage()]
    assert len(ours) == 1
    assert ours[0].levelno == logging.DEBUG
    assert f"{HERE}:{line}" in ours[0].getMessage() and "logged" in ours[0].getMessage()


def test_no_debug_log_above_debug(caplog: pytest.LogCaptureFixture) -> None:
    store = gradguard.guard([], name="quiet")
    with caplog.at_level(logging.INFO, logger="gradguard"):
        store.append(record())
    assert [r for r in caplog.records if r.name == "gradguard"] == []


def test_graphless_leaves_are_counted_clean() -> None:
    store = gradguard.guard([], name="leaves")
    store.extend([{"leaf": torch.ones(2, requires_grad=True)}, clean(), record()])
    rows = gradguard.stats()
    assert rows[("leaves", UNRESOLVED)].records == 2
    assert sum(s.records for s in rows.values()) == 3


def test_warn_mode_stats_count_every_record_but_warn_once() -> None:
    store = gradguard.guard([], name="warned", mode="warn")
    with pytest.warns(gradguard.GraphRetentionWarning):
        for _ in range(4):
            store.append(record())
    (row,) = gradguard.stats().values()
    assert row.records == 4 and row.tensors_detached == 8


# --------------------------------------------------------------------------------------------------
# concurrency
# --------------------------------------------------------------------------------------------------

THREADS = 8
PER_THREAD = 2000


def test_threads_lose_nothing_and_stats_stay_consistent() -> None:
    store = gradguard.guard([], name="shared")
    leaf = torch.ones(4, requires_grad=True)
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            barrier.wait()
            for i in range(PER_THREAD):
                if i % 2:
                    store.append({"k": k, "i": i, "out": leaf * float(i)})  # carries MulBackward0
                else:
                    store.append({"k": k, "i": i, "out": torch.zeros(1)})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # force interleaving
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []

    assert len(store) == THREADS * PER_THREAD
    assert sorted((r["k"], r["i"]) for r in store) == [(k, i) for k in range(THREADS) for i in range(PER_THREAD)]
    assert all(r["out"].grad_fn is None and not r["out"].requires_grad for r in store)

    rows = gradguard.stats()
    assert all(name == "shared" for name, _ in rows)
    assert sum(s.records for s in rows.values()) == THREADS * PER_THREAD
    assert rows[("shared", UNRESOLVED)].records == THREADS * PER_THREAD // 2
    graph_rows = [s for (_, site), s in rows.items() if site != UNRESOLVED]
    assert len(graph_rows) == 1  # one line appended graphs
    assert graph_rows[0].records == graph_rows[0].tensors_detached == THREADS * PER_THREAD // 2
    assert graph_rows[0].pinned_bytes_released == graph_rows[0].records * graph_rows[0].pinned_bytes_per_record


# --------------------------------------------------------------------------------------------------
# Counting under threads, resets and odd call sites
# --------------------------------------------------------------------------------------------------


def test_reset_racing_a_publishing_thread_never_breaks_stats() -> None:
    """reset_stats() while another thread publishes must not leave stats() raising KeyError until the next reset.

    The race, as reported: a producer thread publishes graph records without pause while this thread
    resets and reads; before the fix, with four producers, it broke within a second or two.
    """
    import time

    x = torch.randn(2, requires_grad=True)
    stop = threading.Event()
    errors: list[BaseException] = []

    def producer() -> None:
        i = 0
        while not stop.is_set():
            gradguard.guard([], name=f"s{i % 50}").append(x * 2)
            i += 1

    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads = [threading.Thread(target=producer) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and not errors:
            gradguard.reset_stats()
            time.sleep(0.0005)  # let the producer run into the reset
            try:
                gradguard.stats()
            except Exception as exc:  # noqa: BLE001 - any exception is the defect
                errors.append(exc)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        sys.setswitchinterval(previous)
    assert errors == []
    rows = gradguard.stats()  # and afterwards, with nothing publishing
    assert all(s.records > 0 for s in rows.values())


def test_a_reset_between_a_new_site_and_its_first_count_is_ignored_not_fatal() -> None:
    """The same, the interleaving itself: a thread made a site's row, a reset came, then it counted."""
    from gradguard._policy import stats as _stats

    count, _ = _stats.new_site("racy", "detach", None, "here:1", 16)
    gradguard.reset_stats()
    count.add(1)  # the other thread goes on with the counters it holds
    assert gradguard.stats() == {}  # the reset wins; nothing raises
    gradguard.guard([], name="racy").append(torch.ones(2, requires_grad=True) * 2)
    assert [s.records for s in gradguard.stats().values()] == [1]


def test_threads_that_ended_keep_their_counts_and_leave_no_tally() -> None:
    """A short-lived thread must not leave a tally behind, even across reset_stats()."""
    from gradguard._policy import stats as _stats

    x = torch.randn(2, requires_grad=True)
    store = gradguard.guard([], name="pool")
    before = _stats._tables()["live"]
    for _ in range(200):
        worker = threading.Thread(target=lambda: store.append({"y": x * 2}))
        worker.start()
        worker.join()
    assert _stats._tables()["live"] <= before + 1  # the ended threads' tallies are gone
    (row,) = [s for s in gradguard.stats().values() if s.store == "pool"]
    assert (row.records, row.tensors_detached) == (200, 200)  # but their counts are not
    gradguard.reset_stats()
    assert gradguard.stats() == {} and _stats._tables()["retired"] == 0


def test_only_graph_records_and_distinct_tensors_are_counted() -> None:
    """Leaf-only records and repeated references are not counted as detached graphs."""
    x, leaf = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
    store = gradguard.guard([], name="out")

    def publish(rec: Any) -> None:
        store.append(rec)  # one call site for every record

    publish({"y": x * 2})
    for _ in range(3):
        publish({"w": leaf})  # leaves: no graph, nothing pinned
    y = x * 2
    publish([y, y, y])  # one distinct graph tensor
    rows = gradguard.stats()
    graph_rows = [s for s in rows.values() if s.site != UNRESOLVED]
    assert [(s.records, s.tensors_detached, s.pinned_bytes_released) for s in graph_rows] == [(2, 2, 32)]
    assert rows[("out", UNRESOLVED)].records == 3


def test_a_name_with_control_characters_cannot_forge_lines() -> None:
    """Names are shown escaped (their repr) in messages and the stats table, never verbatim."""
    x = torch.randn(2, requires_grad=True)
    forged = "out\nRefused (mode 'raise'): nothing was stored. FORGED"
    with pytest.raises(gradguard.GraphRetentionError) as info:
        gradguard.guard([], mode="raise", name=forged).append(x * 2)
    message = str(info.value)
    assert repr(forged) in message and "\nRefused (mode 'raise'): nothing was stored. FORGED" not in message
    gradguard.guard([], name="\x1b[2J\x1b[31mred").append(x * 2)
    table = str(gradguard.stats())
    assert "\x1b" not in table and repr("\x1b[2J\x1b[31mred") in table
    assert len(table.splitlines()) == 4  # header, rule, the refused record's row, the other's


def test_an_append_with_no_python_caller_stores_the_record() -> None:
    """A guarded append called from C with no Python frame above it must neither raise nor lose the record."""
    import _thread
    import time

    x = torch.randn(2, requires_grad=True)
    store = gradguard.guard([], name="grads")
    done = threading.Event()

    def appended_from_c() -> None:
        _thread.start_new_thread(store.append, ({"g": x * 2},))

    appended_from_c()
    deadline = time.monotonic() + 120  # the thread's start waits for a core on a loaded machine
    while time.monotonic() < deadline:
        if len(store) == 1:
            done.set()
            break
        time.sleep(0.01)
    assert done.is_set() and store[0]["g"].grad_fn is None
    (row,) = [s for s in gradguard.stats().values() if s.store == "grads"]
    assert row.site == "<unknown>" and row.records == 1


def test_a_record_refused_in_raise_mode_is_counted_at_its_site(spy: CountingPinnedBytes) -> None:
    store = gradguard.guard([], name="strict", mode="raise")
    store.append(clean())
    line = lineno() + 2
    with pytest.raises(gradguard.GraphRetentionError):
        store.append(record())
    with pytest.raises(gradguard.GraphRetentionError):
        store.extend([clean(), record()])  # all or nothing: the batch is one refusal
    assert list(store) == [store[0]] and len(store) == 1
    assert spy.calls == 0  # nothing was detached: no estimate of what detaching would release
    for site in (f"{HERE}:{line}", f"{HERE}:{line + 2}"):
        assert gradguard.stats()[("strict", site)] == gradguard.SiteStats("strict", site, records=1, refused=1)
    table = str(gradguard.stats())
    assert table.splitlines()[0].split()[-1] == "refused"  # the column is there only when something was refused
    assert "refused" not in str(gradguard.Stats({k: v for k, v in gradguard.stats().items() if not v.refused}))
