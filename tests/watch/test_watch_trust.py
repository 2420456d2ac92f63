"""A watch you can leave on: it never changes a correct program, never cries wolf, says what is true.

Each test pins one behaviour a watch left on must have: the repair leaves graphs that can still be
backwarded alone, the audit neither calls nor writes the program's objects, and the summary and the
fixes say only what is so (module-level scripts and torch.compile: ``test_no_false_alarm.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import logging.handlers
import re
import subprocess
import sys
import threading
import types
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _helpers import env
from _tables import flat
from torch import nn

import gradguard
import gradguard.testing
from gradguard import _compat
from gradguard._graph import liveness as _liveness
from gradguard._watch import allocated as _allocated

KEPT: list[Any] = []
HOLDERS: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    KEPT.clear()
    HOLDERS.clear()
    yield
    KEPT.clear()
    HOLDERS.clear()
    gc.collect()


def elsewhere(entry: gradguard.Retention) -> bool:
    """Graphs other tests of this process left behind are not this file's business."""
    return "test_watch_trust" not in entry.path


def params_of(*modules: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------------------------------
# The repair never changes a correct program
# --------------------------------------------------------------------------------------------------


class _InnerLoop:
    """An outer forward kept as object state while an auxiliary optimizer takes three steps on a
    detached copy, then the outer loss goes through it (inner adaptation, a critic's updates)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.encoder, self.head, self.aux = nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(8, 1)
        self.opt = torch.optim.SGD([*self.encoder.parameters(), *self.head.parameters()], lr=0.1)
        self.aux_opt = torch.optim.SGD(self.aux.parameters(), lr=0.1)
        self.data = torch.Generator().manual_seed(1)
        self.feats: torch.Tensor | None = None

    def step(self) -> None:
        x, y = torch.randn(4, 8, generator=self.data), torch.randn(4, 1, generator=self.data)
        self.feats = self.encoder(x).tanh()
        for _ in range(3):
            aux_loss = (self.aux(self.feats.detach()) - y).pow(2).mean()
            self.aux_opt.zero_grad()
            aux_loss.backward()
            self.aux_opt.step()
        loss = (self.head(self.feats) - y).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


@pytest.mark.parametrize("mode", ["detach", "warn", "raise"])
def test_an_outer_forward_kept_across_an_inner_loop_is_neither_judged_nor_repaired(mode: str) -> None:
    plain = _InnerLoop()
    for _ in range(3):
        plain.step()
    watched = _InnerLoop()
    with gradguard.watch(every=1, mode=mode, ignore=elsewhere) as scope:
        for _ in range(3):
            watched.step()
    assert equal(params_of(plain.encoder, plain.head), params_of(watched.encoder, watched.head))
    # every step boundary of every=1 audited; the micro-batch clock's searches (the outer forward is kept
    # across the inner backwards) besides, at its back-off's doubling gaps
    micro = scope.watcher.figures().micro_searches
    assert scope.watcher.history() == [] and scope.watcher.audits - micro == 12 and micro <= 4


def test_another_threads_forward_in_flight_is_not_repaired() -> None:
    """Thread B keeps its forward as state and waits; thread A steps twice meanwhile."""

    class TrainerB:
        def __init__(self) -> None:
            torch.manual_seed(1)
            self.model = nn.Linear(8, 1)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
            self.out: torch.Tensor | None = None

        def step(self, started: threading.Event, go: threading.Event) -> None:
            self.out = self.model(torch.ones(4, 8))
            started.set()
            go.wait(30)
            loss = self.out.pow(2).mean() + 1e-3 * self.model.bias.pow(2).sum()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()

    def run(watching: bool) -> TrainerB:
        b, started, go = TrainerB(), threading.Event(), threading.Event()
        HOLDERS["b"] = b  # reachable from a module global: judged at the other thread's boundaries
        scope = gradguard.watch(every=1, mode="detach", ignore=elsewhere) if watching else None
        worker = threading.Thread(target=b.step, args=(started, go))
        with scope if scope is not None else warnings.catch_warnings():
            worker.start()
            assert started.wait(30)
            m = nn.Linear(8, 1)
            o = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(3):
                m(torch.ones(4, 8)).pow(2).mean().backward()
                o.step()
            go.set()
            worker.join(30)
        if scope is not None:
            assert scope.watcher.history() == []
        return b

    assert equal(params_of(run(False).model), params_of(run(True).model))


class _Ema(nn.Module):
    """A running statistic used in the loss and kept with its graph: backward still runs through the
    earlier steps (no saved tensor on that path), so the leak is part of what the program computes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.ema = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mul = torch.ops.aten.mul.Scalar  # a Scalar operand saves a number, not a tensor
        self.ema = mul(self.ema, 0.9) + mul(self.w.sum(), 0.1)
        return (x * self.w).sum().pow(2) + self.ema


def test_a_kept_graph_that_later_losses_use_is_reported_live_and_left_alone() -> None:
    def run(mode: str | None) -> tuple[list[torch.Tensor], list[gradguard._watch.watcher.HolderHistory]]:
        torch.manual_seed(0)
        model = _Ema()
        HOLDERS["ema"] = model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scope = gradguard.watch(every=1, mode=mode, ignore=elsewhere) if mode else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with scope if scope is not None else warnings.catch_warnings():
                for _ in range(6):
                    loss = model(torch.randn(4))
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
        if mode == "detach":
            assert any("still usable for backward: not repaired" in str(w.message) for w in caught)
        return params_of(model), [] if scope is None else scope.watcher.history()

    plain, _ = run(None)
    repaired, history = run("detach")
    assert equal(plain, repaired)
    assert len(history) == 1, [(e.holder, e.outcome) for e in history]
    [entry] = history
    assert entry.holder.endswith("HOLDERS['ema'].ema") and entry.outcome == "live" and entry.alive


def test_a_cached_view_of_a_parameter_is_not_a_holder() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.proj = nn.Embedding(16, 8), nn.Linear(8, 8)
            self.dec_w = self.emb.weight.t()  # a view of the parameter, used by every forward

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.proj(self.emb(ids)) @ self.dec_w

    torch.manual_seed(0)
    model = Tied()
    HOLDERS["tied"] = model
    opt = torch.optim.SGD(model.proj.parameters(), lr=0.5)
    with gradguard.watch(every=1, mode="raise", ignore=elsewhere) as scope:
        for _ in range(4):
            ids = torch.randint(0, 16, (6,))
            nn.functional.cross_entropy(model(ids), ids).backward()
            opt.step()
    assert scope.watcher.history() == []
    assert not [e for e in gradguard.audit() if "dec_w" in e.path]
    assert model.dec_w.grad_fn is not None and model.dec_w._base is model.emb.weight  # untouched


@dataclasses.dataclass(frozen=True)
class _Record:
    step: int
    loss: torch.Tensor


def test_records_also_used_as_dict_keys_are_not_rebuilt_and_lookups_still_work() -> None:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records: list[_Record] = []
    seen: dict[_Record, int] = {}
    HOLDERS.update(records=records, seen=seen)
    with warnings.catch_warnings(record=True), gradguard.watch(every=1, mode="detach", ignore=elsewhere) as scope:
        warnings.simplefilter("always")
        for step in range(4):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            record = _Record(step, loss * 1)
            records.append(record)
            seen[record] = step
    assert all(r in seen for r in records) and all(r.loss.grad_fn is not None for r in records)
    outcomes = {e.outcome for e in scope.watcher.history()}
    assert outcomes == {"not repairable"}, scope.watcher.summary()


# --------------------------------------------------------------------------------------------------
# "repaired" only when a graph was released
# --------------------------------------------------------------------------------------------------


def test_holders_the_repair_cannot_rebuild_are_reported_not_repaired_and_stay_alive() -> None:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    callbacks: list[Any] = []
    keys: dict[Any, int] = {}
    sets: list[frozenset[Any]] = []
    HOLDERS.update(callbacks=callbacks, keys=keys, sets=sets)
    with (
        warnings.catch_warnings(record=True) as caught,
        gradguard.watch(every=1, mode="detach", ignore=elsewhere) as scope,
    ):
        warnings.simplefilter("always")
        for step in range(4):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            callbacks.append(functools.partial(print, loss * 1))
            keys[(step, loss * 2)] = step
            sets.append(frozenset([loss * 3]))
    history = {e.holder: e for e in scope.watcher.history()}
    assert len(history) == 3 and {e.outcome for e in history.values()} == {"not repairable"}, scope.watcher.summary()
    assert all(e.repaired == 0 and e.why for e in history.values()), [(e.holder, e.why) for e in history.values()]
    assert callbacks[0].args[0].grad_fn is not None  # still there, as the summary says
    stuck = [str(w.message) for w in caught if "cannot be repaired in place" in str(w.message)]
    assert len(stuck) == 3 and not [row for row in gradguard.stats().values() if row.store == "audit"]


def test_repaired_means_released_and_memory_stays_flat() -> None:
    """Records keeping a per-step leaf that requires grad (Megatron's receive buffer): repaired, the
    leaf and its grad are freed once a record has outlived a boundary, so at most the last two steps' pin."""
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    HOLDERS["records"] = records = []
    with gradguard.testing.MemoryProbe() as probe, gradguard.watch(every=1, mode="detach", ignore=elsewhere) as scope:
        for _ in range(16):
            received = torch.randn(32, 64, requires_grad=True)  # 8 KiB, and 8 KiB of grad after backward
            out = model(received).tanh()
            out.sum().backward()
            records.append({"out": out})
            opt.step()
            del received, out
            probe.step()
    [entry] = scope.watcher.history()
    assert entry.outcome == "repaired" and entry.repaired >= 14
    assert all(r["out"].grad_fn is None for r in records[:-2])
    growth = probe.growth_per_step
    assert growth < 8192 + 1024, growth  # the record's own 8 KiB per step; the 16 KiB pin is gone


# --------------------------------------------------------------------------------------------------
# The audit neither writes nor calls the program's objects
# --------------------------------------------------------------------------------------------------


def test_a_locals_snapshot_the_program_keeps_is_left_as_it_was() -> None:
    def train(lr: float = 0.1, steps: int = 3) -> tuple[dict[str, Any], dict[str, Any]]:
        hparams = locals()  # the frame's snapshot dict itself, before 3.13
        before = dict(hparams)
        model = nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        with gradguard.watch(every=1, mode="raise", ignore=elsewhere):
            for _ in range(steps):
                model(torch.randn(4, 8)).pow(2).mean().backward()
                opt.step()
        gradguard.audit()
        return before, hparams

    before, after = train()
    assert after == before == {"lr": 0.1, "steps": 3}


def test_the_path_search_calls_no_method_or_property_of_the_program() -> None:
    calls: list[str] = []

    class LazyList(list[Any]):
        def __iter__(self) -> Any:
            calls.append("LazyList.__iter__")
            raise ValueError("must not be called")

    class KeyDict(dict[Any, Any]):
        def __iter__(self) -> Any:
            calls.append("KeyDict.__iter__")
            raise ValueError("must not be called")

    class Err(Exception):
        @property  # type: ignore[override]
        def args(self) -> Any:
            calls.append("Err.args")
            raise ValueError("must not be read")

    class Opaque:
        @property  # type: ignore[misc]
        def __dict__(self) -> Any:
            calls.append("Opaque.__dict__")
            raise ValueError("must not be read")

    lazy, keyed, errors = LazyList(), KeyDict(), []
    HOLDERS.update(lazy=lazy, keyed=keyed, errors=errors)
    x = torch.ones(3, requires_grad=True)
    lazy.append(x * 2)
    keyed[x * 3] = 1
    error = Err()
    error.t = x * 4
    errors.append(error)
    report = gradguard.audit(ignore=elsewhere)
    assert calls == [] and len(report) == 3
    with pytest.raises(gradguard.GraphRetentionError):
        with gradguard.watch(every=1, mode="raise", ignore=elsewhere):
            model = nn.Linear(3, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                model(x.detach()).sum().backward()
                opt.step()
    assert calls == []


# --------------------------------------------------------------------------------------------------
# Say what is true, find every holder
# --------------------------------------------------------------------------------------------------


def test_a_summary_that_checked_nothing_says_so() -> None:
    watcher = gradguard.Watcher(every=5, mode="off")
    assert watcher.summary() == "gradguard watch: no optimizer step and no backward was seen: nothing was checked"
    x = torch.ones(2, requires_grad=True)
    for _ in range(3):
        _ = x * 2  # a node made in this thread: each boundary is a new step
        watcher.boundary()
    assert watcher.summary().endswith("3 step boundaries, 0 audited: no audit ran, nothing was checked")


def test_a_summary_says_what_the_all_clear_covers() -> None:
    # In a fresh interpreter: the start-up check stamps every graph alive in the process, and a graph
    # another test left where no root reaches it would be an old graph no holder was found for.
    code = (
        "import gradguard, torch\n"
        "watcher = gradguard.Watcher(every=5, mode='raise', memory=False)\n"
        "x = torch.ones(2, requires_grad=True)\n"
        "for _ in range(7):\n"
        "    (x * 2).sum().backward()  # a backward: its graph is stamped and followed\n"
        "    watcher.boundary()\n"
        "print(watcher.summary())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env(), timeout=300)
    assert run.returncode == 0, run.stderr
    text = flat(run.stdout)
    # the start-up check; no signal asked after it
    assert re.search(r"7 step boundaries \(\d+ backwards\), 2 audited", text), text
    assert "no graph the watch followed outlived two step boundaries" in text
    assert "graph nodes followed)" in text
    # the all-clear says what it does not cover: a graph no signal sees waits for an audit
    assert "found by an audit only: the last ran 5 step boundaries before the end" in text


def test_a_per_step_str_keyed_dict_is_one_holder_and_warns_once() -> None:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    metrics: dict[str, Any] = {}
    HOLDERS["metrics"] = metrics
    with (
        pytest.warns(gradguard.GraphRetentionWarning) as caught,
        gradguard.watch(every=1, mode="warn", ignore=elsewhere) as scope,
    ):
        for step in range(8):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            metrics[f"step{step}"] = loss
    assert len([w for w in caught if issubclass(w.category, gradguard.GraphRetentionWarning)]) == 1
    [entry] = scope.watcher.history()
    assert entry.holder.endswith("HOLDERS['metrics']['step*']") and entry.tensors >= 6


def test_an_alias_of_the_latest_record_is_named_through_the_container() -> None:
    model = nn.Linear(8, 1)
    holder = types.SimpleNamespace(history=[], last=None)
    HOLDERS["run"] = holder
    for step in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        record = {"step": step, "loss": loss}
        holder.history.append(record)
        holder.last = record  # the alias: one path shorter than the list
    paths = sorted(e.path for e in gradguard.audit(ignore=elsewhere))
    assert paths == [f"{__name__}:HOLDERS['run'].history[0]['loss']"], paths


class _Node:
    def __init__(self, value: Any = None) -> None:
        self.value, self.next = value, None


def test_a_holder_far_down_a_linked_list_is_found() -> None:
    head = tail = _Node()
    for _ in range(120):
        tail.next = _Node()
        tail = tail.next
    HOLDERS["head"] = head
    x = torch.ones(3, requires_grad=True)
    tail.next = _Node(x * 2)
    report = gradguard.audit(ignore=elsewhere)
    assert [e.path.count(".next") for e in report] == [121]


def test_ignore_given_as_a_generator_is_honoured_at_every_audit() -> None:
    on_purpose = f"{__name__}:KEPT"
    watcher = gradguard.Watcher(every=1, mode="raise", ignore=(p for p in [on_purpose, "tests/"]))
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        KEPT.append(loss)
        opt.step()
        watcher.boundary(opt)
    assert watcher.audits - watcher.figures().micro_searches == 4 and watcher.history() == []


def test_a_backwarded_graph_reports_the_nodes_it_keeps() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    for _ in range(2):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        KEPT.append(loss)
    [entry] = gradguard.audit(ignore=elsewhere)
    assert entry.pinned_bytes == 0 and entry.nodes == 14 and entry.node_bytes == 14 * gradguard._watch.audit.NODE_BYTES
    assert not entry.alive and "14 (~9.6 KiB)" in str(gradguard.audit(ignore=elsewhere))


# --------------------------------------------------------------------------------------------------
# A fix only where the user can apply it, and one that works
# --------------------------------------------------------------------------------------------------


def test_fixes_for_library_state_say_where_to_pass_a_detached_value() -> None:
    x = torch.ones(3, requires_grad=True)
    HOLDERS["callbacks"] = [functools.partial(print, x * 2)]
    log = logging.getLogger("gradguard-tests.fix")
    log.propagate = False
    handler = logging.handlers.BufferingHandler(capacity=100)
    log.addHandler(handler)
    HOLDERS["log"] = log
    try:
        log.warning("loss %s", x * 3)
        HOLDERS["error"] = _caught(x)
        fixes = {e.path: e.fix for e in gradguard.audit(ignore=elsewhere)}
    finally:
        log.removeHandler(handler)
    assert any("functools.partial" in f and "detach what you hand it" in f for f in fixes.values()), fixes
    assert any("logging.LogRecord" in f and "through your HOLDERS['log']" in f for f in fixes.values()), fixes
    assert any("traceback.clear_frames" in f for f in fixes.values()), fixes
    assert not any("gradguard.guard" in f for f in fixes.values()), fixes


def _caught(x: torch.Tensor) -> BaseException:
    kept = x * 4  # noqa: F841 - a local of this frame, which the exception's traceback keeps
    try:
        raise ValueError("boom")
    except ValueError as exc:
        return exc


def test_the_suggested_guard_fixes_the_leak() -> None:
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(store: Any) -> gradguard.Watcher:
        HOLDERS["history"] = store
        with gradguard.watch(every=1, mode="warn", ignore=elsewhere) as scope, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(4):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                loss.backward()
                store.append({"loss": loss, "step": 1})
                opt.step()
        return scope.watcher

    [entry] = train([]).history()
    assert entry.fix == (
        f"detach before storing into HOLDERS['history'][0]['loss'] (in {__name__}): t.detach() or t.item(); "
        f"or HOLDERS['history'] = gradguard.guard([]), which detaches what is stored, or refuses it in raise mode"
    )
    assert train(gradguard.guard([])).history() == []  # applying the guard, the holder keeps nothing


# --------------------------------------------------------------------------------------------------
# One audit at a time, refused decorations, python -c, liveness, what a repair gave back
# --------------------------------------------------------------------------------------------------


def test_audits_from_several_threads_run_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two searches side by side see each other's tables (lists of every object) and slow down many
    times over: they are serialised."""
    from gradguard._watch import audit as _audit

    running, overlaps = [0], []
    original = _audit.find_paths

    def counting(*args: Any, **kwargs: Any) -> Any:
        running[0] += 1
        overlaps.append(running[0])
        try:
            return original(*args, **kwargs)
        finally:
            running[0] -= 1

    monkeypatch.setattr(_audit, "find_paths", counting)
    KEPT.append(torch.ones(2, requires_grad=True) * 2)
    threads = [threading.Thread(target=gradguard.audit) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(overlaps) == 3 and max(overlaps) == 1


def test_forward_step_refuses_a_class() -> None:
    with pytest.raises(gradguard.GradGuardError, match=r"cannot decorate the class '.*Engine'.*def forward_step"):

        @gradguard.forward_step
        class Engine:
            pass


def test_warn_mode_in_python_dash_c_warns_instead_of_crashing() -> None:
    code = "import gradguard, torch\ns = gradguard.guard([])\ns.append(torch.ones(2, requires_grad=True) * 2)\n"
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env(GRADGUARD="warn"), timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "<string>:3: GraphRetentionWarning" in run.stderr


def test_liveness_of_the_common_shapes() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def alive(t: torch.Tensor, *held: torch.Tensor) -> bool:
        return _liveness.Liveness({h.grad_fn for h in held}).state(t.grad_fn).alive

    loss = model(torch.randn(2, 4)).pow(2).mean()
    assert alive(loss)
    loss.backward()
    assert not alive(loss)  # backward freed it
    out = model(torch.randn(2, 4))
    assert alive(out)
    opt.step()
    assert not alive(out)  # a weight it saved was updated in place
    kept = model(torch.randn(2, 4)).sum()
    kept.backward(retain_graph=True)
    assert alive(kept)
    total = torch.zeros(())
    for _ in range(3):
        step = model(torch.randn(2, 4)).pow(2).mean()
        total = total + step
        step.backward()
    assert not alive(total, step)  # the current loss is held, but its own graph is dead
    buffer = torch.randn(2, 4, requires_grad=True)
    residual = buffer + nn.Linear(4, 4)(buffer).relu()
    residual.sum().backward()
    assert not alive(residual)  # a backward to the buffer would run the freed branch too
    ckpt = torch.utils.checkpoint.checkpoint(model, torch.randn(2, 4, requires_grad=True), use_reentrant=False)
    assert alive(ckpt)
    ckpt.sum().backward()
    if _compat.SAVED_TENSORS_READABLE:  # before torch 2.13 a hooked saved tensor cannot be read: judged alive
        assert not alive(ckpt)


def test_what_a_repair_gave_back_is_measured_not_estimated() -> None:
    """Each kept record pins a 512 KiB leaf that required grad and its 512 KiB gradient: the memory in use
    before and after the repairs says what they gave back."""
    if _allocated.in_use() is None:
        pytest.skip("no exact figure of the memory in use here (glibc's mallinfo2)")
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    HOLDERS["received"] = received = []
    with gradguard.watch(every=1, mode="detach", ignore=elsewhere) as scope:
        for _ in range(10):
            leaf = torch.randn(512, 256, requires_grad=True)
            out = model(leaf).sum()
            out.backward()
            received.append(out)
            opt.step()
            opt.zero_grad()
    [entry] = scope.watcher.history()
    assert entry.outcome == "repaired" and entry.repaired >= 6
    assert entry.released_bytes >= 0.8 * entry.repaired * 1024 * 1024, (entry.released_bytes, entry.repaired)
    assert "of memory (measured)" in scope.watcher.summary()


def test_a_simple_namespaces_attribute_is_repaired() -> None:
    """``types.SimpleNamespace`` keeps its attributes in a plain instance dict: nothing runs when one is set."""
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    HOLDERS["state"] = state = types.SimpleNamespace(total=0.0)
    with gradguard.watch(every=1, mode="detach", ignore=elsewhere) as scope:
        for _ in range(5):
            out = model(torch.randn(4, 8))
            out.pow(2).mean().backward()
            state.total = state.total + out.sum()
            opt.step()
            opt.zero_grad()
    [entry] = scope.watcher.history()
    assert entry.outcome == "repaired", entry
