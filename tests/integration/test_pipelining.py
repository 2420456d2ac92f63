"""``gradguard.enforce(engines=["pipelining"])`` against the real ``torch.distributed.pipelining``.

Two CPU processes over gloo run a tiny MLP split into two ``PipelineStage``s, with 8 micro-batches,
for ``Schedule1F1B`` and ``ScheduleGPipe``. The last stage returns either a view of its output
(``out[:, :4]``: torch's own ``detach_()`` skips views) or a contiguous copy. Each rank runs, with
fresh identical models and the same seeds, one training ``step(..., return_outputs=True)`` and then
one ``eval()`` in four variants: unguarded, inside ``enforce`` (detach), inside ``enforce`` with
mode ``raise`` (torch's own graphs are detached, never refused), and inside ``enforce`` with mode
``off``. A single spawn runs every case; the ranks write their findings to ``tmp_path`` and the tests
below assert on them.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import once_per_run, require_engine, require_gloo, run_ranks

pytestmark = pytest.mark.integration

N_MB = 8
BATCH = 32
WORLD = 2
SCHEDULES = ("1F1B", "GPipe")
CASES = [(s, view) for s in SCHEDULES for view in (True, False)]  # (schedule, last stage returns a view)
VARIANTS = ("plain", "guard", "raise", "off")  # plain = no enforce at all
SPAWN_TIMEOUT_S = 300  # spawned ranks import torch and the engine: slow on a loaded machine


# --------------------------------------------------------------------------------------------------
# What each rank runs (top level: spawn pickles these by reference)
# --------------------------------------------------------------------------------------------------


class _Part0(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc1(x))


class _Part1(torch.nn.Module):
    def __init__(self, view_output: bool) -> None:
        super().__init__()
        self.fc2 = torch.nn.Linear(32, 32)
        self.fc3 = torch.nn.Linear(32, 6)
        self.view_output = view_output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.fc3(torch.relu(self.fc2(h)))
        return out[:, :4] if self.view_output else out[:, :4].contiguous()


def _loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def _grad_fn_name(t: Any) -> str | None:
    return None if t.grad_fn is None else type(t.grad_fn).__name__


def _any_graph(obj: Any) -> bool:
    import gradguard

    return bool(gradguard.find_graphs(obj))


def _detached_counts() -> dict[str, int]:
    import gradguard

    counts: dict[str, int] = {}
    for site in gradguard.stats().values():
        counts[site.store] = counts.get(site.store, 0) + site.tensors_detached
    return counts


def _run_variant(rank: int, sched_name: str, view_output: bool, variant: str) -> dict[str, Any]:
    import contextlib

    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as sched
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import gradguard

    originals = {
        "PipelineScheduleSingle.step": sched.PipelineScheduleSingle.__dict__["step"],
        "PipelineScheduleMulti.step": sched.PipelineScheduleMulti.__dict__["step"],
        "_PipelineSchedule.eval": sched._PipelineSchedule.__dict__["eval"],
    }
    torch.manual_seed(0)
    parts = (_Part0(), _Part1(view_output))
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, 16), torch.randn(BATCH, 4)
    module = parts[rank]
    stage = PipelineStage(module, rank, WORLD, torch.device("cpu"))
    schedule_cls = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[sched_name]
    schedule = schedule_cls(stage, n_microbatches=N_MB, loss_fn=_loss_fn)
    inputs: tuple[Any, ...] = (x,) if rank == 0 else ()
    target = y if stage.is_last else None

    gradguard.reset_stats()
    if variant == "plain":
        scope: Any = contextlib.nullcontext()
    else:
        mode = {"guard": None, "raise": "raise", "off": "off"}[variant]
        scope = gradguard.enforce(mode=mode, engines=["pipelining"])
    rec: dict[str, Any] = {"is_last": stage.is_last}
    with scope:
        rec["patched_inside"] = (
            sched.PipelineScheduleSingle.__dict__["step"] is not originals["PipelineScheduleSingle.step"]
        )
        losses: list[Any] = []  # the user's list: everything below is read from this same object
        result = schedule.step(*inputs, target=target, losses=losses, return_outputs=True)
        rec["grads"] = {n: p.grad.detach().clone() for n, p in module.named_parameters()}
        if stage.is_last:
            rec["losses_len"] = len(losses)
            rec["losses_grad_fn"] = [_grad_fn_name(t) for t in losses]
            rec["losses_values"] = [t.detach().clone() for t in losses]
            rec["result_grad_fn"] = _grad_fn_name(result)
            rec["result_values"] = result.detach().clone()
            rec["chunks_len"] = len(stage.output_chunks)
            rec["chunks_is_view"] = [t._is_view() for t in stage.output_chunks]
            rec["chunks_grad_fn"] = [_grad_fn_name(t) for t in stage.output_chunks]
            rec["step_graphs"] = _any_graph([losses, result, stage.output_chunks])
        rec["step_detached"] = _detached_counts()

        gradguard.reset_stats()
        ev_losses: list[Any] = []
        ev_result = schedule.eval(*inputs, target=target, losses=ev_losses)
        rec["eval_fwd_cache_graphs"] = _any_graph(list(stage.fwd_cache.values()))
        if stage.is_last:
            rec["eval_losses_len"] = len(ev_losses)
            rec["eval_losses_grad_fn"] = [_grad_fn_name(t) for t in ev_losses]
            rec["eval_losses_values"] = [t.detach().clone() for t in ev_losses]
            rec["eval_result_grad_fn"] = _grad_fn_name(ev_result)
            rec["eval_result_values"] = ev_result.detach().clone()
            rec["eval_chunks_grad_fn"] = [_grad_fn_name(t) for t in stage.output_chunks]
        rec["eval_detached"] = _detached_counts()
    rec["restored"] = {
        "PipelineScheduleSingle.step": sched.PipelineScheduleSingle.__dict__["step"]
        is originals["PipelineScheduleSingle.step"],
        "PipelineScheduleMulti.step": sched.PipelineScheduleMulti.__dict__["step"]
        is originals["PipelineScheduleMulti.step"],
        "_PipelineSchedule.eval": sched._PipelineSchedule.__dict__["eval"] is originals["_PipelineSchedule.eval"],
        "Schedule1F1B.step": Schedule1F1B.step is originals["PipelineScheduleSingle.step"],
    }
    dist.barrier()
    return rec


def _worker(rank: int, init_method: str, outdir: str) -> None:
    import torch.distributed as dist

    os.environ.pop("GRADGUARD", None)  # the default mode (detach) must rule the "guard" variant
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=SPAWN_TIMEOUT_S),
    )
    try:
        results = {
            f"{s}/{'view' if v else 'contig'}/{variant}": _run_variant(rank, s, v, variant)
            for s, v in CASES
            for variant in VARIANTS
        }
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# One spawn for the whole module
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    require_engine("torch.distributed.pipelining")
    require_gloo()
    outdir = Path(once_per_run(tmp_path_factory, "pipelining-ranks", _spawn))
    return [torch.load(outdir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def _spawn(outdir: Path) -> str:
    run_ranks(_worker, WORLD, str(outdir), SPAWN_TIMEOUT_S)
    return str(outdir)


def _key(sched_name: str, view: bool, variant: str) -> str:
    return f"{sched_name}/{'view' if view else 'contig'}/{variant}"


case_params = pytest.mark.parametrize(
    "sched_name,view", CASES, ids=[f"{s}-{'view' if v else 'contig'}" for s, v in CASES]
)


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


@case_params
def test_unguarded_step_leaks_graphs(runs, sched_name, view):
    """Without the guard torch hands back graphs: this is what makes the guarded assertions meaningful."""
    last = runs[1][_key(sched_name, view, "plain")]
    assert last["is_last"]
    assert last["losses_len"] == N_MB
    assert last["losses_grad_fn"] == ["MseLossBackward0"] * N_MB
    assert last["step_graphs"]
    assert last["chunks_len"] == N_MB
    assert last["chunks_is_view"] == [view] * N_MB
    if view:  # torch detach_()es the non-view chunks itself, never the views
        assert all(g is not None for g in last["chunks_grad_fn"]), last["chunks_grad_fn"]
        assert last["result_grad_fn"] == "CatBackward0"
    else:
        assert last["chunks_grad_fn"] == [None] * N_MB
        assert last["result_grad_fn"] is None


@pytest.mark.parametrize("variant", ["guard", "raise"])
@case_params
def test_guarded_step_hands_back_no_graph(runs, sched_name, view, variant):
    plain, guarded = runs[1][_key(sched_name, view, "plain")], runs[1][_key(sched_name, view, variant)]
    assert guarded["is_last"] and guarded["patched_inside"]
    assert guarded["losses_len"] == N_MB
    assert guarded["losses_grad_fn"] == [None] * N_MB
    assert guarded["result_grad_fn"] is None
    assert guarded["chunks_len"] == N_MB
    assert guarded["chunks_grad_fn"] == [None] * N_MB
    assert not guarded["step_graphs"]
    # the values handed back are the unguarded ones, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(guarded["losses_values"], plain["losses_values"], strict=True))
    assert torch.equal(guarded["result_values"], plain["result_values"])
    # and the guard accounted what it detached: 8 losses, plus the 8 view chunks and their cat
    detached = guarded["step_detached"]
    assert detached.get("pipelining.losses") == N_MB, detached
    assert detached.get("pipelining.output_chunks", 0) == (N_MB if view else 0), detached
    assert detached.get("pipelining.step_output", 0) == (1 if view else 0), detached


@pytest.mark.parametrize("variant", ["guard", "raise", "off"])
@case_params
def test_guard_leaves_gradients_bitwise_equal(runs, sched_name, view, variant):
    for rank in range(WORLD):
        plain, other = runs[rank][_key(sched_name, view, "plain")], runs[rank][_key(sched_name, view, variant)]
        assert plain["grads"].keys() == other["grads"].keys()
        assert plain["grads"], f"rank {rank} recorded no grads"
        for name, g in plain["grads"].items():
            assert torch.equal(other["grads"][name], g), f"rank {rank} {name} differs under {variant}"


@case_params
def test_guarded_eval_hands_back_no_graph(runs, sched_name, view):
    plain, guarded = runs[1][_key(sched_name, view, "plain")], runs[1][_key(sched_name, view, "guard")]
    # unguarded eval() keeps everything: losses, merged output, output chunks, fwd_cache on both ranks
    assert plain["eval_losses_grad_fn"] == ["MseLossBackward0"] * N_MB
    assert plain["eval_result_grad_fn"] == "CatBackward0"
    assert all(g is not None for g in plain["eval_chunks_grad_fn"])
    assert all(runs[r][_key(sched_name, view, "plain")]["eval_fwd_cache_graphs"] for r in range(WORLD))
    # guarded: none of it carries a graph, values unchanged
    assert guarded["eval_losses_len"] == N_MB
    assert guarded["eval_losses_grad_fn"] == [None] * N_MB
    assert guarded["eval_result_grad_fn"] is None
    assert guarded["eval_chunks_grad_fn"] == [None] * N_MB
    assert not any(runs[r][_key(sched_name, view, "guard")]["eval_fwd_cache_graphs"] for r in range(WORLD))
    assert all(
        torch.equal(a, b) for a, b in zip(guarded["eval_losses_values"], plain["eval_losses_values"], strict=True)
    )
    assert torch.equal(guarded["eval_result_values"], plain["eval_result_values"])


@case_params
def test_mode_off_inside_enforce_leaves_graphs(runs, sched_name, view):
    off = runs[1][_key(sched_name, view, "off")]
    assert off["patched_inside"]  # installed, but the mode says do nothing
    assert off["losses_grad_fn"] == ["MseLossBackward0"] * N_MB
    assert off["eval_losses_grad_fn"] == ["MseLossBackward0"] * N_MB
    assert off["result_grad_fn"] == ("CatBackward0" if view else None)
    assert off["step_detached"] == {} and off["eval_detached"] == {}


@pytest.mark.parametrize("variant", ["guard", "raise", "off"])
@case_params
def test_exit_restores_original_methods(runs, sched_name, view, variant):
    for rank in range(WORLD):
        rec = runs[rank][_key(sched_name, view, variant)]
        assert rec["patched_inside"]
        assert rec["restored"] == dict.fromkeys(rec["restored"], True), rec["restored"]
