"""Named roots (``gradguard._heap.roots``): an object named as a root is where the audit's path starts, in
preference to the module global that also reaches it (Ray's table of actor instances), and the fix is
spelled from it; a weakly named object names nothing once it is gone."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

import gradguard
from gradguard._heap import roots as _roots


class Trainer:
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []


TABLE: dict[str, dict[int, Trainer]] = {"actors": {}}  # as ray._private.worker.global_worker.actors


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    t = Trainer()
    TABLE["actors"][1] = t
    model = torch.nn.Linear(2, 1)
    for _ in range(3):
        loss = model(torch.randn(1, 2)).sum()
        loss.backward()  # a step's loss, kept after its backward: dead, so the watch may repair it
        t.losses.append(loss)
    yield t
    TABLE["actors"].clear()
    _roots.forget_root(t)


def _holders() -> list[tuple[str, str]]:
    return [(r.holder, r.fix) for r in gradguard.audit()]


def test_without_a_name_the_global_table_names_the_holder(trainer: Trainer) -> None:
    """Named from the framework's own table (what the audit says inside a Ray actor without a name for
    it); guarding that table would not release the graph (its items are objects a guard does not
    rebuild), so no guard is suggested there."""
    assert _holders() == [
        (
            f"{__name__}:TABLE['actors'][*].losses[*]",
            f"detach before storing into TABLE['actors'][1].losses[0] (in {__name__}): t.detach() or t.item()",
        )
    ]


def test_a_named_root_is_preferred_and_spells_the_path_and_the_fix(trainer: Trainer) -> None:
    _roots.name_root(trainer, "actor Trainer")
    report = gradguard.audit()
    assert [(r.holder, r.path, r.kind, r.tensors) for r in report] == [
        ("actor Trainer: self.losses[*]", "actor Trainer: self.losses[0]", "named", 3)
    ]
    assert report[0].fix == (
        "detach before storing into self.losses[0] (in actor Trainer): t.detach() or t.item(); "
        "or self.losses = gradguard.guard([]), which detaches what is stored, or refuses it in raise mode"
    )


def test_a_provider_is_asked_at_each_search_and_a_failing_one_names_nothing(trainer: Trainer) -> None:
    calls: list[int] = []

    def provider() -> list[tuple[object, str, str]]:
        calls.append(1)
        return [(trainer, "actor Trainer", "self")]

    def broken() -> list[tuple[object, str, str]]:
        raise RuntimeError("a framework whose internals moved")

    _roots.add_provider(broken)
    _roots.add_provider(provider)
    try:
        assert _holders()[0][0] == "actor Trainer: self.losses[*]"
        assert _holders()[0][0] == "actor Trainer: self.losses[*]"
        assert len(calls) == 2
    finally:
        _roots.remove_provider(provider)
        _roots.remove_provider(broken)
    assert _holders()[0][0].startswith(f"{__name__}:TABLE")


def test_a_weakly_named_object_is_forgotten_when_it_dies() -> None:
    t = Trainer()
    _roots.name_root(t, "actor Trainer")
    assert len(_roots.live_roots()) == 1
    del t
    gc.collect()
    assert _roots.live_roots() == []


def test_the_watch_repairs_through_a_named_root(trainer: Trainer) -> None:
    _roots.name_root(trainer, "actor Trainer")
    watcher = gradguard.Watcher(every=1, mode="detach")
    assert watcher.boundary() is not None  # the first audit stamps the graphs
    assert watcher.boundary() is not None  # one boundary later they are one step's graphs, bounded
    report = watcher.boundary()  # two: they do not go away
    assert report is not None and [r.holder for r in report] == ["actor Trainer: self.losses[*]"]
    assert all(loss.grad_fn is None for loss in trainer.losses)
    assert watcher.history()[0].outcome == "repaired"


@pytest.mark.parametrize(("label", "name"), [("", "self"), ("actor\nX", "self"), ("actor X", 3)])
def test_bad_labels_are_refused(label: object, name: object) -> None:
    with pytest.raises(gradguard.GradGuardError, match="name_root: .* is not accepted; give a non-empty printable"):
        _roots.name_root(Trainer(), label, name)  # type: ignore[arg-type]
