"""Clean training loops under the watch: no report at any step boundary.

Each stack runs ``STEPS`` training steps of its example's *guarded* path, the way the example guards
it, each step ending in a real ``torch.optim.AdamW.step()``, inside ``gradguard.watch(every=1,
mode="raise")``: no boundary raises. The first boundary's audit stamps every graph alive, and each
later boundary acts on what its signals show. The loop keeps every step's records in a ``history``
list (what a loop does for logging), which is harmless once they are detached. The same loop without
gradguard's guard raises :class:`gradguard.GraphRetentionError` naming that list by the last
boundary (a list holding graphs of two steps, one of which lived through a boundary, is a leak): the
check can fail.

- megatron-core, the real schedule: ``forward_backward_no_pipelining`` around a ``GPTModel``
  (``gradguard/_tools/bench/megatron_gpt.py``) with ``examples/megatron_gpt_schedule.py``'s ``loss_func``,
  under ``gradguard.enforce(engines=["megatron"])``;
- megatron-core, ``schedules.forward_step`` / ``backward_step`` on ``examples/megatron_forward_step.py``'s
  last stage and ``loss_func``, under the same ``enforce``;
- ``torch.distributed.pipelining``: ``examples/pipelining_two_ranks.py``'s halves, ``Schedule1F1B`` on
  two real gloo ranks (two spawned processes, each with its own optimizer and its own watch), under
  ``gradguard.enforce(engines=["pipelining"])``;
- transformers + peft: ``examples/peft_lora.py``'s LoRA Llama (built from a config, gradient
  checkpointing, ``enable_input_require_grads``) and its ``@gradguard.forward_step`` engine;
- ``examples/verl_style_engine.py``'s engine with ``@gradguard.forward_step``.

Every audit sees the whole process: graphs some other test file left behind before this module's first
stack test are ignored (by holder), unless they sit in the stacks' own packages. ``gc.freeze()`` hides from the audit
what frozen containers hold, so the tests require that nothing is frozen.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _helpers import once_per_run, require_engine, require_gloo, run_ranks

import gradguard

pytestmark = pytest.mark.integration

STEPS = 3
MICRO_BATCHES = 2
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STACK_PACKAGES = ("megatron", "transformers", "peft", "torch", "_example_")  # never ignored
SPAWN_TIMEOUT_S = 300  # spawned ranks import torch and the engine: slow on a loaded machine

Raised = list[tuple[int, list[str]]]  # (boundary, holders) of each GraphRetentionError


# --------------------------------------------------------------------------------------------------
# The loop every stack runs
# --------------------------------------------------------------------------------------------------


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (imported once per process; its ``main()`` is not run)."""
    module_name = f"_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def elsewhere() -> Callable[[gradguard.Retention], bool]:
    """``ignore=`` for what other test files left behind: the holders alive when this module's first
    stack test starts, except those in the stacks' own packages (a stack under test is never ignored)."""
    before = {entry.holder for entry in gradguard.audit()}
    return lambda entry: entry.holder in before and not any(p in entry.holder for p in STACK_PACKAGES)


def watched(
    step: Callable[[], Any], optimizer: torch.optim.Optimizer, ignore: Any = None, *, look: bool = False
) -> tuple[gradguard.Watcher, Raised, list[str]]:
    """``STEPS`` times ``step()`` then ``optimizer.step()``, inside ``gradguard.watch(every=1, mode="raise")``.

    What ``step()`` returns (the step's last loss or output, or ``None``) is held across
    ``optimizer.step()``, as a loop holds its ``loss``. With ``look``, the holders
    ``gradguard.audit()`` lists just before the last ``optimizer.step()`` are returned too. A
    ``GraphRetentionError`` comes out of ``optimizer.step()`` after the step completed, or out of a
    backward inside ``step()`` (the micro-batch clock: that step's remaining micro-batches are not run): it
    is recorded and the loop goes on (on two ranks, both must run every step)."""
    assert gc.get_freeze_count() == 0, "gc.freeze() is in force: the audit cannot see what frozen objects hold"
    raised: Raised = []
    seen: list[str] = []
    with gradguard.watch(every=1, mode="raise", ignore=ignore) as scope:
        for i in range(STEPS):
            try:
                current = step()
            except gradguard.GraphRetentionError as exc:
                raised.append((i + 1, sorted({entry.holder for entry in exc.report})))  # type: ignore[attr-defined]
                current = None
            if look and i == STEPS - 1:
                seen = sorted({entry.holder for entry in gradguard.audit(ignore=ignore)})
            try:
                optimizer.step()
            except gradguard.GraphRetentionError as exc:
                raised.append((i + 1, sorted({entry.holder for entry in exc.report})))  # type: ignore[attr-defined]
            optimizer.zero_grad()
            del current
    return scope.watcher, raised, seen


