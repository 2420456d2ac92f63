"""The released leaks, each with the release that fixed it: what to install, which driver runs it.

A driver (``drivers/run_<key>.py``, the key's dashes as underscores) is one training script that uses
the library's public API the way its documentation shows, on a tiny random model and random data on
CPU; the same script runs on the leaky release and on the fixed one (where the fixed release removed
the API that leaked, the driver takes the documented replacement on that release, as ``fixed_by``
says).
"""

from __future__ import annotations

import dataclasses

__all__ = ["CASES", "Case", "Release", "by_key"]


@dataclasses.dataclass(frozen=True)
class Release:
    """One installable release: its environment's name and what goes into it.

    ``requirements`` are installed with their dependencies, ``no_deps`` without (a release whose
    declared pins no longer install on this Python, with what it needs listed in ``requirements``).
    """

    name: str
    requirements: tuple[str, ...]
    no_deps: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Case:
    """A leak that shipped, and its fix.

    ``holder`` says in words what keeps the graph in the leaky release (not what gradguard prints:
    that is measured), ``fixed_by`` what the fixing release changed, ``expect`` a fragment the holder
    gradguard names must contain to count as the right one. ``remedy``: how the benchmark applies the
    fix gradguard prints: ``"driver"``, the driver makes the change on the user's side
    (``GRADGUARD_FIELD_REMEDY=1``) on the leaky release; ``"upgrade"``, nothing on the user's side
    carries the graph and the fixed release is the remedy.
    """

    key: str
    library: str
    leaky: Release
    fixed: Release
    holder: str
    fixed_by: str
    expect: str
    steps: int = 24
    remedy: str = "driver"


_NUMPY = "numpy<2"
_PKG_RESOURCES = "setuptools<81"  # releases of the time import pkg_resources (gone from 81)
_TRL_DEPS = (
    "transformers==4.40.2",
    "accelerate==0.29.3",
    "datasets==2.19.1",
    "pyarrow==16.1.0",
    "tokenizers==0.19.1",
    "rich",
    _NUMPY,
)
_HF3_DEPS = (
    "tokenizers==0.15.2",
    _NUMPY,
    "filelock",
    "requests",
    "tqdm",
    "regex",
    "sentencepiece",
    "sacremoses",
    "six",
)
_VERL_DEPS = (
    "transformers==5.10.4",
    "tensordict==0.10.0",
    "ray==2.60.0",
    "omegaconf",
    "codetiming",
    "datasets",
    "pillow",
    "numpy",
    "peft==0.21.2",
    "accelerate==1.15.0",
)
_PL_DEPS = ("torchmetrics==0.11.4", "lightning-utilities==0.8.0", _NUMPY, _PKG_RESOURCES)

CASES: tuple[Case, ...] = (
    Case(
        key="torchmetrics",
        library="torchmetrics",
        leaky=Release("torchmetrics-0.7.2", ("torchmetrics==0.7.2", _NUMPY, _PKG_RESOURCES)),
        fixed=Release("torchmetrics-0.7.3", ("torchmetrics==0.7.3", _NUMPY, _PKG_RESOURCES)),
        holder="`Metric.update` accumulates the metric state (`MeanSquaredError.sum_squared_error`) with the "
        "prediction's graph",
        fixed_by="`update` runs with grad disabled outside `forward`",
        expect="sum_squared_error",
    ),
    Case(
        key="trl-cpo",
        library="TRL",
        leaky=Release("trl-0.8.3", ("trl==0.8.3", *_TRL_DEPS)),
        fixed=Release("trl-0.8.4", ("trl==0.8.4", *_TRL_DEPS)),
        holder="`CPOTrainer` stores the `nll_loss` metric with its graph in `_stored_metrics`",
        fixed_by="the metric is detached before it is stored",
        expect="_stored_metrics",
        remedy="upgrade",
    ),
    Case(
        key="transformers-trainer",
        library="transformers",
        leaky=Release("transformers-3.1.0", _HF3_DEPS, ("transformers==3.1.0",)),
        fixed=Release("transformers-3.2.0", _HF3_DEPS, ("transformers==3.2.0",)),
        holder="`Trainer.train` sums `training_step`'s loss, graph included, into `tr_loss`",
        fixed_by="`training_step` returns `loss.detach()`",
        expect="tr_loss",
    ),
    Case(
        key="verl-engine",
        library="verl",
        leaky=Release("verl-0.8.0", _VERL_DEPS, ("verl==0.8.0",)),
        fixed=Release("verl-0.9.1", _VERL_DEPS, ("verl==0.9.1",)),
        holder="the FSDP engine's `forward_backward_batch` keeps each micro-batch's `model_output` with its "
        "graph in `output_lst` and returns them",
        fixed_by="the engine detaches what it records",
        expect="model_output",
        remedy="upgrade",
    ),
    Case(
        key="lightning-epoch-end",
        library="PyTorch Lightning",
        leaky=Release("pytorch-lightning-1.9.5", ("pytorch-lightning==1.9.5", *_PL_DEPS)),
        fixed=Release("pytorch-lightning-2.0.0", ("pytorch-lightning==2.0.0", *_PL_DEPS)),
        holder="with `training_epoch_end` overridden, the loop keeps every `training_step` output (the keys "
        "besides `loss` with their graphs) in `_outputs` until the epoch ends",
        fixed_by="`training_epoch_end` removed (the documented replacement is `on_train_epoch_end`); the loop "
        "keeps no outputs",
        expect="_outputs",
    ),
    Case(
        key="ppe-reporting",
        library="pytorch-pfn-extras",
        leaky=Release("pytorch-pfn-extras-0.2.1", ("pytorch-pfn-extras==0.2.1", _NUMPY)),
        fixed=Release("pytorch-pfn-extras-0.4.0", ("pytorch-pfn-extras==0.4.0", _NUMPY)),
        holder="`reporting.report` copies a reported tensor with `clone()`, graph included, and `LogReport`'s summary "
        "sums the copies until its trigger fires (an epoch by default)",
        fixed_by="reported tensors are copied with `detach()` (since 0.3.0; the 0.3 releases import `torch._six`, "
        "which torch 2.13 no longer has, so 0.4.0, the first later release that imports, is measured)",
        expect="_summary",
    ),
)


def by_key(key: str) -> Case:
    """The case named ``key``.

    Raises:
        KeyError: no such case; the message lists the known keys.
    """
    for case in CASES:
        if case.key == key:
            return case
    raise KeyError(f"no field case {key!r}; the cases are: {', '.join(c.key for c in CASES)}")
