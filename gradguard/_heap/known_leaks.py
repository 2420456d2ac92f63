"""Retention bugs that shipped in released packages and were fixed in a later release: data only.

Each entry says which package and versions keep an autograd graph, in what (the holder's shape),
the release that fixed it, where upstream says so, and the smallest change on the user's side until
they upgrade (``None``: nothing the user's code hands over can fix it). A finding whose holder matches
an entry (:func:`gradguard._heap.installed.known_leak`) says to upgrade; ``gradguard doctor`` lists
the installed packages an entry affects. ``affected`` lists the releases a driver of
``benchmarks/field`` measured leaking, no wider: to add an entry, add one here, its driver and case
there, and its row to the field benchmark's results (docs/reference/known-leaks.md).
"""

from __future__ import annotations

import dataclasses

__all__ = ["KNOWN_LEAKS", "KnownLeak"]


@dataclasses.dataclass(frozen=True)
class KnownLeak:
    """One released leak and its fix.

    Attributes:
        package: The top-level module, as gradguard names the library that owns a holder (``"pytorch_lightning"``).
        distribution: The name pip installs it by (``"pytorch-lightning"``).
        affected: The affected versions, a PEP 440 specifier (``"==1.9.5"``).
        fixed: The first release without the leak.
        reference: Where upstream records the fix.
        owner: What holds the graph inside the package: a module-qualified class (its subclasses match
            too) or, for a function's local, the function (``"transformers.trainer.Trainer.train"``).
        attribute: The attribute, key or local name on the holder's path inside the package that holds
            it; ``None``: any.
        hook: The package's method a user overrides whose return value the package keeps
            (``"pytorch_lightning.core.module.LightningModule.training_step"``); ``None`` where none is.
        remedy: The smallest change on the user's side, as code; ``None``: nothing the user's code hands
            over carries the graph, upgrading is the fix.
        what: What keeps the graph, in words.
    """

    package: str
    distribution: str
    affected: str
    fixed: str
    reference: str
    owner: str
    attribute: str | None
    hook: str | None
    remedy: str | None
    what: str


KNOWN_LEAKS: tuple[KnownLeak, ...] = (
    KnownLeak(
        package="torchmetrics",
        distribution="torchmetrics",
        affected="==0.7.2",
        fixed="0.7.3",
        reference="https://github.com/Lightning-AI/torchmetrics/releases/tag/v0.7.3",
        owner="torchmetrics.metric.Metric",
        attribute=None,
        hook=None,
        remedy="metric.update(preds.detach(), target)",
        what="Metric.update accumulates its state with the graph of the predictions it is given",
    ),
    KnownLeak(
        package="trl",
        distribution="trl",
        affected="==0.8.3",
        fixed="0.8.4",
        reference="https://github.com/huggingface/trl/releases/tag/v0.8.4",
        owner="trl.trainer.cpo_trainer.CPOTrainer",
        attribute="_stored_metrics",
        hook=None,
        remedy=None,
        what="CPOTrainer stores the nll_loss metric it computes, graph included, in _stored_metrics",
    ),
    KnownLeak(
        package="transformers",
        distribution="transformers",
        affected="==3.1.0",
        fixed="3.2.0",
        reference="https://github.com/huggingface/transformers/releases/tag/v3.2.0",
        owner="transformers.trainer.Trainer.train",
        attribute="tr_loss",
        hook="transformers.trainer.Trainer.training_step",
        remedy="return loss.detach() from a training_step override (super().training_step(model, inputs).detach())",
        what="Trainer.train sums training_step's loss, graph included, into tr_loss",
    ),
    KnownLeak(
        package="verl",
        distribution="verl",
        affected="==0.8.0",
        fixed="0.9.1",
        reference="https://github.com/volcengine/verl/releases/tag/v0.9.1",
        owner="verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead",
        attribute=None,
        hook=None,
        remedy=None,
        what="the FSDP engine's forward_backward_batch keeps each micro-batch's model_output with its graph",
    ),
    KnownLeak(
        package="pytorch_lightning",
        distribution="pytorch-lightning",
        affected="==1.9.5",
        fixed="2.0.0",
        reference="https://github.com/Lightning-AI/lightning/releases/tag/2.0.0",
        owner="pytorch_lightning.loops.epoch.training_epoch_loop.TrainingEpochLoop",
        attribute="_outputs",
        hook="pytorch_lightning.core.module.LightningModule.training_step",
        remedy='return {"loss": loss, "preds": preds.detach()} (every key besides "loss" detached), '
        "or stop overriding training_epoch_end",
        what="with training_epoch_end overridden, the loop keeps every training_step output until the epoch ends",
    ),
    KnownLeak(
        package="pytorch_pfn_extras",
        distribution="pytorch-pfn-extras",
        affected="==0.2.1",
        fixed="0.3.0",
        reference="https://github.com/pfnet/pytorch-pfn-extras/releases/tag/v0.3.0",
        owner="pytorch_pfn_extras.reporting.Summary",
        attribute=None,
        hook=None,
        remedy="ppe.reporting.report({name: value.detach()})",
        what="reporting.report copies a reported tensor with its graph and LogReport's summary sums the copies",
    ),
)
