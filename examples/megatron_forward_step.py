"""megatron-core's real ``forward_step`` / ``backward_step`` on CPU, with and without ``gradguard.enforce``.

The scenario: the last stage of a two-stage pipeline. Per micro-batch it receives an activation from
the previous stage (a fresh leaf that requires grad, as Megatron's P2P receive buffer is), runs
``megatron.core.pipeline_parallel.schedules.forward_step`` and ``backward_step`` (the loop
``forward_backward_no_pipelining`` runs; the full schedules hard-code CUDA, these two do not), and
keeps what Megatron keeps: every ``loss_func`` report in ``forward_data_store`` until the step ends.

The ``loss_func`` is a common one with a common slip: its report holds ``output.mean()`` and
``(output ** 2).mean()`` undetached. After ``backward_step`` each report still pins its micro-batch's
graph: the receive buffer and its ``.grad``, and (through the ``**2`` branch, which backward never
traverses) the model output it saved.

Inside ``with gradguard.enforce():`` the megatron adapter detaches what ``forward_step_calc_loss``
appends to ``forward_data_store`` (as the call returns; in ``warn``/``raise`` mode at the append
itself), after the loss is computed and scaled: the reports hold the same values, nothing is pinned,
and the gradients are bitwise the same.

Run: ``python examples/megatron_forward_step.py`` (about 10 s, most of it megatron's import).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from functools import partial
from typing import Any

import torch

import gradguard

MICRO_BATCHES = 8
TOKENS, HIDDEN, OUT = 512, 128, 128


class LastStage(torch.nn.Module):
    """A pipeline's last stage: it computes on the tensor the previous stage sent (set_input_tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)
        self.input_tensor: list[torch.Tensor | None] = [None]

    def set_input_tensor(self, input_tensor: list[torch.Tensor | None]) -> None:  # forward_step calls it
        self.input_tensor = input_tensor

    def forward(self) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.input_tensor[0])))


def loss_func(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = torch.nn.functional.mse_loss(output, target)
    report = {
        "lm loss": loss.detach().clone(),  # fine (a clone: Megatron rescales the loss in place)
        "logits_mean": output.mean(),  # the slip: undetached, carries the graph
        "logits_sq": (output**2).mean(),  # a branch backward never runs: its saved output stays
    }
    return loss, report


def train_step(schedules: Any, config: Any) -> dict[str, Any]:
    """One step of MICRO_BATCHES micro-batches through megatron's forward_step / backward_step."""
    torch.manual_seed(0)
    model = LastStage()
    recv = [torch.randn(TOKENS, HIDDEN) for _ in range(MICRO_BATCHES)]
    targets = iter([torch.randn(TOKENS, OUT) for _ in range(MICRO_BATCHES)])
    buffers: list[weakref.ref[torch.Tensor]] = []

    def forward_step_func(data_iterator: Any, model: LastStage) -> tuple[torch.Tensor, Any]:
        return model(), partial(loss_func, next(data_iterator))

    forward_data_store: list[Any] = []  # what forward_backward_no_pipelining returns at the end
    for i in range(MICRO_BATCHES):
        input_tensor = recv[i].clone().requires_grad_(True)  # the P2P receive buffer: a leaf
        buffers.append(weakref.ref(input_tensor))
        output_tensor, _num_tokens = schedules.forward_step(
            forward_step_func,
            targets,
            model,
            MICRO_BATCHES,
            input_tensor,
            forward_data_store,
            config,
            1,  # cp_group_size (required since core 0.14)
            is_first_microbatch=(i == 0),
            current_microbatch=i,
            is_last_stage=True,
        )
        input_tensor_grad = schedules.backward_step(input_tensor, output_tensor, None, config)
        del input_tensor, output_tensor, input_tensor_grad  # (the grad would be sent to the previous stage)
    model.set_input_tensor([None])  # the model's own reference to the last buffer, not a record's
    gc.collect()
    return {
        "graphs": gradguard.find_graphs(forward_data_store),
        "pinned": gradguard.pinned_bytes(forward_data_store),
        "alive": sum(ref() is not None for ref in buffers),
        "reports": [{k: float(v.detach()) for k, v in r.items()} for r in forward_data_store],
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
    }


def import_megatron() -> tuple[Any, Any]:
    # megatron warns about optional CUDA extras ("Transformer Engine and Apex are not installed", absl,
    # deprecated cuda-graph scopes), at import and lazily later: not what this example is about.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import TransformerConfig

    return schedules, TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)


def main() -> int:
    # Guarded run first, with enforce() entered BEFORE megatron is imported: the adapter installs
    # through a post-import hook. Entering it after the import works the same way (the adapter is
    # installed on entering); on exit the original forward_step_calc_loss is restored, so the run
    # after it is unguarded.
    with gradguard.enforce():
        schedules, config = import_megatron()
        guarded = train_step(schedules, config)
    stats = str(gradguard.stats())
    plain = train_step(schedules, config)

    print(
        f"megatron-core schedules.forward_step + backward_step, last stage, {MICRO_BATCHES} micro-batches, "
        f"activations {TOKENS}x{OUT} fp32\n"
    )
    for label, run in (("without gradguard", plain), ("inside gradguard.enforce()", guarded)):
        graphs = run["graphs"]
        kinds = sorted({f"{g.path.split(']', 1)[1]}: {g.grad_fn}" for g in graphs})
        print(f"{label}:")
        print(f"  forward_data_store: {len(graphs)} tensors carry a graph after backward_step {kinds if kinds else ''}")
        print(f"  graph-held memory (gradguard.pinned_bytes): {run['pinned']} bytes ({run['pinned'] / 2**20:.2f} MiB)")
        print(f"  receive buffers still alive: {run['alive']}/{MICRO_BATCHES}")
        if run is plain:
            per_mb = TOKENS * HIDDEN * 4 * 2 + TOKENS * OUT * 4
            print(
                f"  (per micro-batch: the receive buffer + its .grad + the output saved by **2 = {per_mb} bytes; "
                f"x{MICRO_BATCHES} = {per_mb * MICRO_BATCHES})"
            )
    print("\nwhat the guard did (gradguard.stats()):")
    print("  " + stats.replace("\n", "\n  "))

    same_reports = plain["reports"] == guarded["reports"]
    same_grads = all(torch.equal(g, guarded["grads"][n]) for n, g in plain["grads"].items())
    print(f"\nreports equal with and without the guard: {same_reports}")
    print(f"parameter grads bitwise equal (torch.equal): {same_grads}")
    ok = bool(plain["graphs"]) and plain["alive"] == MICRO_BATCHES and not guarded["graphs"]
    ok = ok and guarded["pinned"] == 0 and guarded["alive"] == 0 and same_reports and same_grads
    print("\nOK: the guard released every graph and changed no gradient" if ok else "\nUNEXPECTED RESULT")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
