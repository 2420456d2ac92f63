"""gradguard's step-boundary watch as a Lightning callback.

```python
import lightning.pytorch as L
from gradguard.integrations.lightning import GradGuardCallback

trainer = L.Trainer(callbacks=[GradGuardCallback(mode="warn")])
```

At the end of every training batch after which the optimizer stepped (``trainer.global_step``
moved: with ``accumulate_grad_batches=N`` that is every N-th batch), the callback passes one
boundary to a :class:`gradguard.Watcher`, which audits every ``every``-th boundary and acts on
the leaks it finds by ``mode``. What an audit found is logged with ``pl_module.log`` as
``gradguard/retentions`` (holders) and ``gradguard/retained_bytes`` (what their graphs pin), so it
reaches ``trainer.logger`` and ``trainer.callback_metrics`` like any metric, and a summary line goes
to ``logging.getLogger("gradguard")``.

Importing this module imports ``lightning``; without it the import is a
:class:`gradguard.integrations.MissingFrameworkError`.
"""

from __future__ import annotations

from typing import Any

from .._watch.audit import Ignore
from .._watch.trigger import TriggerSettings
from . import WatchedRun, import_framework

import_framework("lightning.pytorch", distribution="lightning", extra="lightning")  # the framework, or a clear error
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402

__all__ = ["GradGuardCallback"]


class GradGuardCallback(WatchedRun, Callback):
    """Audit for autograd graphs still held at the end of each optimizer step, and act on the leaks.

    ``mode`` (``"warn"``, ``"raise"``, ``"detach"``, ``"off"``, or ``None`` for gradguard's effective
    mode), ``every`` (audit every N-th optimizer step, or ``"auto"``), ``ignore`` (path prefixes or a
    predicate, for graphs kept on purpose) and ``memory`` (``every="auto"`` only: ``True`` audits when
    the memory figure grows, a :class:`gradguard.TriggerSettings` sets the rule, ``False`` schedules
    on time alone) are the watch's own (:func:`gradguard.watch`); bad values are refused here, at
    construction. In ``raise`` mode the ``GraphRetentionError`` propagates out of ``trainer.fit``.

    ``watcher`` is this fit's :class:`gradguard.Watcher` (its ``summary()``, ``history()``,
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
        Callback.__init__(self)
        WatchedRun.__init__(self, mode, every, ignore, memory)
        self._global_step: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.restart()
        self._global_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts optimizer steps: a batch that only accumulated gradients leaves it unchanged.
        if self._global_step is None:
            self._global_step = trainer.global_step
            return
        if trainer.global_step == self._global_step:
            return
        self._global_step = trainer.global_step
        found = self.boundary(trainer.global_step)
        if found is not None:
            holders, pinned = found
            pl_module.log("gradguard/retentions", holders, on_step=True, on_epoch=False, batch_size=1)
            pl_module.log("gradguard/retained_bytes", pinned, on_step=True, on_epoch=False, batch_size=1)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.finish()
