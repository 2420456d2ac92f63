"""Real libraries that rebuild containers accept a guarded store: accelerate's send_to_device
and lightning_utilities' apply_to_collection rebuild with ``type(obj)(...)``."""

from __future__ import annotations

import pytest
import torch
from _helpers import require_engine

import gradguard


@pytest.mark.integration
def test_accelerate_send_to_device_rebuilds_a_store() -> None:
    send_to_device = require_engine("accelerate.utils").send_to_device
    store = gradguard.guard([{"log_probs": torch.randn(2)}, {"log_probs": torch.randn(3)}], name="output_lst")
    moved = send_to_device(store, "cpu")
    assert isinstance(moved, list) and len(moved) == 2
    assert [torch.equal(a["log_probs"], b["log_probs"]) for a, b in zip(moved, store)] == [True, True]


@pytest.mark.integration
def test_lightning_apply_to_collection_rebuilds_a_store() -> None:
    apply_to_collection = require_engine("lightning_utilities.core.apply_func").apply_to_collection
    x = torch.randn(2)
    store = gradguard.guard([{"t": x}], name="outputs")
    doubled = apply_to_collection(store, torch.Tensor, lambda t: t * 2)
    assert isinstance(doubled, list) and torch.equal(doubled[0]["t"], x * 2)
    w = torch.ones(2, requires_grad=True)
    mapped = apply_to_collection(store, torch.Tensor, lambda t: t * w)  # a graph into a rebuilt store
    assert mapped[0]["t"].grad_fn is None  # the rebuilt store is guarded too: detached
