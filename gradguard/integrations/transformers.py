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
the previous log, and the watch's ``gradguard/memory``, ``gradguard/graph_nodes`` and
``gradguard/pinned_bytes``, to the logged ``logs`` and to that step's entry of ``state.log_history``;
a summary line goes to ``logging.getLogger("gradguard")``. The Trainer calls the callbacks it was given
after its reporting integrations (``report_to``), so those do not see these values; the console
printer and ``state.log_history`` (``trainer_state.json``) do.

Importing this module imports ``transformers``; without it the import is a
:class:`gradguard.integrations.MissingFrameworkError`.
"""

from __future__ import annotations

from typing import Any

from . import WatchedRun, import_framework

import_framework("transformers", distribution="transformers", extra="transformers")  # the framework, or a clear error
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402

__all__ = ["GradGuardCallback"]

RETENTIONS = "gradguard/retentions"
RETAINED_BYTES = "gradguard/retained_bytes"


class GradGuardCallback(WatchedRun, TrainerCallback):
    """Audit for autograd graphs still held after each optimizer step of ``trainer.train()``, and act on the leaks.

    A boundary is each ``on_step_end`` (once per ``gradient_accumulation_steps`` micro-batches); what the
    audits found is added to the Trainer's next log, and in ``raise`` mode the ``GraphRetentionError``
    propagates out of ``trainer.train()``. ``watcher`` is this training run's :class:`gradguard.Watcher`,
    ``last_report`` its last audit's report of leaks; when training ends its summary goes to
    ``logging.getLogger("gradguard")``, a warning when a leak was found.

    Args:
        mode: As for :func:`gradguard.watch` (``None``: gradguard's effective mode).
        every: As for :func:`gradguard.watch`.
        ignore: As for :func:`gradguard.watch`.
        memory: As for :func:`gradguard.watch`.
    """

    _pending: dict[str, float] | None = None  # what the audits since the last log found

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A fresh watch for this run.

        Args:
            args: The Trainer's arguments.
            state: The Trainer's state.
            control: The Trainer's control.
            **kwargs: What else the Trainer passes (not read).
        """
        self.restart()
        self._pending = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """A step boundary (after each optimizer step); what an audit found waits for the next log.

        Args:
            args: The Trainer's arguments.
            state: The Trainer's state (its ``global_step`` numbers the boundary).
            control: The Trainer's control.
            **kwargs: What else the Trainer passes (not read).
        """
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
        """What the audits found since the last log and the watch's scalars (``gradguard/memory``,
        ``gradguard/graph_nodes``, ``gradguard/pinned_bytes``), added to this log's metrics and to its
        ``log_history`` entry.

        Args:
            args: The Trainer's arguments.
            state: The Trainer's state (its ``log_history`` gets the figures too).
            control: The Trainer's control.
            logs: The metrics being logged; ``None``: nothing is added.
            **kwargs: What else the Trainer passes (not read).
        """
        if logs is None:
            return
        added = {**self.scalars(), **(self._pending or {})}
        logs.update(added)
        # Trainer.log appended a copy of ``logs`` (plus "step") to log_history just before calling on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(added)
        self._pending = None

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The watch's summary to ``logging.getLogger("gradguard")``.

        Args:
            args: The Trainer's arguments.
            state: The Trainer's state.
            control: The Trainer's control.
            **kwargs: What else the Trainer passes (not read).
        """
        self.finish()
