"""An engine adapter checks what it patches: a torch whose pipelining schedules lack a method the
adapter wraps (some releases before 2.13) gets a warning naming it, and nothing is patched, never
half of it."""

from __future__ import annotations

import types
import warnings

import pytest

from gradguard import GradGuardWarning
from gradguard._guards import patch as _patch
from gradguard.engines import pipelining


def _schedules(with_eval: bool) -> types.ModuleType:
    module = types.ModuleType("torch.distributed.pipelining.schedules")

    class _PipelineSchedule:
        pass

    if with_eval:
        _PipelineSchedule.eval = lambda self, *args, **kwargs: None  # type: ignore[attr-defined]

    class PipelineScheduleSingle(_PipelineSchedule):
        def step(self, *args: object, **kwargs: object) -> None:
            return None

    class PipelineScheduleMulti(_PipelineSchedule):
        def step(self, *args: object, **kwargs: object) -> None:
            return None

    for cls in (_PipelineSchedule, PipelineScheduleSingle, PipelineScheduleMulti):
        setattr(module, cls.__name__, cls)
    return module


def test_schedules_without_a_method_are_left_unpatched_with_a_warning() -> None:
    module = _schedules(with_eval=False)
    before = _patch.installed()
    with pytest.warns(GradGuardWarning, match=r"_PipelineSchedule\.eval.*not instrumented"):
        pipelining.ADAPTER.instrument(module)
    assert _patch.installed() == before
    assert not _patch.is_installed(module.PipelineScheduleSingle, "step")
    pipelining.ADAPTER.uninstrument(module)  # nothing to restore: no error either


def test_schedules_with_every_method_are_patched_and_restored() -> None:
    module = _schedules(with_eval=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradGuardWarning)
        pipelining.ADAPTER.instrument(module)
    try:
        assert _patch.is_installed(module.PipelineScheduleSingle, "step")
        assert _patch.is_installed(module._PipelineSchedule, "eval")
    finally:
        pipelining.ADAPTER.uninstrument(module)
    assert not _patch.is_installed(module.PipelineScheduleSingle, "step")
