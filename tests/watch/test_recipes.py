"""A holder found before, read again by name: every graph tensor it reaches, and, read with ``newer=True``,
a list from where its first graph was at the previous such read (unless it became shorter)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch

from gradguard._heap.paths import Edge
from gradguard._watch.recipes import Recipe


@pytest.fixture
def program() -> Iterator[types.ModuleType]:
    module = types.ModuleType("gradguard_recipe_program")
    module.state = types.SimpleNamespace(kept=[])  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def _graph() -> torch.Tensor:
    return torch.randn(2, requires_grad=True) * 2


def _recipe(module: types.ModuleType) -> Recipe:
    state = module.state  # type: ignore[attr-defined]
    path = (
        Edge(module, "global", "state"),
        Edge(state, "attr", "kept"),
        Edge(state.kept, "item", 0),
    )
    recipe = Recipe.of(path)
    assert recipe is not None
    return recipe


def test_a_full_read_reaches_every_graph_and_skips_detached_records(program: types.ModuleType) -> None:
    kept = program.state.kept  # type: ignore[attr-defined]
    kept.extend([_graph(), _graph().detach(), _graph()])
    recipe = _recipe(program)
    found = recipe.resolve()
    assert [t for t, _ in found] == [kept[0], kept[2]]
    assert all(path[-1].key in (0, 2) for _, path in found)


def test_a_newer_read_starts_at_the_first_graph_of_the_last_one(program: types.ModuleType) -> None:
    kept = program.state.kept  # type: ignore[attr-defined]
    kept.extend([_graph().detach(), _graph().detach(), _graph()])
    recipe = _recipe(program)
    assert [t for t, _ in recipe.resolve(newer=True)] == [kept[2]]
    kept[0] = _graph()  # put back before where the last read began: left to the audits
    kept.append(_graph())
    assert [t for t, _ in recipe.resolve(newer=True)] == [kept[2], kept[3]]
    assert [t for t, _ in recipe.resolve()] == [kept[0], kept[2], kept[3]]  # a full read sees it
    kept[2], kept[3] = kept[2].detach(), kept[3].detach()
    assert recipe.resolve(newer=True) == []
    kept.append(_graph())
    assert [t for t, _ in recipe.resolve(newer=True)] == [kept[4]]  # only what came after


def test_a_list_that_became_shorter_is_read_whole(program: types.ModuleType) -> None:
    kept = program.state.kept  # type: ignore[attr-defined]
    kept.extend([_graph().detach() for _ in range(4)])
    recipe = _recipe(program)
    assert recipe.resolve(newer=True) == []
    kept.clear()
    kept.append(_graph())
    assert [t for t, _ in recipe.resolve(newer=True)] == [kept[0]]
