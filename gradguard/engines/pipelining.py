"""torch.distributed.pipelining: after ``step()``, nothing the schedule hands back or keeps carries a graph.

When a training ``step()`` returns, backward has run, yet torch still hands out graphs: the losses
it copies into the user's ``losses`` list, the merged output of ``return_outputs=True`` (a
``CatBackward0`` when the last stage returns a view), and the last stage's ``output_chunks`` entries
that are views (torch ``detach_()``es only the others). ``eval()`` keeps every graph, saved tensors
included. The adapter wraps ``PipelineScheduleSingle.step``, ``PipelineScheduleMulti.step`` and
``_PipelineSchedule.eval`` and, after the original returns, detaches all of these (the user's list is
updated in place). These graphs are torch's own, not a user's mistake, so in ``warn`` and ``raise``
modes too they are detached and counted, never warned about or refused; ``off`` does nothing.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

from .._boundary.publish import publish, publish_many
from .._errors import GradGuardWarning
from .._guards import patch as _patch
from .._policy.modes import DETACH, OFF, resolve
from ._adapter import Adapter

__all__ = ["ADAPTER"]

_TARGETS = (("PipelineScheduleSingle", "step"), ("PipelineScheduleMulti", "step"), ("_PipelineSchedule", "eval"))


def _stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        stage = getattr(schedule, "_stage", None)
        stages = [] if stage is None else [stage]
    return list(stages)


def _release(schedule: Any, losses: Any, result: Any) -> Any:
    """Detach the step's losses (in place), every stage's kept outputs, and the returned output."""
    if resolve(None) == OFF:
        return result
    if isinstance(losses, list) and losses:
        losses[:] = publish_many(list(losses), "pipelining.losses", DETACH)
    for stage in _stages(schedule):
        chunks = getattr(stage, "output_chunks", None)
        if isinstance(chunks, list) and chunks:
            chunks[:] = publish_many(list(chunks), "pipelining.output_chunks", DETACH)
        cache = getattr(stage, "fwd_cache", None)
        if isinstance(cache, dict) and cache:  # only non-empty after eval(): backward pops it
            for key, entry in list(cache.items()):
                cache[key] = publish(entry, "pipelining.fwd_cache", DETACH)
    return publish(result, "pipelining.step_output", DETACH)


def _step(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    if not getattr(instance, "_has_backward", False):
        return result  # no backward ran (eval, forward-only): eval's wrapper or the caller decides
    return _release(instance, kwargs.get("losses"), result)


def _eval(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    return _release(instance, kwargs.get("losses"), result)


class PipeliningAdapter(Adapter):
    """Detaches what torch.distributed.pipelining's schedules hand back and keep, after each step."""

    name = "pipelining"
    modules = ("torch.distributed.pipelining.schedules",)
    package = "torch"
    supported = ">=2.13"

    def instrument(self, module: ModuleType) -> None:
        """Patch the schedule classes of ``torch.distributed.pipelining.schedules`` (idempotent).

        Every method is looked up before any is patched: a torch whose schedules lack one (before
        2.13 some do) gets a warning saying so and is left unpatched, never half patched.
        """
        missing = [
            f"{cls_name}.{attr}"
            for cls_name, attr in _TARGETS
            if not callable(getattr(getattr(module, cls_name, None), attr, None))
        ]
        if missing:
            warnings.warn(
                f"gradguard: the {self.name} adapter supports torch{self.supported}; torch {self.version()} has no "
                f"{', '.join(missing)} in {module.__name__}, so its schedules are not instrumented (the records "
                "they keep are not detached). Upgrade torch, or guard the schedule's outputs yourself "
                "(gradguard.guard, gradguard.detach_tree).",
                GradGuardWarning,
                stacklevel=2,
            )
            return
        for cls_name, attr in _TARGETS:
            _patch.install(getattr(module, cls_name), attr, _eval if attr == "eval" else _step)

    def uninstrument(self, module: ModuleType) -> None:
        """Restore the original methods."""
        for cls_name, attr in _TARGETS:
            owner = getattr(module, cls_name, None)
            if owner is not None:
                _patch.uninstall(owner, attr)


ADAPTER = PipeliningAdapter()
