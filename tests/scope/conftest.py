"""Fixtures of the scope tests: a user schedule module written on the fly."""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCHEDULE_SOURCE = """
import torch

LEAF = torch.ones(3, requires_grad=True)
NOT_CALLABLE = 3


def run_schedule(n, store):
    for i in range(n):
        store.append({"x": LEAF * 2, "i": i})  # APPEND-LINE
    return store


def run_with_default(n, store=None):
    if store is not None:
        store.append(LEAF * 2)
    return store


class Scheduler:
    def run(self, n, store):
        for i in range(n):
            store.append({"x": LEAF * 3})
        return store

    @staticmethod
    def srun(n, store):
        store.append(LEAF * 4)
        return store

    @classmethod
    def crun(cls, n, store):
        store.append(LEAF * 5)
        return store


class SubScheduler(Scheduler):
    pass
"""


@pytest.fixture
def sched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """A user schedule module, written on the fly under a unique name."""
    name = f"gg_schedule_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(SCHEDULE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    yield module
    sys.modules.pop(name, None)
