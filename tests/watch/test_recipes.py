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


def test_holders_found_bounded_are_followed_by_name_only_while_there_is_room() -> None:
    """A leaking holder is never forgotten for one found keeping a graph for one boundary: those are
    followed only while there is room, and forgotten first."""
    import types as _types

    from gradguard._heap.paths import Edge
    from gradguard._watch.known import MOST, Known

    module = _types.ModuleType("gradguard_known_program")
    sys.modules[module.__name__] = module
    try:

        def leak(name: str) -> _types.SimpleNamespace:
            setattr(module, name, [])
            path = (Edge(module, "global", name), Edge(getattr(module, name), "item", 0))
            return _types.SimpleNamespace(finding=_types.SimpleNamespace(paths=[path]), leaking=[0])

        known = Known()
        leaks = [leak(f"leak{i}") for i in range(MOST - 1)]
        known.remember(leaks)
        known.remember([leak("bounded0"), leak("bounded1")], bounded=True)
        keys = [r.key for r in known.recipes()]
        assert len(keys) == MOST and "gradguard_known_program:bounded1[*]" in keys
        assert "gradguard_known_program:bounded0[*]" not in keys  # one room left: the older bounded one gave way
        assert all(f"gradguard_known_program:leak{i}[*]" in keys for i in range(MOST - 1))
        known.remember([leak("late")])  # a new leak: the bounded one gives way, every leak stays
        keys = [r.key for r in known.recipes()]
        assert "gradguard_known_program:late[*]" in keys and not any("bounded" in k for k in keys)
        assert all(f"gradguard_known_program:leak{i}[*]" in keys for i in range(MOST - 1))
    finally:
        del sys.modules[module.__name__]
