"""The heap search's climb: every target a root reaches gets a path, whatever level each met the objects on
its way at."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch

from gradguard._heap import holders, paths


class Record:
    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


@pytest.fixture
def module() -> Iterator[types.ModuleType]:
    name = "gradguard_test_search_paths_program"
    program = types.ModuleType(name)
    sys.modules[name] = program
    try:
        yield program
    finally:
        del sys.modules[name]


def test_a_list_met_first_from_a_record_a_global_also_holds_is_climbed_for_the_older_ones(
    module: types.ModuleType,
) -> None:
    """The newest record is held by the list and by a global alias (``r = Record(...); RECS.append(r)``); the
    older ones' attributes live in a ``__dict__`` of their own (one level further from the list, as after
    anything read ``vars()`` of them). The list, met from the newest record and not climbed then (the alias
    held it), leads to the older ones one level later: its global must still be found."""
    x = torch.ones(2, requires_grad=True)
    module.RECS = [Record(x * (i + 1)) for i in range(4)]
    module.r = module.RECS[-1]
    for record in module.RECS[:-1]:
        vars(record)  # a __dict__ of its own
    found = holders.find_paths([record.loss for record in module.RECS])
    assert all(path is not None for path in found)
    spelled = [paths.spell(path) for path in found if path is not None]
    assert spelled[:3] == [f"{module.__name__}:RECS[{i}].loss" for i in range(3)]
