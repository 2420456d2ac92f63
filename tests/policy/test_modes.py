"""Modes (off / detach / warn / raise), their messages, how the active mode resolves, context-locality,
and the ``GRADGUARD`` environment variable (in fresh interpreters)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import _helpers
import pytest
import torch
import wrapt
from _helpers import clean, lineno

import gradguard
from gradguard import GradGuardError, GraphRetentionError, GraphRetentionWarning
from gradguard._policy import modes as _policy

HERE = os.path.abspath(__file__)
LEAF_BYTES = 1024 * 4  # float32 leaf of 1024 elements: what one record below pins (4.0 KiB)


def record(value: float = 1.0) -> dict[str, Any]:
    """``log_probs`` carries ``AddBackward0`` over a fresh 4 KiB leaf; ``entropy`` is clean."""
    return _helpers.record(value, 1024, entropy=False)


def carries_graph(obj: Any) -> bool:
    return bool(gradguard.find_graphs(obj))


# --------------------------------------------------------------------------------------------------
# off / detach
# --------------------------------------------------------------------------------------------------


def test_off_stores_the_value_itself_with_its_graph() -> None:
    store = gradguard.guard([], mode="off", name="off_store")
    rec = record()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.append(rec)
        store.extend([rec])
    assert store[0] is rec and store[1] is rec
    assert store[0]["model_output"]["log_probs"].grad_fn is not None
    assert gradguard.stats() == {}  # off: not even counted


def test_detach_is_silent_and_counted() -> None:
    store = gradguard.guard([], mode="detach", name="det")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning would fail the test
        for i in range(3):
            store.append(record(float(i)))
        store.append(clean())
    assert len(store) == 4 and not carries_graph(store)
    rows = gradguard.stats()
    graph_rows = [s for (name, site), s in rows.items() if name == "det" and site != "(no graph: site not resolved)"]
    assert len(graph_rows) == 1
    assert graph_rows[0].records == 3 and graph_rows[0].tensors_detached == 3
    assert rows[("det", "(no graph: site not resolved)")].records == 1


def test_default_mode_is_detach() -> None:
    assert gradguard.get_mode() == "detach"
    assert _policy.mode_source() == ("detach", "default")
    store = gradguard.guard([])
    store.append(record())
    assert not carries_graph(store)


# --------------------------------------------------------------------------------------------------
# warn
# --------------------------------------------------------------------------------------------------


def test_warn_once_per_call_site_with_a_full_message() -> None:
    store = gradguard.guard([], mode="warn", name="output_lst")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # so only gradguard's own once-per-site rule can dedupe
        for i in range(5):
            line = lineno() + 1
            store.append(record(float(i)))
    ours = [w for w in caught if issubclass(w.category, GraphRetentionWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert len(store) == 5 and not carries_graph(store)  # every record still detached and stored

    warning = ours[0]
    assert warning.filename == HERE and warning.lineno == line  # attributed to this line, not gradguard
    message = str(warning.message)
    assert "output_lst" in message
    assert "['model_output']['log_probs']" in message
    assert "AddBackward0" in message
    assert f"{HERE}:{line}" in message
    for frame_dir in (os.path.dirname(gradguard.__file__), os.path.dirname(wrapt.__file__)):
        assert frame_dir + os.sep not in message  # no gradguard or wrapt frame
    assert "4.0 KiB" in message  # the pinned-bytes estimate of one record (a 4 KiB leaf)
    assert "['model_output']['entropy']" not in message  # clean tensors are not reported


def test_warn_lists_each_offending_tensor() -> None:
    leaf = torch.ones(8, requires_grad=True)
    rec = {"loss": 1.0, "model_output": {"log_probs": leaf + 1, "entropy": leaf.exp(), "mask": torch.ones(8)}}
    store = gradguard.guard([], mode="warn", name="each")
    with pytest.warns(GraphRetentionWarning) as caught:
        store.append(rec)
    message = str(caught[0].message)
    assert "2 tensor(s)" in message
    assert "['model_output']['log_probs']  AddBackward0" in message
    assert "['model_output']['entropy']  ExpBackward0" in message
    assert "['model_output']['mask']" not in message


def test_warn_on_two_lines_warns_twice() -> None:
    store = gradguard.guard([], mode="warn", name="two_lines")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            first = lineno() + 1
            store.append(record())
            second = lineno() + 1
            store.append(record())
    ours = [w for w in caught if issubclass(w.category, GraphRetentionWarning)]
    assert [(w.filename, w.lineno) for w in ours] == [(HERE, first), (HERE, second)]
    assert f"{HERE}:{first}" in str(ours[0].message) and f"{HERE}:{second}" in str(ours[1].message)
    assert len(gradguard.unwrap(store)) == 6


def test_warn_again_after_reset_stats() -> None:
    store = gradguard.guard([], mode="warn", name="reset")
    for _ in range(2):
        with pytest.warns(GraphRetentionWarning):
            store.append(record())
        gradguard.reset_stats()


def test_warn_names_the_repr_when_the_store_has_no_name() -> None:
    store = gradguard.guard(collections.deque(), mode="warn")
    with pytest.warns(GraphRetentionWarning, match=r"<deque at 0x[0-9a-f]+>"):
        store.appendleft(record())


def test_warn_attributes_every_entry_point_to_the_caller() -> None:
    lst = gradguard.guard([0], mode="warn", name="entry_points")
    dct = gradguard.guard({}, mode="warn", name="entry_points_dict")
    calls = [
        lambda: lst.extend([record()]),
        lambda: lst.insert(0, record()),
        lambda: lst.__setitem__(0, record()),
        lambda: lst.__setitem__(slice(0, 1), [record()]),
        lambda: lst.__iadd__([record()]),
        lambda: dct.update(a=record()),
        lambda: dct.__setitem__("b", record()),
        lambda: dct.setdefault("c", record()),
        lambda: dct.__ior__({"d": record()}),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in calls:
            call()
    ours = [w for w in caught if issubclass(w.category, GraphRetentionWarning)]
    # each warning points at the lambda in this file that called the proxy (one site per lambda)
    assert [(w.filename, w.lineno) for w in ours] == [(HERE, c.__code__.co_firstlineno) for c in calls]


def test_warn_under_the_default_pytest_filter_is_an_error() -> None:
    """pyproject turns GraphRetentionWarning into an error: a warn-mode leak fails a test suite.

    The exception refuses the record like raise mode (nothing stored, nothing counted), and the
    site raises again on its next leak, as an ``error`` filter does for any warning.
    """
    kept = clean()
    store = gradguard.guard([kept], mode="warn", name="strict_suite")
    gradguard.reset_stats()  # the initial item was published (counted clean) as the store was made
    for _ in range(2):
        with pytest.raises(GraphRetentionWarning, match="strict_suite"):
            store.append(record())
        with pytest.raises(GraphRetentionWarning):
            store.extend([clean(), record(), {"leaf": torch.ones(1, requires_grad=True)}])
        assert store == [kept] and store[0] is kept
        assert gradguard.stats() == {}
    with warnings.catch_warnings(record=True) as caught:  # once warned normally, the site is quiet
        warnings.simplefilter("always")
        for _ in range(3):
            store.append(record())
    assert len([w for w in caught if issubclass(w.category, GraphRetentionWarning)]) == 1
    assert len(store) == 4


# --------------------------------------------------------------------------------------------------
# raise: refused, the store untouched
# --------------------------------------------------------------------------------------------------


def test_raise_refuses_append_with_a_full_message() -> None:
    kept = clean(0.0)
    store = gradguard.guard([kept], mode="raise", name="forward_data_store")
    gradguard.reset_stats()  # the initial item was published (counted clean) as the store was made
    with pytest.raises(GraphRetentionError) as info:
        line = lineno() + 1
        store.append(record())
    assert store == [kept] and store[0] is kept
    message = str(info.value)
    assert "forward_data_store" in message
    assert "['model_output']['log_probs']" in message and "AddBackward0" in message
    assert f"{HERE}:{line}" in message
    assert "4.0 KiB" in message
    assert "nothing was stored" in message
    assert isinstance(info.value, GradGuardError)
    site = f"{HERE}:{line}"  # a refusal is counted at its site, and nothing as detached or stored
    assert gradguard.stats() == {
        ("forward_data_store", site): gradguard.SiteStats("forward_data_store", site, records=1, refused=1)
    }


def test_raise_extend_with_one_bad_item_appends_nothing() -> None:
    goods = [clean(float(i)) for i in range(3)]
    store = gradguard.guard([goods[0]], mode="raise", name="ext")
    gradguard.reset_stats()  # the initial item was published (counted clean) as the store was made
    with pytest.raises(GraphRetentionError):
        store.extend([goods[1], record(), goods[2]])
    assert store == [goods[0]] and store[0] is goods[0]
    with pytest.raises(GraphRetentionError):
        store += [goods[1], record()]
    assert len(store) == 1
    store.extend(goods[1:])  # the store still works afterwards
    assert store == goods
    assert gradguard.stats()[("ext", "(no graph: site not resolved)")].records == 2


def test_raise_leaves_every_list_entry_point_unchanged() -> None:
    items = [clean(float(i)) for i in range(4)]
    store = gradguard.guard(list(items), mode="raise")
    attempts = [
        lambda: store.append(record()),
        lambda: store.insert(1, record()),
        lambda: store.__setitem__(1, record()),
        lambda: store.__setitem__(slice(0, 2), [clean(9.0), record()]),
        lambda: store.__setitem__(slice(0, 4, 2), [record(), clean(9.0)]),
        lambda: store.__setitem__(slice(1, 1), [record()]),
    ]
    for attempt in attempts:
        with pytest.raises(GraphRetentionError):
            attempt()
        assert len(store) == 4 and all(a is b for a, b in zip(store, items))


def test_raise_dict_update_is_all_or_nothing() -> None:
    old = clean(0.0)
    store = gradguard.guard({"a": old}, mode="raise", name="dct")
    gradguard.reset_stats()  # the initial item was published (counted clean) as the store was made
    attempts = [
        lambda: store.update({"a": clean(1.0), "b": record()}),
        lambda: store.update([("b", clean(1.0))], c=record()),
        lambda: store.__setitem__("a", record()),
        lambda: store.setdefault("z", record()),
        lambda: store.__ior__({"a": clean(2.0), "y": record()}),
    ]
    for attempt in attempts:
        with pytest.raises(GraphRetentionError):
            attempt()
        assert store == {"a": old} and store["a"] is old
    counted = gradguard.stats()  # each refusal at its own site, nothing detached
    assert len(counted) == len(attempts)
    assert all(s.refused == 1 and s.tensors_detached == 0 and s.pinned_bytes_released == 0 for s in counted.values())


def test_raise_deque_entry_points_unchanged() -> None:
    items = [clean(float(i)) for i in range(3)]
    store = gradguard.guard(collections.deque(items, maxlen=3), mode="raise")
    for attempt in (
        lambda: store.append(record()),
        lambda: store.appendleft(record()),
        lambda: store.extend([clean(5.0), record()]),
        lambda: store.extendleft([record(), clean(5.0)]),
    ):
        with pytest.raises(GraphRetentionError):
            attempt()
        # a full deque with maxlen would have dropped an item: nothing was lost
        assert list(store) == items and all(a is b for a, b in zip(store, items))


def test_raise_lists_every_offending_path() -> None:
    store = gradguard.guard([], mode="raise", name="paths")
    leaf = torch.ones(3, requires_grad=True)
    bad = [{"x": leaf * 2}, (torch.zeros(1), leaf.exp())]
    with pytest.raises(GraphRetentionError) as info:
        store.append(bad)
    message = str(info.value)
    assert "[0]['x']" in message and "MulBackward0" in message
    assert "[1][1]" in message and "ExpBackward0" in message
    assert "2 tensor(s)" in message


def test_raise_allows_clean_records_and_graphless_leaves() -> None:
    store = gradguard.guard([], mode="raise")
    store.append(clean())
    leaf = torch.ones(2, requires_grad=True)
    store.append({"leaf": leaf})  # requires grad, holds no graph: stored as it is
    assert len(store) == 2 and store[1]["leaf"] is leaf


# --------------------------------------------------------------------------------------------------
# resolution order
# --------------------------------------------------------------------------------------------------


def _stored(store: Any) -> Any:
    """Append a graph-carrying record to ``store`` and say what happened: off / detach / raise."""
    rec = record()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GraphRetentionWarning)
            store.append(rec)
    except GraphRetentionError:
        return "raise"
    return "off" if store[-1] is rec else "detach"


def test_resolution_order(monkeypatch: pytest.MonkeyPatch) -> None:
    follows = gradguard.guard([])
    pinned = gradguard.guard([], mode="detach")
    assert gradguard.get_mode() == "detach" and _stored(follows) == "detach"

    monkeypatch.setenv("GRADGUARD", "off")
    _policy.reload_env()
    assert gradguard.get_mode() == "off" and _stored(follows) == "off"
    assert _policy.mode_source() == ("off", "GRADGUARD")

    gradguard.set_mode("raise")  # set_mode > GRADGUARD
    assert gradguard.get_mode() == "raise" and _stored(follows) == "raise"
    assert _policy.mode_source() == ("raise", "set_mode")

    with gradguard.enforce(mode="off", engines="none"):  # enforce > set_mode
        assert gradguard.get_mode() == "off" and _stored(follows) == "off"
        assert _policy.mode_source() == ("off", "enforce")
        assert _stored(pinned) == "detach"  # explicit mode= > enforce

        with gradguard.enforce(mode="raise", engines="none"):  # the innermost enforce rules
            assert gradguard.get_mode() == "raise" and _stored(follows) == "raise"
            with gradguard.enforce(engines="none"):  # enforce(mode=None) keeps the enclosing mode
                assert gradguard.get_mode() == "raise"
        assert gradguard.get_mode() == "off"

    assert gradguard.get_mode() == "raise"
    gradguard.set_mode(None)
    assert gradguard.get_mode() == "off"  # back to GRADGUARD
    monkeypatch.delenv("GRADGUARD")
    _policy.reload_env()
    assert gradguard.get_mode() == "detach" and _stored(follows) == "detach"


def test_mode_is_resolved_at_each_call_not_at_guard_time() -> None:
    store = gradguard.guard([])
    gradguard.set_mode("raise")
    assert _stored(store) == "raise"
    gradguard.set_mode("off")
    assert _stored(store) == "off"


def test_set_mode_returns_the_previous_value_and_validates() -> None:
    assert gradguard.set_mode("STRICT") is None
    assert gradguard.get_mode() == "raise"
    assert gradguard.set_mode("warn") == "raise"
    with pytest.raises(GradGuardError, match="'sometimes'.*off/0/false, detach/on/1/true, warn, raise/strict"):
        gradguard.set_mode("sometimes")
    assert gradguard.get_mode() == "warn"  # a bad value changes nothing
    assert gradguard.set_mode(None) == "warn"
    assert gradguard.get_mode() == "detach"


@pytest.mark.parametrize(
    ("raw", "mode"),
    [
        ("off", "off"),
        ("0", "off"),
        ("FALSE", "off"),
        ("Off", "off"),
        ("detach", "detach"),
        ("On", "detach"),
        ("1", "detach"),
        ("TRUE", "detach"),
        ("Warn", "warn"),
        ("raise", "raise"),
        ("STRICT", "raise"),
        (" strict ", "raise"),
        ("", "detach"),
    ],
)
def test_env_values_in_process(monkeypatch: pytest.MonkeyPatch, raw: str, mode: str) -> None:
    monkeypatch.setenv("GRADGUARD", raw)
    _policy.reload_env()
    assert gradguard.get_mode() == mode


def test_env_is_read_once_until_reloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADGUARD", "warn")
    _policy.reload_env()
    assert gradguard.get_mode() == "warn"
    monkeypatch.setenv("GRADGUARD", "off")
    assert gradguard.get_mode() == "warn"  # cached at first use
    _policy.reload_env()
    assert gradguard.get_mode() == "off"


def test_bad_env_value_in_process_raises_at_every_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADGUARD", "maybe")
    _policy.reload_env()
    store = gradguard.guard([])  # guarding does not resolve the mode
    for use in (gradguard.get_mode, lambda: store.append(record())):
        with pytest.raises(GradGuardError, match="GRADGUARD='maybe'"):
            use()
    assert store == []
    gradguard.guard([], mode="detach").append(record())  # an explicit mode never reads GRADGUARD
    gradguard.set_mode("warn")
    assert gradguard.get_mode() == "warn"  # set_mode outranks the bad variable


# --------------------------------------------------------------------------------------------------
# context-locality
# --------------------------------------------------------------------------------------------------


def test_set_mode_does_not_leak_between_threads() -> None:
    barrier = threading.Barrier(3)
    seen: dict[str, Any] = {}

    def worker(name: str, mode: str) -> None:
        barrier.wait()  # 1: started
        barrier.wait()  # 2: main has set its mode (after this thread started: no inheritance involved)
        seen[name + ":start"] = gradguard.get_mode()
        gradguard.set_mode(mode)
        barrier.wait()  # 3: every thread has set its mode before any reads it again
        seen[name] = gradguard.get_mode()
        seen[name + ":store"] = _stored(gradguard.guard([]))

    threads = [threading.Thread(target=worker, args=a) for a in (("a", "off"), ("b", "warn"))]
    for t in threads:
        t.start()
    barrier.wait()
    gradguard.set_mode("raise")
    barrier.wait()
    barrier.wait()
    for t in threads:
        t.join()
    assert seen["a:start"] == seen["b:start"] == "detach"  # main's set_mode did not leak in
    assert seen["a"] == "off" and seen["a:store"] == "off"
    assert seen["b"] == "warn" and seen["b:store"] == "detach"  # warn detaches
    assert gradguard.get_mode() == "raise" and _stored(gradguard.guard([])) == "raise"  # nor out


def test_enforce_scope_does_not_leak_between_threads() -> None:
    with gradguard.enforce(mode="raise", engines="none"):
        seen = []
        thread = threading.Thread(target=lambda: seen.append(gradguard.get_mode()))
        thread.start()
        thread.join()
        assert seen == ["detach"]


def test_set_mode_does_not_leak_between_asyncio_tasks() -> None:
    async def task(mode: str, ready: asyncio.Event, go: asyncio.Event, out: dict[str, Any]) -> None:
        gradguard.set_mode(mode)
        ready.set()
        await go.wait()  # the other task has set its mode meanwhile
        await asyncio.sleep(0)
        out[mode] = (gradguard.get_mode(), _stored(gradguard.guard([])))

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        go = asyncio.Event()
        readies = [asyncio.Event(), asyncio.Event()]
        tasks = [asyncio.create_task(task(m, r, go, out)) for m, r in zip(("off", "raise"), readies)]
        for r in readies:
            await r.wait()
        out["main"] = gradguard.get_mode()
        go.set()
        await asyncio.gather(*tasks)
        return out

    out = asyncio.run(main())
    assert out["off"] == ("off", "off")
    assert out["raise"] == ("raise", "raise")
    assert out["main"] == "detach"
    assert gradguard.get_mode() == "detach"


# --------------------------------------------------------------------------------------------------
# GRADGUARD in a fresh interpreter
# --------------------------------------------------------------------------------------------------

# One fresh interpreter per GRADGUARD value (each imports torch, so they are few and run at once).
# Given a JSON list of aliases, the probe first forks one child per alias from the imported but never
# resolved module; each child sets GRADGUARD itself, so its first use reads it.
_PROBE = r"""
import json, os, sys
import gradguard  # must never fail, whatever GRADGUARD says
out = {"imported": True}
if len(sys.argv) > 1:
    forked = out["forked"] = {}
    for raw in json.loads(sys.argv[1]):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.environ["GRADGUARD"] = raw
            try:
                answer = gradguard.get_mode()
            except gradguard.GradGuardError as e:
                answer = "error: " + str(e)
            os.write(w, answer.encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            forked[raw] = f.read()
        os.waitpid(pid, 0)
try:
    out["mode"] = gradguard.get_mode()
except gradguard.GradGuardError as e:
    out["error"] = str(e)
    try:
        gradguard.guard([]).append(1)
    except gradguard.GradGuardError as again:
        out["append_error"] = str(again)
print(json.dumps(out))
"""

_ALIASES = {
    "off": "off",
    "OFF": "off",
    "Off": "off",
    "0": "off",
    "false": "off",
    "False": "off",
    "detach": "detach",
    "DETACH": "detach",
    "on": "detach",
    "ON": "detach",
    "1": "detach",
    "true": "detach",
    "True": "detach",
    "warn": "warn",
    "WARN": "warn",
    "Warn": "warn",
    "raise": "raise",
    "RAISE": "raise",
    "strict": "raise",
    "STRICT": "raise",
    "Strict": "raise",
    "maybe": "error: GRADGUARD='maybe' is not a gradguard mode; accepted: " + _policy.ACCEPTED,
}
_DIRECT = {"STRICT": "raise", None: "detach"}  # "Off" and the rest: forked below
_BAD = "maybe"
_CAN_FORK = hasattr(os, "fork")


def _env(value: str | None) -> dict[str, str]:
    return _helpers.env(GRADGUARD=value)


@pytest.fixture(scope="module")
def fresh_interpreters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Each interpreter's answer, keyed by ``repr`` of its GRADGUARD value (computed once per run)."""
    return _helpers.once_per_run(tmp_path_factory, "fresh-interpreters", _ask_fresh_interpreters)


def _ask_fresh_interpreters(folder: Path) -> dict[str, dict[str, Any]]:
    """Start every interpreter at once, then collect their answers."""
    procs: dict[Any, subprocess.Popen[str]] = {}
    for value in [*_DIRECT, _BAD]:
        argv = [sys.executable, "-c", _PROBE]
        if value is None and _CAN_FORK:
            argv.append(json.dumps(list(_ALIASES)))
        procs[value] = subprocess.Popen(
            argv, env=_env(value), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    results = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"GRADGUARD={key!r}: exit {proc.returncode}\n{stderr}"
        results[repr(key)] = json.loads(stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("value", list(_DIRECT), ids=[repr(v) for v in _DIRECT])
def test_env_var_in_a_subprocess(fresh_interpreters: dict[str, dict[str, Any]], value: str | None) -> None:
    result = dict(fresh_interpreters[repr(value)])
    result.pop("forked", None)
    assert result == {"imported": True, "mode": _DIRECT[value]}


@pytest.mark.skipif(not _CAN_FORK, reason="needs os.fork")
def test_every_env_alias_case_insensitively(fresh_interpreters: dict[str, dict[str, Any]]) -> None:
    assert fresh_interpreters[repr(None)]["forked"] == _ALIASES


def test_bad_env_var_in_a_subprocess(fresh_interpreters: dict[str, dict[str, Any]]) -> None:
    result = fresh_interpreters[repr(_BAD)]
    assert result["imported"] is True and "mode" not in result
    for message in (result["error"], result["append_error"]):  # at first use, and again after
        assert "GRADGUARD" in message and repr(_BAD) in message
        for accepted in ("off", "0", "false", "detach", "on", "1", "true", "warn", "raise", "strict"):
            assert accepted in message


# --------------------------------------------------------------------------------------------------
# Graphs where the walk cannot rebuild
# --------------------------------------------------------------------------------------------------


class Opaque:
    """An object no container rule knows."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _holders() -> dict[str, Any]:
    x = torch.randn(3, requires_grad=True)
    return {
        "UserList": collections.UserList([x * 2]),
        "SimpleNamespace": __import__("types").SimpleNamespace(o=x * 2),
        "set": {x * 2},
        "dict key": {x * 2: 1},
        "opaque object": [Opaque(x * 2)],
    }


@pytest.mark.parametrize("name", list(_holders()))
def test_raise_refuses_a_graph_wherever_it_is_held(name: str) -> None:
    """raise mode must not store graphs inside containers the walk cannot enter."""
    rec = _holders()[name]
    store = gradguard.guard([], mode="raise", name="strict")
    with pytest.raises(GraphRetentionError, match="MulBackward0"):
        store.append(rec)
    assert store == []


@pytest.mark.parametrize("name", ["set", "dict key", "opaque object"])
def test_warn_says_what_it_had_to_store_as_it_is(name: str) -> None:
    rec = _holders()[name]
    store = gradguard.guard([], mode="warn", name="kept_store")
    with pytest.warns(GraphRetentionWarning, match=r"cannot rebuild what holds them .* stored as they are") as caught:
        store.append(rec)
    assert store[0] is rec  # stored, and said so
    assert "kept_store" in str(caught[0].message)


@pytest.mark.parametrize("name", ["UserList", "SimpleNamespace"])
def test_detach_rebuilds_the_common_holders(name: str) -> None:
    rec = _holders()[name]
    store = gradguard.guard([], name="det")
    store.append(rec)
    assert gradguard.find_graphs(store) == [] and gradguard.find_graphs(rec) != []
