"""torch.distributed.pipelining on two CPU ranks, with and without ``gradguard.enforce``.

The scenario: a small MLP is split into two ``PipelineStage``s (rank 0: ``Linear+ReLU``; rank 1:
``Linear+ReLU+Linear`` that returns the view ``out[:, :4]``), driven by ``Schedule1F1B`` with 8
micro-batches over gloo. The training loop asks for what most loops ask for: the per-micro-batch
losses (``losses=[]``) for logging and the merged output (``return_outputs=True``).

When ``step()`` returns, backward has already run, yet torch hands back graphs:

* every ``losses[i]`` is the very loss tensor backward ran through (``MseLossBackward0``), so each
  keeps its micro-batch's graph nodes, and through them the stage's receive buffer and its grad;
* torch ``detach_()``es the last stage's outputs after their backward, but not views (a view cannot
  be detached in place), so each ``stage.output_chunks[i]`` keeps its graph, and the merged output
  is a ``CatBackward0`` over all of them;
* all of it lives until the next ``step()`` (``output_chunks``) or as long as the user keeps the list.

Inside ``with gradguard.enforce(engines=["pipelining"]):`` the adapter detaches all of these once
``step()`` returns (the user's ``losses`` list is updated in place), and the gradients are bitwise
the same. Run: ``python examples/pipelining_two_ranks.py`` (a few seconds after the imports, CPU only).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gradguard

N_MICROBATCHES = 8
BATCH = 32


class FirstHalf(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc1(x))


class SecondHalf(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc2 = torch.nn.Linear(32, 32)
        self.fc3 = torch.nn.Linear(32, 6)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(h)))[:, :4]  # a view: torch's own detach_() skips it


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def train_step(rank: int) -> dict[str, Any]:
    """One training step on fresh, identically seeded halves; what is left over afterwards."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    halves = (FirstHalf(), SecondHalf())
    torch.manual_seed(1)
    x, y = torch.randn(BATCH, 16), torch.randn(BATCH, 4)
    module = halves[rank]
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)

    losses: list[torch.Tensor] = []
    if stage.is_last:
        output = schedule.step(target=y, losses=losses, return_outputs=True)
    else:
        output = schedule.step(x, losses=losses, return_outputs=True)

    kept = {"losses": losses, "step() output": output, "stage.output_chunks": stage.output_chunks}
    return {
        "graphs": gradguard.find_graphs(kept),
        "pinned_bytes": gradguard.pinned_bytes(kept),
        "loss_values": [float(t.detach()) for t in losses],
        "grads": {name: p.grad.clone() for name, p in module.named_parameters()},
    }


def worker(rank: int, port: int, queue: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    try:
        plain = train_step(rank)
        gradguard.reset_stats()
        with gradguard.enforce(engines=["pipelining"]):
            guarded = train_step(rank)
        stats = str(gradguard.stats())
        grads_equal = all(torch.equal(guarded["grads"][n], g) for n, g in plain["grads"].items())
        for run in (plain, guarded):
            del run["grads"]  # only the comparison travels back
        queue.put((rank, {"plain": plain, "guarded": guarded, "grads_equal": grads_equal, "stats": stats}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def describe(graphs: list[gradguard.GraphRecord]) -> list[str]:
    """One line per kept object: the first tensor with a graph in it and how many more there are."""
    by_store: dict[str, list[gradguard.GraphRecord]] = {}
    for g in graphs:
        by_store.setdefault(g.path.split("]")[0] + "]", []).append(g)
    lines = []
    for found in by_store.values():
        g = found[0]
        more = f"  (+{len(found) - 1} more like it)" if len(found) > 1 else ""
        lines.append(f"    {g.path:<32} shape={list(g.shape or ())!s:<8} grad_fn={g.grad_fn}{more}")
    return lines or ["    (nothing)"]


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(port, queue), nprocs=2, join=True)
    reports = dict(queue.get() for _ in range(2))
    last = reports[1]

    print(f"Schedule1F1B, 2 gloo ranks, {N_MICROBATCHES} micro-batches, last stage returns out[:, :4] (a view)\n")
    runs = (("without gradguard", last["plain"]), ('inside gradguard.enforce(engines=["pipelining"])', last["guarded"]))
    for label, run in runs:
        graphs = run["graphs"]
        kinds = sorted({g.grad_fn for g in graphs})
        print(f"{label}: {len(graphs)} tensors still carry a graph after step() on the last rank {kinds}")
        print(f"  graph-held memory (gradguard.pinned_bytes): {run['pinned_bytes']} bytes")
        print("\n".join(describe(graphs)))
        print()

    print("what the guard did on the last rank (gradguard.stats()):")
    print("  " + last["stats"].replace("\n", "\n  "))
    print()
    same_losses = last["plain"]["loss_values"] == last["guarded"]["loss_values"]
    print(f"losses equal with and without the guard: {same_losses}")
    for rank in (0, 1):
        print(f"rank {rank}: parameter grads bitwise equal (torch.equal): {reports[rank]['grads_equal']}")

    ok = (
        bool(last["plain"]["graphs"])
        and not last["guarded"]["graphs"]
        and not reports[0]["guarded"]["graphs"]
        and same_losses
        and all(reports[r]["grads_equal"] for r in (0, 1))
    )
    print("\nOK: the guard released every graph and changed no gradient" if ok else "\nUNEXPECTED RESULT")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
