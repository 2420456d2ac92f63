"""``gradguard.audit()``: every field case found with the right path, grouping, pinned bytes counted once,
``ignore``, and an audit that changes nothing and keeps nothing alive. Real small modules, on the CPU."""

from __future__ import annotations

import collections
import gc
import json
import sys
import textwrap
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import gradguard
from gradguard._graph import memory as _graph
from gradguard._heap import paths as _paths
from gradguard._watch import audit as _audit
from gradguard.testing import assert_no_retention

HERE = "tests/watch/test_audit.py"


@pytest.fixture(autouse=True)
def _collected() -> None:
    """Start from a collected heap: the graphs of earlier tests' dropped modules wait in cycles
    otherwise, and every audit would climb through them (they are never listed: nothing reaches them)."""
    gc.collect()


def _module(monkeypatch: pytest.MonkeyPatch, name: str, source: str) -> types.ModuleType:
    """A real module in ``sys.modules`` (removed after the test) made of ``source``."""
    module = types.ModuleType(name)
    module.__dict__.update(torch=torch, nn=nn)
    exec(compile(textwrap.dedent(source), f"<{name}>", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def _entries(prefix: str, report: gradguard.RetentionReport | None = None) -> list[gradguard.Retention]:
    return [e for e in (report if report is not None else gradguard.audit()) if e.holder.startswith(prefix)]


def _one(prefix: str) -> gradguard.Retention:
    found = _entries(prefix)
    assert len(found) == 1, found
    return found[0]


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.max_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        self.max_logits = y.max()  # Megatron-LM's current_max_attn_logits, never detached
        return y


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


class Model(nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer() for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _loss(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(3, 4)).pow(2).mean()


LEAKY = """
HISTORY = []
class Cache:
    items = []
class LitModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.training_step_outputs = []
    def training_step(self, x):
        loss = self.net(x).pow(2).mean()
        self.training_step_outputs.append(loss)  # the Lightning 2.0 migration's list, never detached
        return loss
class Trainer:
    def __init__(self):
        self.metrics = {}
    def step(self, model, metrics, audit):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        metrics['loss_sum'] = metrics.get('loss_sum', 0) + loss
        return audit()
def make_accumulator():
    total = None
    def add(x):
        nonlocal total
        total = x if total is None else total + x
    return add
"""


# --------------------------------------------------------------------------------------------------
# The field cases, each found with the right path
# --------------------------------------------------------------------------------------------------


def test_a_global_list_of_100_records_is_one_entry_with_100_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_global", LEAKY)
    model = nn.Linear(4, 1)
    for step in range(100):
        m.HISTORY.append({"loss": model(torch.randn(2, 4)).sum(), "step": step})
    entry = _one("gg_leaky_global:")
    assert entry.holder == "gg_leaky_global:HISTORY[*]['loss']"
    assert entry.path == "gg_leaky_global:HISTORY[0]['loss']"
    assert (entry.kind, entry.tensors, entry.grad_fn, entry.shape) == ("global", 100, "SumBackward0", ())
    assert (entry.dtype, entry.device) == (torch.float32, torch.device("cpu"))
    assert entry.fix == (
        "detach before storing into HISTORY[0]['loss'] (in gg_leaky_global): t.detach() or t.item(); "
        "or HISTORY = gradguard.guard([]), which detaches what is stored, or refuses it in raise mode"
    )
    assert entry.pinned_bytes == gradguard.pinned_bytes([r["loss"] for r in m.HISTORY]) > 0


def test_lightning_training_step_outputs_on_a_module(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_lit", LEAKY + "lit = LitModule()\n")
    for _ in range(3):
        m.lit.training_step(torch.randn(2, 4))
    entry = _one("gg_leaky_lit:")
    assert entry.holder == "gg_leaky_lit:lit.training_step_outputs[*]"
    assert entry.path == "gg_leaky_lit:lit.training_step_outputs[0]"
    assert entry.tensors == 3
    assert entry.fix == (
        "detach before storing into lit.training_step_outputs[0] (in gg_leaky_lit): t.detach() or t.item(); "
        "or lit.training_step_outputs = gradguard.guard([]), which detaches what is stored, or refuses it in "
        "raise mode"
    )


def test_hf_tr_loss_accumulated_by_plus_equals_in_a_frame_local() -> None:
    class HFTrainer:
        def __init__(self) -> None:
            self.tr_loss = torch.zeros(())

    trainer = HFTrainer()
    model = Model()
    for _ in range(3):
        trainer.tr_loss += _loss(model)  # transformers #6999
    (entry,) = [e for e in _entries(HERE) if e.holder.endswith(": trainer.tr_loss")]
    fn = "test_hf_tr_loss_accumulated_by_plus_equals_in_a_frame_local"
    assert entry.holder == f"{HERE} in {fn}: trainer.tr_loss"
    assert entry.path.startswith(f"{HERE}:") and entry.path.endswith(f" in {fn}: trainer.tr_loss")
    assert (entry.kind, entry.tensors, entry.grad_fn) == ("local", 1, "AddBackward0")
    assert entry.thread == threading.current_thread().name
    assert entry.fix.startswith("detach before storing into trainer.tr_loss (in tests/watch/test_audit.py:")
    one_step = _graph.graph_memory([_loss(model).grad_fn], set())[1]
    assert entry.nodes > 2 * one_step  # the accumulator's graph grows by a step's nodes every step


def test_a_metrics_dict_that_is_a_named_argument_suggests_enforce_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_trl", LEAKY)
    model = nn.Linear(4, 1)
    metrics: dict[str, Any] = {}
    report = m.Trainer().step(lambda x: model(x), metrics, gradguard.audit)  # audited inside Trainer.step
    (entry,) = [e for e in report if e.holder.endswith("metrics['loss_sum']")]
    assert entry.holder == "<gg_leaky_trl> in Trainer.step: metrics['loss_sum']"
    assert entry.path.startswith("<gg_leaky_trl>:") and entry.path.endswith(" in Trainer.step: metrics['loss_sum']")
    assert entry.fix.startswith("detach before storing into metrics['loss_sum'] (in <gg_leaky_trl>:")
    assert entry.fix.endswith(
        '; or gradguard.enforce(stores={"gg_leaky_trl:Trainer.step": "metrics"}), which detaches what is stored, '
        "or refuses it in raise mode"
    )
    # once step() returned, the same dict is the test's own local
    (entry,) = [e for e in _entries(HERE) if e.holder.endswith("metrics['loss_sum']")]
    assert entry.fix.startswith("detach before storing into metrics['loss_sum'] (in tests/watch/test_audit.py:")
    assert entry.fix.endswith(
        "; or metrics = gradguard.guard({}), which detaches what is stored, or refuses it in raise mode"
    )


def test_a_trainer_metrics_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_attr", LEAKY + "trainer = Trainer()\n")
    model = nn.Linear(4, 1)
    m.trainer.metrics["loss_sum"] = model(torch.randn(2, 4)).sum()  # trl #1526
    entry = _one("gg_leaky_attr:")
    assert (entry.path, entry.holder) == ("gg_leaky_attr:trainer.metrics['loss_sum']",) * 2
    assert entry.fix == (
        "detach before storing into trainer.metrics['loss_sum'] (in gg_leaky_attr): t.detach() or t.item(); "
        "or trainer.metrics = gradguard.guard({}), which detaches what is stored, or refuses it in raise mode"
    )


def test_a_module_attribute_deep_in_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_megatron", "")
    m.model = Model(n=3)
    out = m.model(torch.randn(2, 4))
    del out
    entry = _one("gg_leaky_megatron:")
    assert entry.path == "gg_leaky_megatron:model.layers[0].attn.max_logits"
    assert entry.holder == "gg_leaky_megatron:model.layers[*].attn.max_logits"
    assert (entry.tensors, entry.grad_fn) == (3, "MaxBackward1")
    assert (
        entry.fix
        == "detach before storing into model.layers[0].attn.max_logits (in gg_leaky_megatron): t.detach() or t.item()"
    )


def _train_steps(model: nn.Module) -> Iterator[None]:
    loss_sum = torch.zeros(())
    while True:
        loss = _loss(model)
        loss_sum += loss  # ray #40940: the DeepSpeed template's accumulator
        del loss
        yield


def test_loss_sum_in_a_suspended_generator() -> None:
    steps = _train_steps(Model())
    for _ in range(3):
        next(steps)
    (entry,) = [e for e in _entries(HERE) if "_train_steps: loss_sum" in e.holder]
    assert entry.holder == f"{HERE} in _train_steps: loss_sum"
    assert entry.path.startswith(f"{HERE}:") and entry.path.endswith(" in _train_steps: loss_sum")
    assert entry.kind == "local" and entry.thread is None  # a suspended generator's frame runs in no thread
    assert entry.fix.startswith("detach before storing into loss_sum (in tests/watch/test_audit.py:")
    steps.close()


def test_a_closure_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_cell", LEAKY)
    m.add = m.make_accumulator()
    model = nn.Linear(4, 1)
    for _ in range(3):
        m.add(model(torch.randn(2, 4)).sum())
    (entry,) = [e for e in gradguard.audit() if "gg_leaky_cell" in e.holder]
    assert entry.holder == entry.path == "closure of gg_leaky_cell:make_accumulator.<locals>.add: total"
    assert (entry.kind, entry.grad_fn) == ("cell", "AddBackward0")


def test_a_class_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_class", LEAKY)
    model = nn.Linear(4, 1)
    m.Cache.items.extend(model(torch.randn(2, 4)) for _ in range(4))
    entry = _one("gg_leaky_class:")
    assert (entry.path, entry.holder, entry.kind) == (
        "gg_leaky_class:Cache.items[0]",
        "gg_leaky_class:Cache.items[*]",
        "global",
    )
    assert (entry.tensors, entry.grad_fn, entry.shape) == (4, "AddmmBackward0", (2, 1))
    assert entry.fix == (
        "detach before storing into Cache.items[0] (in gg_leaky_class): t.detach() or t.item(); "
        "or Cache.items = gradguard.guard([]), which detaches what is stored, or refuses it in raise mode"
    )


class Slotted:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def test_containers_are_spelled_as_python_does(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_spell", "")
    w = torch.ones(2, requires_grad=True)
    m.S = {"d": collections.deque([w * 1]), "t": (w * 2,), "s": {w * 3}, 7: [w * 4]}
    m.K = {w * 5: "key"}
    m.slotted = Slotted(w * 6)
    paths = sorted(e.path for e in _entries("gg_leaky_spell:"))
    assert paths == [
        "gg_leaky_spell:K.keys()[0]",
        "gg_leaky_spell:S['d'][0]",
        "gg_leaky_spell:S['s']{…}",
        "gg_leaky_spell:S['t'][0]",
        "gg_leaky_spell:S[7][0]",
        "gg_leaky_spell:slotted.value",
    ]


def test_a_heap_holder_names_a_tensor_before_a_frame_local(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_both", LEAKY)
    loss = nn.Linear(4, 1)(torch.randn(2, 4)).sum()
    m.HISTORY.append(loss)  # this step's loss is also a local here: the list is what keeps it
    assert _one("gg_leaky_both:").path == "gg_leaky_both:HISTORY[0]"
    assert not [e for e in _entries(HERE) if e.holder.endswith(": loss")]


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------


def test_pinned_bytes_count_each_storage_once_across_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_shared", "")
    x = torch.randn(64, 64, requires_grad=True)
    h = (x * 2).sin()  # saves 16 KiB of x * 2
    m.A, m.B = [h.cos()], [h.exp()]  # both graphs hold h's
    a, b = _entries("gg_leaky_shared:")
    both = gradguard.pinned_bytes([m.A, m.B])
    assert a.pinned_bytes + b.pinned_bytes == both
    assert gradguard.pinned_bytes(m.A) + gradguard.pinned_bytes(m.B) > both  # counted apart, they overlap
    assert a.pinned_bytes >= b.pinned_bytes  # sorted


def test_report_table_dict_len_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_report", LEAKY)
    m.HISTORY.extend(torch.ones(3, requires_grad=True) * i for i in range(5))
    report = gradguard.audit(ignore=lambda r: not r.holder.startswith("gg_leaky_report:"))
    assert len(report) == 1 and list(report) == [report[0]]
    assert report.pinned_bytes == report[0].pinned_bytes and report.tensors == 5
    table = str(report)
    assert (
        "gg_leaky_report:HISTORY[*]" in table and "MulBackward0" in table and "HISTORY = gradguard.guard([])" in table
    )
    assert [line.split()[:2] for line in table.splitlines() if line.startswith("holder")] == [["holder", "tensors"]]
    data = json.loads(json.dumps(report.to_dict()))
    assert data["holders"] == 1 and data["entries"][0]["dtype"] == "torch.float32"
    assert data["entries"][0]["shape"] == [3] and data["entries"][0]["tensors"] == 5
    empty = gradguard.audit(ignore=lambda r: True)
    assert len(empty) == 0 and "no live autograd graph" in str(empty)


def test_ignore_prefixes_and_predicates(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_ignore", LEAKY)
    m.HISTORY.append(torch.ones(2, requires_grad=True) * 2)
    m.Cache.items.append(torch.ones(2, requires_grad=True) * 3)
    assert len(_entries("gg_leaky_ignore:")) == 2
    assert [e.holder for e in _entries("gg_leaky_ignore:", gradguard.audit(ignore="gg_leaky_ignore:HIST"))] == [
        "gg_leaky_ignore:Cache.items[*]"
    ]
    assert (
        _entries("gg_leaky_ignore:", gradguard.audit(ignore=("gg_leaky_ignore:HISTORY", "gg_leaky_ignore:Cache"))) == []
    )
    assert _entries("gg_leaky_ignore:", gradguard.audit(ignore=lambda r: r.kind == "class"))[0].kind == "global"


@pytest.mark.parametrize("bad", [3, b"gg", [1], ["ok", None], "", [""], {"a": 1}])
def test_a_bad_ignore_is_a_clear_error(bad: Any) -> None:
    with pytest.raises(gradguard.GradGuardError, match=r"ignore=.* is not accepted; pass a path prefix"):
        gradguard.audit(ignore=bad)


def test_assert_no_retention(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_assert", LEAKY)
    assert_no_retention(ignore=lambda r: not r.holder.startswith("gg_leaky_assert:"))
    m.HISTORY.append(torch.ones(2, requires_grad=True) * 2)
    with pytest.raises(AssertionError, match=r"(?s)live autograd graphs are still held.*gg_leaky_assert:HISTORY\[0\]"):
        assert_no_retention(ignore=lambda r: not r.holder.startswith("gg_leaky_assert:"))
    assert_no_retention(ignore=lambda r: not r.holder.startswith("gg_leaky_assert:") or r.kind == "global")


# --------------------------------------------------------------------------------------------------
# An audit changes nothing and keeps nothing
# --------------------------------------------------------------------------------------------------


def test_an_audit_mutates_nothing_and_never_unpacks_a_saved_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    unpacked: list[int] = []

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(1)
        return t

    m = _module(monkeypatch, "gg_leaky_pure", LEAKY + "trainer = Trainer()\nlit = LitModule()\n")
    torch.manual_seed(0)
    model = Model()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        for step in range(3):
            m.HISTORY.append({"loss": _loss(model), "step": step})
            m.trainer.metrics["loss_sum"] = m.trainer.metrics.get("loss_sum", torch.zeros(())) + m.HISTORY[-1]["loss"]
            m.lit.training_step(torch.randn(2, 4))
    records = list(m.HISTORY)
    items = [list(r.items()) for r in m.HISTORY]
    metrics, outputs = dict(m.trainer.metrics), list(m.lit.training_step_outputs)
    state = {k: v for k, v in vars(m.lit).items()}
    fns = [r["loss"].grad_fn for r in records]
    report = gradguard.audit()
    assert _entries("gg_leaky_pure:", report)
    assert unpacked == []
    assert m.HISTORY == records and all(a is b for a, b in zip(m.HISTORY, records))
    assert [list(r.items()) for r in m.HISTORY] == items
    assert all(a is b for a, b in zip([r["loss"].grad_fn for r in m.HISTORY], fns))
    assert m.trainer.metrics.keys() == metrics.keys() and m.trainer.metrics["loss_sum"] is metrics["loss_sum"]
    assert all(a is b for a, b in zip(m.lit.training_step_outputs, outputs))
    assert all(vars(m.lit)[k] is v for k, v in state.items()) and vars(m.lit).keys() == state.keys()
    # the graphs still produce the gradients they would have: backward once, compare with a fresh twin
    m.trainer.metrics["loss_sum"].backward()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(0)
    twin = Model()
    total = torch.zeros(())
    for _ in range(3):  # the same computation, never audited
        total = total + _loss(twin)
        torch.randn(2, 4)
    total.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, twin.parameters()))


def test_an_audit_keeps_no_tensor_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_weak", LEAKY)
    model = Model()
    loss = _loss(model)  # a frame local: reading this frame's locals must not pin it
    kept = [_loss(model)]
    m.HISTORY.append({"loss": _loss(model)})
    steps = _train_steps(model)
    next(steps)
    refs = [weakref.ref(t) for t in (loss, kept[0], m.HISTORY[0]["loss"], steps.gi_frame.f_locals["loss_sum"])]
    findings = _audit.scan()
    assert {id(t) for f in findings for t in f.tensors} >= {id(r()) for r in refs}
    del findings
    report = gradguard.audit()
    assert len(report) >= 4
    del loss  # no gc.collect() anywhere: the audit left no cycle holding what it found
    assert refs[0]() is None
    del kept, steps
    m.HISTORY.clear()
    assert [r() for r in refs] == [None] * 4


def test_parameters_leaves_and_a_clean_training_loop_report_nothing() -> None:
    before = {e.holder for e in gradguard.audit()}
    model = Model()
    extra = nn.Parameter(torch.randn(3))  # a parameter and a leaf that requires grad: no graph
    leaf = torch.randn(3, requires_grad=True)
    params = [*model.parameters(), extra]
    for _ in range(3):
        loss = _loss(model) + (extra * leaf).sum()
        loss.backward()
        with torch.no_grad():  # SGD by hand: torch.optim's first step imports torch._dynamo (seconds)
            for p in params:
                p -= 0.1 * p.grad
                p.grad = None
        loss = loss.detach()  # the fixed loop: what is kept is detached
        for layer in model.layers:
            layer.attn.max_logits = None
    assert {e.holder for e in gradguard.audit()} - before == set()


def test_a_thread_mid_forward_is_listed() -> None:
    entered, release = threading.Event(), threading.Event()

    class Waits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = self.lin(x).relu()
            entered.set()
            release.wait(10)
            return hidden.sum()

    results: list[float] = []
    worker = threading.Thread(target=lambda: results.append(float(Waits()(torch.randn(2, 4)).detach())))
    worker.start()
    try:
        assert entered.wait(10)
        listed = [e for e in gradguard.audit() if "Waits.forward" in e.holder]
    finally:
        release.set()
        worker.join(10)
    assert [e.holder for e in listed] == [
        f"{HERE} in test_a_thread_mid_forward_is_listed.<locals>.Waits.forward: hidden"
    ]
    assert listed[0].grad_fn == "ReluBackward0" and listed[0].kind == "local"
    assert listed[0].thread == worker.name != threading.current_thread().name
    assert results and not [e for e in gradguard.audit() if "Waits.forward" in e.holder]


# --------------------------------------------------------------------------------------------------
# scan(): the live paths gradguard's tools repair through
# --------------------------------------------------------------------------------------------------


def test_scan_paths_lead_to_their_tensors_and_can_be_repaired(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_scan", LEAKY + "trainer = Trainer()\n")
    model = nn.Linear(4, 1)
    for step in range(3):
        m.HISTORY.append({"loss": model(torch.randn(2, 4)).sum(), "step": step})
    m.trainer.metrics["loss"] = model(torch.randn(2, 4)).sum()
    ours = [f for f in _audit.scan() if f.key.startswith("gg_leaky_scan:")]
    assert sorted(f.key for f in ours) == ["gg_leaky_scan:HISTORY[*]['loss']", "gg_leaky_scan:trainer.metrics['loss']"]
    for finding in ours:
        assert finding.key == finding.retention.holder
        for tensor, path in zip(finding.tensors, finding.paths):
            assert path[0].kind in _paths.ROOT_KINDS
            assert _paths.read(path[-1]) is tensor
            assert _paths.writable(path[-1])
            _paths.write(path[-1], tensor.detach())
    del ours, finding, tensor, path
    assert _entries("gg_leaky_scan:") == []
    assert all(r["loss"].grad_fn is None for r in m.HISTORY) and m.trainer.metrics["loss"].grad_fn is None


def test_scan_says_what_cannot_be_written(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_tuple", "")
    t = torch.ones(2, requires_grad=True) * 2
    m.HELD = (t,)
    del t
    (finding,) = [f for f in _audit.scan() if f.key.startswith("gg_leaky_tuple:")]
    (root, item) = finding.paths[0]
    assert (root.kind, root.key, item.kind, item.key) == ("global", "HELD", "item", 0)
    assert _paths.writable(root) and not _paths.writable(item)
    with pytest.raises(gradguard.GradGuardError, match="cannot replace"):
        _paths.write(item, finding.tensors[0].detach())
    assert m.HELD[0] is finding.tensors[0]


def test_frame_locals_and_cells_cannot_be_written() -> None:
    held = [torch.ones(2, requires_grad=True) * 2]
    (finding,) = [f for f in _audit.scan() if f.key.endswith(": held[*]")]
    local, item = finding.paths[0]
    assert (local.kind, local.key, item.kind, item.key) == ("local", "held", "item", 0)
    assert isinstance(local.owner, types.FrameType) and not _paths.writable(local)
    assert _paths.read(local) is held and _paths.writable(item)


def test_garbage_cycles_name_nothing() -> None:
    dead = types.ModuleType("gg_dead")  # never in sys.modules: its class, closure and generator are garbage
    exec(
        compile(
            textwrap.dedent(
                """
                class Cache:
                    items = []
                def make():
                    total = None
                    def add(x):
                        nonlocal total
                        total = x
                    return add
                def steps(x):
                    held = x * 2
                    yield
                """
            ),
            "<gg_dead>",
            "exec",
        ),
        dead.__dict__,
    )
    w = torch.ones(2, requires_grad=True)
    dead.Cache.items.append(w * 1)
    dead.add = dead.make()
    dead.add(w * 2)
    dead.gen = dead.steps(w)
    next(dead.gen)
    refs = [weakref.ref(dead.Cache.items[0]), weakref.ref(dead.gen)]
    enabled = gc.isenabled()
    gc.disable()  # keep the garbage uncollected while it is audited
    try:
        del dead
        assert all(r() is not None for r in refs)  # alive, in cycles nothing reaches
        report = gradguard.audit()
        assert [e for e in report if "gg_dead" in e.holder or "steps" in e.holder] == []
        assert all(r() is not None for r in refs)
    finally:
        if enabled:
            gc.enable()
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_a_dict_keyed_by_step_is_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _module(monkeypatch, "gg_leaky_steps", "OUTPUTS = {}\n")
    model = nn.Linear(4, 1)
    for step in range(5):
        m.OUTPUTS[step] = {"loss": model(torch.randn(2, 4)).sum()}
    entry = _one("gg_leaky_steps:")
    assert (entry.holder, entry.path, entry.tensors) == (
        "gg_leaky_steps:OUTPUTS[*]['loss']",
        "gg_leaky_steps:OUTPUTS[0]['loss']",
        5,
    )
    assert entry.fix == (
        "detach before storing into OUTPUTS[0]['loss'] (in gg_leaky_steps): t.detach() or t.item(); "
        "or OUTPUTS = gradguard.guard({}), which detaches what is stored, or refuses it in raise mode"
    )


def test_an_audit_from_a_debugger_prompt_keeps_the_debugged_frame_locals() -> None:
    """A trace function (pdb's prompt runs inside one) has the frame's locals written back from its
    snapshot after it returns: the audit must not empty that snapshot."""
    reports: list[gradguard.RetentionReport] = []

    def traced() -> tuple[torch.Tensor, int]:
        x = torch.ones(2, requires_grad=True) * 2
        y = 1  # the trace function audits before this line runs
        return x, y

    def tracer(frame: types.FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not traced.__code__:
            return None
        if event == "line" and not reports and "x" in frame.f_locals:
            reports.append(gradguard.audit())
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        x, y = traced()
    finally:
        sys.settrace(previous)
    assert [e.holder for e in reports[0] if "in " + traced.__qualname__ in e.holder] == [
        f"{HERE} in {traced.__qualname__}: x"
    ]
    assert y == 1 and x.grad_fn is not None


FROZEN_HISTORY: list[Any] = []


def test_a_holder_gc_freeze_froze_is_counted_and_the_report_says_why() -> None:
    """gc.freeze() hides objects from gc.get_objects() and gc.get_referrers(): a list made before the
    freeze cannot be named, so its graph must show up as untraced, with the reason, never vanish."""
    x = torch.ones(3, requires_grad=True)
    gc.freeze()
    try:
        FROZEN_HISTORY.append(x * 2)
        report = gradguard.audit(ignore=lambda e: "FROZEN_HISTORY" not in e.path)
        assert len(report) == 0 and report.untraced >= 1 and report.frozen > 0
        assert "gc.freeze()" in str(report) and report.to_dict()["frozen"] == report.frozen
    finally:
        gc.unfreeze()
    try:
        report = gradguard.audit(ignore=lambda e: "FROZEN_HISTORY" not in e.path)
        assert [e.path for e in report] == [f"{__name__}:FROZEN_HISTORY[0]"] and report.frozen == 0
    finally:
        FROZEN_HISTORY.clear()