def assert_clean(watcher: gradguard.Watcher, raised: Raised, seen: list[str] | None = None) -> None:
    """No report; every step ended in an optimizer step the watch saw, the first one audited; with
    ``seen``, the audit did list the current step's graph that ``watched`` holds at the boundary (the
    watch judged it and left it alone)."""
    assert raised == [], raised
    assert watcher.boundaries == STEPS and watcher.audits >= 1, (watcher.boundaries, watcher.audits)
    assert watcher.history() == []
    if seen is not None:
        assert any(holder.endswith(" in watched: current") for holder in seen), seen


def assert_history_leaks(watcher: gradguard.Watcher, raised: Raised, *keys: str) -> None:
    """Found, in raise mode, naming only per-micro-batch or per-step stores that keep the records with each of
    ``keys``: the engine's own store within a step (the micro-batch clock), the loop's ``history`` across
    steps (the step clock), and again at the step boundaries after (the loop keeps leaking)."""
    assert raised, raised
    holders = [h for _, found in raised for h in found]
    assert holders and all("[*]" in h for h in holders), raised
    for key in keys:
        assert any(h.endswith(key) for h in holders), (key, raised)
    assert raised[-1][0] == STEPS, raised  # still leaking at the last boundary
    assert {e.outcome for e in watcher.history()} == {"raised"}


def assert_outcome(
    guarded: bool, watcher: gradguard.Watcher, raised: Raised, history: list[Any], seen: list[str] | None, *keys: str
) -> None:
    """Guarded: :func:`assert_clean`, and no graph left in ``history``; unguarded: the watch found
    ``history`` holding each of ``keys``."""
    if guarded:
        assert_clean(watcher, raised, seen)
        assert gradguard.find_graphs(history) == []
    else:
        assert_history_leaks(watcher, raised, *keys)


# --------------------------------------------------------------------------------------------------
# megatron-core
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron() -> Iterator[ModuleType]:
    """The megatron-gpt harness module, megatron imported, a world of one gloo rank (no gc.freeze)."""
    require_engine("megatron.core.pipeline_parallel.schedules")
    from gradguard._tools.bench import megatron_gpt

    megatron_gpt.ensure_world()
    try:
        yield megatron_gpt
    finally:
        megatron_gpt.teardown_world()


megatron_warnings = pytest.mark.filterwarnings(
    "ignore:Warning. tp_group is None:DeprecationWarning", "ignore::UserWarning:megatron"
)


@megatron_warnings
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_megatron_real_schedule(megatron: ModuleType, elsewhere: Any, guarded: bool) -> None:
    from gradguard._tools.bench.scenarios import Size

    loss_func = example("megatron_gpt_schedule").loss_func  # log_probs and entropy, undetached
    harness = megatron.GPTSchedule("cpu", Size(seq=32, batch=2, hidden=64, vocab=128), loss_func=loss_func)
    optimizer = torch.optim.AdamW(harness.model.parameters(), lr=1e-3)
    history: list[Any] = []

    def step() -> None:
        history.extend(harness.run(MICRO_BATCHES))  # forward_data_store

    with gradguard.enforce(engines=["megatron"]) if guarded else contextlib.nullcontext():
        watcher, raised, _ = watched(step, optimizer, elsewhere)
    # unguarded: the micro-batch clock raised out of a backward inside a step, whose records were not published
    assert len(history) == STEPS * MICRO_BATCHES if guarded else len(history) < STEPS * MICRO_BATCHES
    assert harness.redirected == STEPS or not guarded
    assert_outcome(guarded, watcher, raised, history, None, "['log_probs']", "['entropy']")


