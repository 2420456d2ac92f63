"""The Lightning and Hugging Face Trainer callbacks, on the real frameworks, on tiny CPU models that leak
the field's way.

- Lightning: a ``LightningModule`` whose ``training_step`` keeps ``self.training_step_outputs.append(loss)``
  (the list the 2.0 migration guide moved into user code; pytorch-lightning #9343, #16520). Its frozen
  embedding's output is made a leaf that requires grad (PEFT's ``enable_input_require_grads``), so each
  kept loss pins that leaf and its ``.grad``: memory grows by ``PIN_BYTES`` per step.
- HF: a ``Trainer`` subclass whose ``compute_loss`` keeps ``self.loss_sum += loss`` (transformers #6999,
  ray #40940) on a tiny GPT-2 built from a config (no download): little memory, but the graph grows by
  one node per step.

Each leak is found with its path, warned about in ``warn`` mode, raised on in ``raise`` mode and repaired
in ``detach`` mode; the clean module and the clean Trainer give zero reports in ``raise`` mode.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from _helpers import require_engine

import gradguard
from gradguard.testing import MemoryProbe

VOCAB, DIM, BATCH, SEQ = 50, 64, 4, 32
PIN_BYTES = 2 * BATCH * SEQ * DIM * 4  # the embedding output made a leaf, and its .grad, float32
STEPS = 3
ROOT = Path(__file__).resolve().parents[2]
MADE: weakref.WeakSet[Any] = weakref.WeakSet()  # the modules and trainers the tests made


@pytest.fixture(autouse=True)
def _drop_kept_graphs() -> Iterator[None]:
    """A module or trainer of an earlier test can outlive it (Lightning's closures, HF's state): what it kept
    must not carry a graph into the next test's audits."""
    yield
    for obj in list(MADE):
        obj.forget()


# --------------------------------------------------------------------------------------------------
# Lazy imports: gradguard itself requires neither framework
# --------------------------------------------------------------------------------------------------


def test_frameworks_are_imported_lazily_and_a_missing_one_is_a_clear_error() -> None:
    code = (
        "import sys, gradguard, gradguard.integrations\n"
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers') if m in sys.modules))\n"
        "from gradguard.integrations import MissingFrameworkError\n"
        "for integration in ('lightning', 'transformers'):\n"
        "    sys.modules[integration] = None\n"  # what an uninstalled package looks like to import
        "    try:\n"
        "        __import__(f'gradguard.integrations.{integration}')\n"
        "    except MissingFrameworkError as exc:\n"
        "        assert isinstance(exc, ImportError) and isinstance(exc, gradguard.GradGuardError)\n"
        "        print(exc)\n"
        "    else:\n"
        "        raise SystemExit(f'{integration}: imported without its framework')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GRADGUARD", "GRADGUARD_AUDIT")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    first, *errors = proc.stdout.splitlines()
    assert first == "[]", proc.stdout  # import gradguard imported neither framework
    assert len(errors) == 2, proc.stdout
    for integration, message in zip(("lightning", "transformers"), errors):
        assert f"gradguard.integrations.{integration} needs {integration}, but `import " in message, message
        assert f"pip install 'gradguard[{integration}]'" in message, message


