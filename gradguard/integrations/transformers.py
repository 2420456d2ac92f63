"""gradguard's step-boundary watch as a Hugging Face ``TrainerCallback``.

```python
from transformers import Trainer
from gradguard.integrations.transformers import GradGuardCallback

trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[GradGuardCallback(mode="warn")])
```

``on_step_end`` (the Trainer calls it after each optimizer step, so once per
``gradient_accumulation_steps`` micro-batches) passes one boundary to a
:class:`gradguard.Watcher`, which audits every ``every``-th boundary and acts on the leaks it
finds by ``mode``. At the Trainer's next log the callback adds ``gradguard/retentions`` (holders)
and ``gradguard/retained_bytes`` (what their graphs pin), the largest values of the audits since
the previous log, to the logged ``logs`` and to that step's entry of ``state.log_history``, and a
summary line goes to ``logging.getLogger("gradguard")``. The Trainer calls the callbacks it was given
after its reporting integrations (``report_to``), so those do not see the two values; the console
printer and ``state.log_history`` (``trainer_state.json``) do.

Importing this module imports ``transformers``; without it the import is a
:class:`gradguard.integrations.MissingFrameworkError`.
"""

from __future__ import annotations

from typing import Any

from .._watch.audit import Ignore
from .._watch.trigger import TriggerSettings
from . import WatchedRun, import_framework

import_framework("transformers", distribution="transformers", extra="transformers")  # the framework, or a clear error
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402

__all__ = ["GradGuardCallback"]

RETENTIONS = "gradguard/retentions"
RETAINED_BYTES = "gradguard/retained_bytes"


class GradGuardCallback(WatchedRun, TrainerCallback):
    """Audit for autograd graphs still held at the end of each optimizer step, and act on the leaks.

    ``mode`` (``"warn"``, ``"raise"``, ``"detach"``, ``"off"``, or ``None`` for gradguard's effective
    mode), ``every`` (audit every N-th optimizer step, or ``"auto"``), ``ignore`` (path prefixes or a
    predicate, for graphs kept on purpose) and ``memory`` (``every="auto"`` only: ``True`` audits when
    the memory figure grows, a :class:`gradguard.TriggerSettings` sets the rule, ``False`` schedules
    on time alone) are the watch's own (:func:`gradguard.watch`); bad values are refused here, at
    construction. In ``raise`` mode the ``GraphRetentionError`` propagates out of ``trainer.train()``.

    ``watcher`` is this run's :class:`gradguard.Watcher` (its ``summary()``, ``history()``,
    ``boundaries`` and ``audits``); ``last_report`` is the most recent audit's report of leaks (``None``
    before the first audit). At the end of training the watcher's summary goes to
    ``logging.getLogger("gradguard")``: a warning when an audit found a leak, else at info level.
    """

    def __init__(
        self,
        mode: str | None = None,
        every: int | str = "auto",
        ignore: Ignore = None,
        memory: bool | TriggerSettings = True,
    ) -> None:
        WatchedRun.__init__(self, mode, every, ignore, memory)
        self._pending: dict[str, float] | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.restart()
        self._pending = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        found = self.boundary(state.global_step)
        if found is None:
            return
        holders, pinned = found
        pending = self._pending or {RETENTIONS: 0.0, RETAINED_BYTES: 0.0}
        self._pending = {
            RETENTIONS: max(pending[RETENTIONS], holders),
            RETAINED_BYTES: max(pending[RETAINED_BYTES], pinned),
        }

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if self._pending is None or logs is None:
            return
        logs.update(self._pending)
        # Trainer.log appended a copy of ``logs`` (plus "step") to log_history just before calling on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)
        self._pending = None

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.finish()
