"""Fixtures of the megatron-core integration tests (their helpers are in ``_megatron.py``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from types import ModuleType

import pytest
from _helpers import require_engine
from _megatron import SCHEDULES

from gradguard.engines import megatron as megatron_adapter


@pytest.fixture(scope="module")
def schedules() -> Iterator[ModuleType]:
    module = require_engine(SCHEDULES)
    # megatron's import leaves ~400k objects for every gc.collect() to scan (0.3-0.5 s each): park
    # them in the permanent generation so the collections below only see what the tests create.
    gc.collect()
    gc.freeze()
    try:
        yield module
    finally:
        gc.unfreeze()


@pytest.fixture(autouse=True)
def _default_loss_check() -> Iterator[None]:
    """Each test starts and ends with the adapter's default loss_check="warn"."""
    yield
    megatron_adapter.configure()