# --------------------------------------------------------------------------------------------------
# Lightning
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pl() -> SimpleNamespace:
    """Lightning and the tiny modules, built once the framework imported."""
    L = require_engine("lightning.pytorch")
    from lightning.pytorch.loggers import Logger

    from gradguard.integrations import lightning as integration

    class Module(L.LightningModule):
        """A frozen embedding whose output is made a leaf (PEFT style), one linear layer."""

        def __init__(self, keep: bool) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, DIM).requires_grad_(False)
            self.head = torch.nn.Linear(DIM, 1)
            self.keep = keep
            self.training_step_outputs: list[torch.Tensor] = []
            MADE.add(self)

        def forget(self) -> None:
            self.training_step_outputs.clear()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            hidden = self.embed(batch[0]).requires_grad_(True)
            loss = self.head(hidden).pow(2).mean()
            self.log("train_loss", loss, batch_size=BATCH)  # Lightning detaches what is logged
            if self.keep:
                self.training_step_outputs.append(loss)  # the leak: kept with its graph
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> torch.utils.data.DataLoader[Any]:
            ids = torch.randint(0, VOCAB, (4 * STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=BATCH)

    class Metrics(Logger):
        """A logger that keeps what it is given: (step, metrics) pairs."""

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[int | None, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "metrics"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.logged.append((step, dict(metrics)))

        def values(self, key: str) -> list[float]:
            return [m[key] for _, m in self.logged if key in m]

    class AfterStep(L.Callback):
        """Calls ``fn(trainer, module)`` after each optimizer step, after the callbacks before it."""

        def __init__(self, fn: Any) -> None:
            self.fn, self.step = fn, 0

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step != self.step:
                self.step = trainer.global_step
                self.fn(trainer, pl_module)

    def fit(module: Any, callbacks: list[Any], root: Path, **kwargs: Any) -> Any:
        logger = Metrics()
        trainer = L.Trainer(
            max_steps=STEPS,
            accelerator="cpu",
            devices=1,
            logger=logger,
            log_every_n_steps=1,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            callbacks=callbacks,
            **kwargs,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*(num_workers|does not have many workers).*")
            trainer.fit(module)
        return trainer, logger

    return SimpleNamespace(L=L, Module=Module, AfterStep=AfterStep, fit=fit, integration=integration)


def _holder(report: Any, pattern: str) -> Any:
    entries = [r for r in report if re.search(pattern, r.path)]
    assert len(entries) == 1, f"{pattern!r} is not the path of exactly one entry:\n{report}"
    return entries[0]


@pytest.mark.integration
def test_lightning_outputs_list_is_found_and_warned_about(pl: SimpleNamespace, tmp_path: Path) -> None:
    module = pl.Module(keep=True)
    callback = pl.integration.GradGuardCallback(mode="warn", every=1)
    audits: list[Any] = []
    first_audit = pl.AfterStep(lambda t, m: None if audits else audits.append(gradguard.audit()))
    with pytest.warns(gradguard.GraphRetentionWarning, match=r"training_step_outputs") as caught:
        _, logger = pl.fit(module, [callback, first_audit], tmp_path)
    # The first boundary holds only its own step's loss: audit() lists it, the watch does not act on it.
    first = list(audits[0])
    assert len(first) == 1 and re.search(r"\.training_step_outputs(\[\d+\])?$", first[0].path), audits[0]
    entry = _holder(callback.last_report, r"\.training_step_outputs(\[\d+\])?$")
    assert entry.tensors >= STEPS - 1
    retention = [w for w in caught if issubclass(w.category, gradguard.GraphRetentionWarning)]
    assert len(retention) == 1, [str(w.message) for w in retention]  # one warning per holder path
    retentions = logger.values("gradguard/retentions")
    assert len(retentions) == STEPS and retentions[0] == 0 and all(v == 1 for v in retentions[1:]), logger.logged
    assert all(b > 0 for b in logger.values("gradguard/retained_bytes")[1:]), logger.logged


@pytest.mark.integration
def test_lightning_outputs_list_raises_in_raise_mode(pl: SimpleNamespace, tmp_path: Path) -> None:
    module = pl.Module(keep=True)
    callback = pl.integration.GradGuardCallback(mode="raise", every=1)
    with pytest.raises(gradguard.GraphRetentionError, match=r"training_step_outputs"):
        pl.fit(module, [callback], tmp_path)
    assert len(module.training_step_outputs) == 2  # raised at the second boundary, the first step's loss kept


@pytest.mark.integration
def test_lightning_detach_mode_repairs_the_list_and_memory_stays_flat(pl: SimpleNamespace, tmp_path: Path) -> None:
    growth, graphs = {}, {}
    for mode in ("off", "detach"):
        module = pl.Module(keep=True)
        with MemoryProbe() as probe:
            callbacks = [pl.integration.GradGuardCallback(mode=mode, every=1), pl.AfterStep(lambda t, m: probe.step())]
            pl.fit(module, callbacks, tmp_path)
        growth[mode] = probe.growth_per_step
        graphs[mode] = [t.grad_fn is not None for t in module.training_step_outputs]
        module.forget()  # the off run's graphs must not reach the detach run's audits
    assert graphs["off"] == [True] * STEPS
    # every loss that survived a boundary was detached in place; the last step's is still its own
    assert graphs["detach"] == [False] * (STEPS - 1) + [True]
    assert growth["off"] >= PIN_BYTES, growth
    assert growth["detach"] < PIN_BYTES / 16, growth


@pytest.mark.integration
def test_lightning_audits_only_after_an_optimizer_step(pl: SimpleNamespace, tmp_path: Path) -> None:
    module = pl.Module(keep=True)
    callback = pl.integration.GradGuardCallback(mode="raise", every=1)
    with pytest.raises(gradguard.GraphRetentionError, match=r"training_step_outputs"):
        pl.fit(module, [callback], tmp_path, accumulate_grad_batches=2)
    # two batches per optimizer step: the first audit (step 1, after batch 2) records the graphs, the second
    # (step 2, after batch 4) finds them still there; a boundary per batch would have raised after batch 2
    step_audits = callback.watcher.audits - callback.watcher.figures().micro_searches  # the micro-batch clock's aside
    assert (callback.watcher.boundaries, step_audits) == (2, 2)
    assert len(module.training_step_outputs) == 4


@pytest.mark.integration
def test_lightning_clean_module_gives_zero_reports(pl: SimpleNamespace, tmp_path: Path) -> None:
    module = pl.Module(keep=False)
    callback = pl.integration.GradGuardCallback(mode="raise", every=1)
    audits: list[Any] = []
    trainer, logger = pl.fit(module, [callback, pl.AfterStep(lambda t, m: audits.append(gradguard.audit()))], tmp_path)
    assert callback.last_report is not None and len(callback.last_report) == 0
    assert float(trainer.callback_metrics["gradguard/retentions"]) == 0.0
    assert [len(a) for a in audits] == [0] * STEPS, audits  # nothing at all is held at Lightning's boundary
    assert logger.values("gradguard/retentions") == [0.0] * STEPS, logger.logged


@pytest.mark.integration
def test_lightning_logs_the_watchs_scalars_through_its_own_logger(pl: SimpleNamespace, tmp_path: Path) -> None:
    module = pl.Module(keep=True)
    callback = pl.integration.GradGuardCallback(mode="warn", every=1)
    with pytest.warns(gradguard.GraphRetentionWarning):
        trainer, logger = pl.fit(module, [callback], tmp_path)
    memory, nodes, pinned = (logger.values(f"gradguard/{k}") for k in ("memory", "graph_nodes", "pinned_bytes"))
    assert len(memory) == len(nodes) == len(pinned) == STEPS, logger.logged
    assert all(m > 0 for m in memory) and pinned[0] == 0 and pinned[-1] >= PIN_BYTES, logger.logged
    assert float(trainer.callback_metrics["gradguard/pinned_bytes"]) == pinned[-1]


# --------------------------------------------------------------------------------------------------
# Hugging Face Trainer
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf() -> Iterator[SimpleNamespace]:
    transformers: ModuleType = require_engine("transformers")
    from gradguard.integrations import transformers as integration

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the tiny config's token ids and loss type are not news

    class LossSum(transformers.Trainer):
        """A Trainer that keeps a running loss for its own logging, with the graph."""

        loss_sum: Any = 0.0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            MADE.add(self)

        def forget(self) -> None:
            self.loss_sum = 0.0

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):  # type: ignore[no-untyped-def]
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self.loss_sum = self.loss_sum + loss  # the leak: loss_sum += loss
            return loss

    class AfterStep(transformers.TrainerCallback):
        """Calls ``fn(trainer)`` at each step end, after the callbacks before it."""

        def __init__(self, fn: Any) -> None:
            self.fn, self.trainer = fn, None

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.fn(self.trainer)

    def train(cls: Any, callbacks: Any, root: Path, **kwargs: Any) -> Any:
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
        )
        model = transformers.GPT2LMHeadModel(config)
        g = torch.Generator().manual_seed(0)
        data = [{"input_ids": (ids := torch.randint(0, VOCAB, (SEQ,), generator=g)), "labels": ids} for _ in range(64)]
        args = transformers.TrainingArguments(
            output_dir=str(root),
            use_cpu=True,
            max_steps=STEPS,
            per_device_train_batch_size=2,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            **kwargs,
        )
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        trainer = cls(model=model, args=args, train_dataset=data, callbacks=callbacks)
        for callback in callbacks:
            if isinstance(callback, AfterStep):
                callback.trainer = trainer
        trainer.train()
        return trainer

    try:
        yield SimpleNamespace(
            Trainer=transformers.Trainer, LossSum=LossSum, AfterStep=AfterStep, train=train, integration=integration
        )
    finally:
        transformers.logging.set_verbosity(verbosity)


def _sums(loss_sum: Any) -> int:
    """How many ``loss_sum += loss`` the graph behind ``loss_sum`` still holds: the chain of additions."""
    node, adds = getattr(loss_sum, "grad_fn", None), 0
    while node is not None and node.name().startswith("AddBackward"):
        adds += 1
        node = node.next_functions[0][0]
    return adds


def _logged(trainer: Any, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


@pytest.mark.integration
def test_hf_loss_sum_is_found_and_warned_about(
    hf: SimpleNamespace, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    callback = hf.integration.GradGuardCallback(mode="warn", every=1)
    with pytest.warns(gradguard.GraphRetentionWarning, match=r"loss_sum") as caught:
        trainer = hf.train(hf.LossSum, callback, tmp_path)
    entry = _holder(callback.last_report, r"\.loss_sum$")
    assert entry.grad_fn == "AddBackward0"
    assert len([w for w in caught if issubclass(w.category, gradguard.GraphRetentionWarning)]) == 1
    assert _sums(trainer.loss_sum) == STEPS  # warn mode repairs nothing
    # the Trainer's own log history: the audits since each log, none before the leak was found, one after
    retentions = _logged(trainer, "gradguard/retentions")
    assert retentions[-1] == 1.0 and retentions == sorted(retentions) and set(retentions) <= {0.0, 1.0}, retentions
    assert "'gradguard/retentions': '1'" in capsys.readouterr().out  # the Trainer's console log line


@pytest.mark.integration
def test_hf_logs_the_watchs_scalars_in_its_own_logs(hf: SimpleNamespace, tmp_path: Path) -> None:
    callback = hf.integration.GradGuardCallback(mode="warn", every=1)
    with pytest.warns(gradguard.GraphRetentionWarning):
        trainer = hf.train(hf.LossSum, callback, tmp_path)
    memory, nodes, pinned = (_logged(trainer, f"gradguard/{k}") for k in ("memory", "graph_nodes", "pinned_bytes"))
    assert len(memory) == len(nodes) == len(pinned) >= STEPS, trainer.state.log_history
    assert all(m > 0 for m in memory) and nodes[-1] > 0, trainer.state.log_history


@pytest.mark.integration
def test_hf_loss_sum_raises_in_raise_mode(hf: SimpleNamespace, tmp_path: Path) -> None:
    callback = hf.integration.GradGuardCallback(mode="raise", every=1)
    with pytest.raises(gradguard.GraphRetentionError, match=r"loss_sum"):
        hf.train(hf.LossSum, callback, tmp_path)


@pytest.mark.integration
def test_hf_detach_mode_keeps_the_graph_from_growing(hf: SimpleNamespace, tmp_path: Path) -> None:
    chains, sums = {}, {}
    for mode in ("off", "detach"):
        chain: list[int] = []
        callbacks = [
            hf.integration.GradGuardCallback(mode=mode, every=1),
            hf.AfterStep(lambda t, chain=chain: chain.append(_sums(t.loss_sum))),
        ]
        trainer = hf.train(hf.LossSum, callbacks, tmp_path / mode, gradient_accumulation_steps=2)
        chains[mode], sums[mode] = chain, trainer.loss_sum.detach()
    assert chains["off"] == [2, 4, 6]  # two micro-batches per step, nothing repaired
    # repaired once the watch found it: never the chain the unwatched run ends with (when is the watch's schedule)
    assert max(chains["detach"]) < chains["off"][-1] and 0 in chains["detach"], chains
    assert torch.equal(sums["off"], sums["detach"])  # the running sum itself is the same


@pytest.mark.integration
def test_hf_clean_trainer_gives_zero_reports(hf: SimpleNamespace, tmp_path: Path) -> None:
    callback = hf.integration.GradGuardCallback(mode="raise", every=1)
    trainer = hf.train(hf.Trainer, callback, tmp_path)
    assert callback.last_report is not None and len(callback.last_report) == 0
    assert len(gradguard.audit()) == 0
    logged = _logged(trainer, "gradguard/retentions")
    assert logged and set(logged) == {0.0}, trainer.state.log_history


@pytest.mark.integration
@pytest.mark.parametrize("framework", ["pl", "hf"])
def test_a_bad_option_is_refused_when_the_callback_is_made(framework: str, request: pytest.FixtureRequest) -> None:
    make = request.getfixturevalue(framework).integration.GradGuardCallback
    with pytest.raises(gradguard.GradGuardError, match=r"every=0 is not accepted"):
        make(every=0)
    with pytest.raises(gradguard.GradGuardError, match=r"mode='loud' is not a gradguard mode"):
        make(mode="loud")
    with pytest.raises(gradguard.GradGuardError, match=r"ignore=3 is not accepted"):
        make(ignore=3)
    with pytest.raises(gradguard.GradGuardError, match=r"memory='yes' is not accepted"):
        make(memory="yes")


@pytest.mark.integration
@pytest.mark.parametrize("framework", ["pl", "hf"])
def test_the_callbacks_take_every_option_of_the_watch(framework: str, request: pytest.FixtureRequest) -> None:
    """The guide lists ``mode``, ``every``, ``ignore`` and ``memory`` "as for watch()": each is taken, and reaches
    the run's watcher, at construction and again when training starts."""
    import inspect

    make = request.getfixturevalue(framework).integration.GradGuardCallback
    assert list(inspect.signature(make).parameters) == ["mode", "every", "ignore", "memory"]
    assert set(inspect.signature(make).parameters) == set(inspect.signature(gradguard.watch).parameters)
    settings = gradguard.TriggerSettings()
    callback = make(mode="warn", every="auto", ignore=["x"], memory=settings)
    assert (callback.watcher.mode, callback.watcher.memory, callback.watcher.ignore) == ("warn", settings, ["x"])
    callback.restart()
    assert callback.watcher.memory is settings
    assert make(memory=False).watcher.memory is None