@megatron_warnings
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_megatron_forward_step(megatron: ModuleType, elsewhere: Any, guarded: bool) -> None:
    ex = example("megatron_forward_step")
    schedules, config = ex.import_megatron()
    torch.manual_seed(0)
    model = ex.LastStage()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    history: list[Any] = []

    def forward_step_func(data_iterator: Any, model: Any) -> tuple[torch.Tensor, Any]:
        return model(), partial(ex.loss_func, next(data_iterator))

    def step() -> torch.Tensor:
        """One step of forward_backward_no_pipelining's loop on the last stage: a fresh receive buffer
        (a leaf that requires grad) per micro-batch, the store kept to the end of the step; returns the
        last micro-batch's output (its graph, which backward ran through)."""
        targets = iter([torch.randn(ex.TOKENS, ex.OUT) for _ in range(MICRO_BATCHES)])
        store: list[Any] = []
        for i in range(MICRO_BATCHES):
            input_tensor = torch.randn(ex.TOKENS, ex.HIDDEN).requires_grad_(True)
            output_tensor, _ = schedules.forward_step(
                forward_step_func, targets, model, MICRO_BATCHES, input_tensor, store, config, 1,
                is_first_microbatch=(i == 0), current_microbatch=i, is_last_stage=True,
            )  # fmt: skip
            schedules.backward_step(input_tensor, output_tensor, None, config)
        history.extend(store)
        return output_tensor

    with gradguard.enforce(engines=["megatron"]) if guarded else contextlib.nullcontext():
        watcher, raised, seen = watched(step, optimizer, elsewhere, look=guarded)
    assert len(history) == STEPS * MICRO_BATCHES if guarded else len(history) < STEPS * MICRO_BATCHES
    assert_outcome(guarded, watcher, raised, history, seen, "['logits_mean']", "['logits_sq']")


# --------------------------------------------------------------------------------------------------
# torch.distributed.pipelining, two ranks
# --------------------------------------------------------------------------------------------------


