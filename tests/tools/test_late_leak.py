"""The late-leak building block of the bench: clean until its start step, then one dead graph per step that
pins exactly the bytes asked for, held by the trainer's state."""

from __future__ import annotations

import pytest
import torch

import gradguard
from gradguard._tools.bench.late_leak import LateLeak
from gradguard._watch.allocated import mallinfo2_reader

KiB = 1 << 10


def test_clean_until_start_then_one_dead_graph_per_step_pinning_the_bytes_asked_for() -> None:
    trainer = LateLeak("lora-checkpoint", start=3, bytes_per_step=64 * KiB)
    before = [p.detach().clone() for p in trainer.scenario.model.parameters() if p.requires_grad]
    with trainer.scope():
        for expected in range(1, 6):
            assert trainer.step() == expected
            assert [h["step"] for h in trainer.history] == list(range(3, expected + 1))
    after = [p for p in trainer.scenario.model.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # it trains
    for kept in trainer.history:
        assert gradguard.pinned_bytes(kept) == 64 * KiB  # the leaf and its .grad
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            kept["loss"].backward()  # dead: backward already freed it
    assert gradguard.pinned_bytes(trainer.history) == 3 * 64 * KiB


def test_the_leak_shows_in_the_allocators_figure_at_each_step() -> None:
    read = mallinfo2_reader()
    if read is None:
        pytest.skip("glibc's mallinfo2 is not the allocator in use here")
    trainer = LateLeak("lora-checkpoint", start=4, bytes_per_step=256 * KiB)
    figures = []
    with trainer.scope():
        for _ in range(6):
            trainer.step()
            figures.append(read())
    growth = [b - a for a, b in zip(figures, figures[1:])]
    assert all(g < 64 * KiB for g in growth[1:2])  # steps 2 -> 3: clean
    assert all(256 * KiB <= g < 256 * KiB + 64 * KiB for g in growth[2:])  # steps 4, 5, 6 leak


def test_never_leaks_without_a_start() -> None:
    trainer = LateLeak("lora-checkpoint", start=None)
    with trainer.scope():
        for _ in range(3):
            trainer.step()
    assert trainer.history == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"start": 0}, r"start=0 is not accepted; accepted: a step number >= 1, or None"),
        ({"start": 1, "bytes_per_step": 12}, r"bytes_per_step=12 is not accepted; accepted: a multiple of 8 >= 8"),
        ({"start": 1, "micro_batches": 0}, r"micro_batches=0 is not accepted; accepted: a whole number >= 1"),
    ],
)
def test_bad_arguments_name_the_value_and_what_is_accepted(kwargs: dict, message: str) -> None:
    with pytest.raises(gradguard.GradGuardError, match=message):
        LateLeak("lora-checkpoint", **kwargs)
