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
``gradguard/retentions`` (holders) and ``gradguard/retained_bytes`` (what their graphs pin), and at
each logging step (``log_every_n_steps``) the watch's ``gradguard/memory``, ``gradguard/graph_nodes``
and ``gradguard/pinned_bytes``, so they reach ``trainer.logger`` and ``trainer.callback_metrics`` like
any metric; a summary line goes to ``logging.getLogger("gradguard")``.

Importing this module imports ``lightning``; without it the import is a
:class:`gradguard.integrations.MissingFrameworkError`.
"""

from __future__ import annotations

from typing import Any

from . import WatchedRun, import_framework

import_framework("lightning.pytorch", distribution="lightning", extra="lightning")  # the framework, or a clear error
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402

__all__ = ["GradGuardCallback"]


class GradGuardCallback(WatchedRun, Callback):
    """Audit for autograd graphs still held after each optimizer step of ``trainer.fit``, and act on the leaks.

    A boundary is a training batch after which ``trainer.global_step`` moved (every N-th batch with
    ``accumulate_grad_batches=N``); what an audit found is logged with ``pl_module.log``, and in ``raise``
    mode the ``GraphRetentionError`` propagates out of ``trainer.fit``. ``watcher`` is this fit's
    :class:`gradguard.Watcher`, ``last_report`` its last audit's report of leaks; at the end of the fit
    its summary goes to ``logging.getLogger("gradguard")``, a warning when a leak was found.

    Args:
        mode: As for :func:`gradguard.watch` (``None``: gradguard's effective mode).
        every: As for :func:`gradguard.watch`.
        ignore: As for :func:`gradguard.watch`.
        memory: As for :func:`gradguard.watch`.
    """

    _global_step: int | None = None  # the trainer's at the last boundary

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A fresh watch for this fit.

        Args:
            trainer: The trainer starting ``fit``.
            pl_module: Its module.
        """
        self.restart()
        self._global_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step counts optimizer steps: a batch that only accumulated gradients leaves it unchanged.
        """A step boundary when the optimizer stepped; what an audit found is logged as metrics.

        Args:
            trainer: The trainer (its ``global_step`` says whether the optimizer stepped).
            pl_module: Its module, which logs ``gradguard/retentions`` and ``gradguard/retained_bytes``, and
                the watch's scalars at each logging step.
            outputs: The batch's outputs (not read).
            batch: The batch (not read).
            batch_idx: The batch's index (not read).
        """
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
        if trainer.global_step % max(int(getattr(trainer, "log_every_n_steps", 1) or 1), 1) == 0:
            for name, value in self.scalars().items():
                pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The watch's summary to ``logging.getLogger("gradguard")``.

        Args:
            trainer: The trainer ending ``fit``.
            pl_module: Its module.
        """
        self.finish()