def _pipelining_loop(ex: ModuleType, rank: int, guarded: bool) -> dict[str, Any]:
    """This rank's half of the example's MLP in ``Schedule1F1B``, ``STEPS`` watched steps, each rank
    with its own optimizer; the last stage keeps every step's ``losses``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    module = (ex.FirstHalf(), ex.SecondHalf())[rank]
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=ex.N_MICROBATCHES, loss_fn=ex.loss_fn)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    history: list[Any] = []

    def step() -> None:
        x, y = torch.randn(ex.BATCH, 16, generator=data), torch.randn(ex.BATCH, 4, generator=data)
        losses: list[torch.Tensor] = []
        if stage.is_last:
            output = schedule.step(target=y, losses=losses, return_outputs=True)
        else:
            output = schedule.step(x, losses=losses, return_outputs=True)
        history.extend(losses)
        del output  # the merged output: a graph of the current step only

    with gradguard.enforce(engines=["pipelining"]) if guarded else contextlib.nullcontext():
        watcher, raised, _ = watched(step, optimizer)
    return {
        "raised": raised,
        "boundaries": watcher.boundaries,
        "audits": watcher.audits,
        "outcomes": sorted({e.outcome for e in watcher.history()}),
        "history": len(history),
        "history_graphs": len(gradguard.find_graphs(history)),
    }


def _pipelining_rank(rank: int, init_method: str, outdir: str) -> None:
    """One rank (a spawned process): the guarded loop, then the unguarded one; results to ``outdir``."""
    import torch.distributed as dist

    os.environ.pop("GRADGUARD", None)
    os.environ.pop("GRADGUARD_AUDIT", None)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=SPAWN_TIMEOUT_S)
    )
    try:
        ex = example("pipelining_two_ranks")
        results = {}
        for guarded in (True, False):
            results["guarded" if guarded else "unguarded"] = _pipelining_loop(ex, rank, guarded)
            dist.barrier()
        Path(outdir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pipelining(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    require_engine("torch.distributed.pipelining")
    require_gloo()
    return once_per_run(tmp_path_factory, "clean-pipelining-ranks", _spawn_pipelining)


def _spawn_pipelining(outdir: Path) -> list[dict[str, Any]]:
    run_ranks(_pipelining_rank, 2, str(outdir), SPAWN_TIMEOUT_S)
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("rank", [0, 1])
def test_pipelining_two_ranks_guarded(pipelining: list[dict[str, Any]], rank: int) -> None:
    run = pipelining[rank]["guarded"]
    assert run["raised"] == [], run
    assert run["boundaries"] == STEPS and run["audits"] >= 1 and run["outcomes"] == [], run
    expected = STEPS * example("pipelining_two_ranks").N_MICROBATCHES if rank == 1 else 0  # losses: last stage
    assert run["history"] == expected and run["history_graphs"] == 0, run


def test_pipelining_two_ranks_unguarded_raises_on_the_last_stage(pipelining: list[dict[str, Any]]) -> None:
    last = pipelining[1]["unguarded"]
    boundaries = [boundary for boundary, _ in last["raised"]]
    assert boundaries and boundaries[-1] == STEPS, last
    for _, holders in last["raised"]:
        assert len(holders) == 1 and holders[0].endswith(" history[*]"), holders  # the kept losses
    assert last["outcomes"] == ["raised"], last
    first = pipelining[0]["unguarded"]  # the first stage hands back no loss: nothing of it outlives a step
    assert first["raised"] == [] and first["audits"] >= 1 and first["history"] == 0, first


# --------------------------------------------------------------------------------------------------
# transformers + peft LoRA with gradient checkpointing
# --------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5 renames gradient checkpointing
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_peft_lora_gradient_checkpointing(elsewhere: Any, guarded: bool) -> None:
    require_engine("transformers")
    require_engine("peft")
    ex = example("peft_lora")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = ex.GuardedEngine() if guarded else ex.Engine()
    assert engine.model.base_model.model.is_gradient_checkpointing
    optimizer = torch.optim.AdamW([p for p in engine.model.parameters() if p.requires_grad], lr=1e-3)
    data = torch.Generator().manual_seed(1)
    history: list[Any] = []

    def step() -> torch.Tensor:
        for _ in range(MICRO_BATCHES):
            micro_batch = {
                "input_ids": torch.randint(0, ex.VOCAB, (2, 32), generator=data),
                "labels": torch.randint(0, ex.VOCAB, (2, 32), generator=data),
                "advantages": torch.randn(2, 32, generator=data),
            }
            loss, output = engine.forward_step(micro_batch, loss_function=ex.policy_loss, forward_only=False)
            loss.backward()
            history.append(output)  # verl-style records, kept
        return loss  # the last micro-batch's: this step's graph

    watcher, raised, seen = watched(step, optimizer, elsewhere, look=guarded)
    assert len(history) == STEPS * MICRO_BATCHES if guarded else len(history) < STEPS * MICRO_BATCHES
    keys = ("['model_output']['log_probs']", "['model_output']['entropy']")
    assert_outcome(guarded, watcher, raised, history, seen, *keys)


# --------------------------------------------------------------------------------------------------
# The verl-style engine
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_verl_style_engine(elsewhere: Any, guarded: bool) -> None:
    ex = example("verl_style_engine")
    engine = ex.GuardedEngine() if guarded else ex.Engine()
    optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-3)
    micro_batches = ex.make_micro_batches()
    history: list[Any] = []

    def step() -> None:
        history.extend(engine.train_mini_batch(micro_batches[:MICRO_BATCHES], ex.ppo_like_loss))  # output_lst

    watcher, raised, _ = watched(step, optimizer, elsewhere)
    assert len(history) == STEPS * MICRO_BATCHES if guarded else len(history) < STEPS * MICRO_BATCHES
    keys = ("['model_output']['log_probs']", "['model_output']['entropy']", "['metrics']['entropy']")
    assert_outcome(guarded, watcher, raised, history, None, *keys)
