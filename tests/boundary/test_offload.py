"""``offload="cpu"``: published tensors also leave the accelerator.

Without a device, a CPU test double stands in for the move: ``_on_device`` says which tensors are
"on the accelerator", and ``_copy_to_host`` is a spy that clones.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import _helpers
import pytest
import torch

import gradguard
from gradguard._boundary import offload as _offload


class HostCopySpy:
    """Stands in for ``_copy_to_host``: records each tensor it is given and returns a clone."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.copies: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.seen.append(t)
        copy = t.clone()
        self.copies.append(copy)
        return copy


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch) -> Callable[[Callable[[torch.Tensor], bool]], HostCopySpy]:
    """Install the double; the argument decides which tensors count as on the device."""

    def install(on_device: Callable[[torch.Tensor], bool] = lambda t: True) -> HostCopySpy:
        spy = HostCopySpy()
        monkeypatch.setattr(_offload, "_on_device", on_device)
        monkeypatch.setattr(_offload, "_copy_to_host", spy)
        return spy

    return install


def graph(value: float = 1.0) -> torch.Tensor:
    return _helpers.graph(value, 3)


def test_every_published_tensor_is_moved_and_detached(fake_device: Any) -> None:
    spy = fake_device()
    store = gradguard.guard([], name="off", offload="cpu")
    rec = {"loss": 1.0, "model_output": {"log_probs": graph(1.0), "entropy": graph(2.0)}, "ids": torch.arange(4)}
    store.append(rec)

    stored = store[0]
    assert len(spy.seen) == 3  # each tensor of the record, the clean one too
    by_id = {id(c) for c in spy.copies}
    assert {id(stored["model_output"]["log_probs"]), id(stored["model_output"]["entropy"]), id(stored["ids"])} == by_id
    # the move sees tensors already detached: nothing stored carries a graph
    assert all(t.grad_fn is None and not t.requires_grad for t in spy.seen)
    assert gradguard.find_graphs(store) == []
    assert torch.equal(stored["model_output"]["entropy"], torch.full((3,), 4.0))
    assert stored["loss"] == 1.0
    # the caller's record is untouched
    assert rec["model_output"]["log_probs"].grad_fn is not None and rec["ids"] is not stored["ids"]


def test_every_entry_point_offloads(fake_device: Any) -> None:
    spy = fake_device()
    lst = gradguard.guard([None], offload="cpu")
    lst.append(graph())
    lst.extend([graph(), torch.ones(1)])
    lst.insert(0, graph())
    lst[0] = graph()
    lst[0:1] = [graph()]
    lst += [graph()]
    dct = gradguard.guard({}, offload="cpu")
    dct["a"] = graph()
    dct.update({"b": graph()}, c=graph())
    dct.setdefault("d", graph())
    dct |= {"e": graph()}
    dq = gradguard.guard(collections.deque(), offload="cpu")
    dq.append(graph())
    dq.appendleft(graph())
    dq.extend([graph()])
    dq.extendleft([graph()])
    stored = [
        t for t in [*gradguard.unwrap(lst), *gradguard.unwrap(dct).values(), *gradguard.unwrap(dq)] if t is not None
    ]
    assert len(spy.copies) == 16  # 7 into the list, 5 into the dict, 4 into the deque
    copies = {id(c) for c in spy.copies}
    assert all(id(t) in copies for t in stored)
    assert all(t.grad_fn is None for t in stored)


def test_containers_are_rebuilt_lazily(fake_device: Any) -> None:
    on_device: set[int] = set()
    spy = fake_device(lambda t: id(t) in on_device)
    store = gradguard.guard([], offload="cpu")

    host_branch = {"a": torch.zeros(2), "b": [torch.ones(2)]}
    device_tensor = torch.ones(2)
    on_device.add(id(device_tensor))
    rec = {"host": host_branch, "dev": {"x": device_tensor, "y": 3}}
    store.append(rec)
    stored = store[0]
    assert spy.seen == [device_tensor]
    assert stored is not rec and stored["dev"] is not rec["dev"]  # changed path rebuilt
    assert stored["dev"]["x"] is spy.copies[0] and stored["dev"]["y"] == 3
    assert stored["host"] is host_branch  # unchanged branch shared, not copied

    nothing_to_move = {"host": host_branch}
    store.append(nothing_to_move)
    assert store[1] is nothing_to_move  # nothing on the device and nothing to detach: same object
    assert len(spy.seen) == 1


def test_detach_and_move_compose(fake_device: Any) -> None:
    leaf = torch.ones(3, requires_grad=True)
    y = leaf * 3
    spy = fake_device(lambda t: t.data_ptr() == y.data_ptr())  # only y's storage is "on the device"
    store = gradguard.guard([], offload="cpu")
    store.append({"y": y, "z": torch.zeros(1)})
    assert len(spy.seen) == 1 and spy.seen[0].grad_fn is None  # the move got the detached y
    assert store[0]["y"] is spy.copies[0] and store[0]["y"].grad_fn is None
    assert y.grad_fn is not None


def test_raise_mode_refuses_before_moving(fake_device: Any) -> None:
    spy = fake_device()
    store = gradguard.guard([], mode="raise", offload="cpu")
    with pytest.raises(gradguard.GraphRetentionError):
        store.extend([torch.zeros(1), graph()])
    assert store == [] and spy.seen == []


def test_real_cpu_tensors_are_not_copied() -> None:
    store = gradguard.guard([], offload="cpu")
    t = torch.zeros(4)
    g = graph()
    store.append({"t": t, "g": g})
    assert store[0]["t"] is t  # already on the host: not moved
    assert store[0]["g"].data_ptr() == g.data_ptr()  # detached, sharing storage: no copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_land_on_the_host_pinned() -> None:
    store = gradguard.guard([], offload="cpu", name="cuda")
    leaf = torch.randn(1024, device="cuda", requires_grad=True)
    expected_lp = (leaf * 2).detach().cpu()
    rec = {"loss": 1.0, "model_output": {"log_probs": leaf * 2, "ids": torch.arange(8, device="cuda")}}
    store.append(rec)
    store.extend([{"x": leaf.exp()}])
    lp = store[0]["model_output"]["log_probs"]
    ids = store[0]["model_output"]["ids"]
    for t in (lp, ids, store[1]["x"]):
        assert t.device.type == "cpu"
        assert t.is_pinned()
        assert t.grad_fn is None and not t.requires_grad
    assert torch.equal(lp, expected_lp)  # the copy is complete when the append returns
    assert torch.equal(ids, torch.arange(8))
    assert rec["model_output"]["log_probs"].is_cuda
