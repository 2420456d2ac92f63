"""Shared test helpers.

``require_engine(module)`` imports an engine for an integration test: a missing engine skips the test
locally and fails it when ``GRADGUARD_REQUIRE_ENGINES=1`` (CI), so CI cannot go green by skipping.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import pytest

import gradguard
from gradguard import _policy


def require_engine(module: str) -> ModuleType:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # engines warn about optional CUDA extras on import
            return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means the engine is unusable here
        if os.environ.get("GRADGUARD_REQUIRE_ENGINES") == "1":
            pytest.fail(f"{module} is required (GRADGUARD_REQUIRE_ENGINES=1) but failed to import: {exc!r}")
        pytest.skip(f"{module} not importable: {exc!r}")


@pytest.fixture(autouse=True)
def _isolate_gradguard_state():
    """Each test starts with no set_mode, fresh stats and a re-read GRADGUARD."""
    gradguard.set_mode(None)
    gradguard.reset_stats()
    _policy._reload_env()
    yield
    gradguard.set_mode(None)
    gradguard.reset_stats()
    _policy._reload_env()
