"""Saved tensors on every torch: measured and judged without unpacking them. Where torch cannot show
a saved tensor without unpacking it (before 2.13), none is unpacked, none is counted, and gradguard
says so once (``gradguard._compat``'s degraded mode)."""

from __future__ import annotations

import warnings

import pytest
import torch

from gradguard import GradGuardWarning, _compat
from gradguard._graph import liveness, memory
from gradguard._graph.nodes import nodes


@pytest.fixture(params=["this torch", "a torch without SavedTensor.data, after a hook was set"])
def readable(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(_compat, "_said", set())
    if request.param != "this torch":
        monkeypatch.setattr(_compat, "SAVED_TENSORS_READABLE", False)
        monkeypatch.setattr(_compat, "_hooks_seen", True)
    return _compat.SAVED_TENSORS_READABLE


def _hooked_graph(unpacked: list[int]) -> torch.Tensor:
    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(1)
        return t

    w = torch.randn(64, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        return (torch.randn(8, 64) @ w).sin().sum()


def test_inspecting_a_hooked_graph_never_runs_its_unpack_hook(readable: bool) -> None:
    unpacked: list[int] = []
    y = _hooked_graph(unpacked)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pinned = memory.pinned_bytes(y)
        dead = [liveness.dead_node(n) for n in nodes([y.grad_fn])]
        memory.pinned_bytes(y)
    assert unpacked == []
    assert not any(dead)
    said = [w for w in caught if issubclass(w.category, GradGuardWarning)]
    leaf = 64 * 64 * 4  # w, a leaf that is no parameter, counts on every torch
    if readable:
        assert pinned > leaf and said == []
    else:
        assert pinned == leaf  # its saved tensors are not counted
        assert len(said) == 1, [str(w.message) for w in said]  # once per process, not once per call
        assert "torch>=2.13" in str(said[0].message)
    y.backward()
    assert unpacked  # the graph still trains: the hook runs when backward unpacks


@pytest.mark.skipif(_compat.SAVED_TENSORS_READABLE, reason="this torch shows saved tensors without unpacking")
def test_before_torch_2_13_setting_a_hook_is_noted_and_a_graph_without_one_is_judged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_compat, "_hooks_seen", False)
    w = torch.randn(4, 4, requires_grad=True)
    y = (torch.randn(2, 4) @ w).sin().sum()
    assert memory.pinned_bytes(y) > 0  # no hook was set: unpacked to measure, nothing else runs
    y.backward()
    assert any(liveness.dead_node(n) for n in nodes([y.grad_fn]))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        pass
    assert _compat._hooks_seen
