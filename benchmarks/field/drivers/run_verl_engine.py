"""verl: the FSDP actor engine's ``train_batch(data, loss_function)`` on a tiny LM, one process, CPU.

``train_batch`` is the engine's public step (zero the grads, ``forward_backward_batch`` over the
micro-batches, ``optimizer_step``), the data a ``TensorDict`` with ``input_ids``/``loss_mask`` and the
micro-batch size as verl's workers set it, the loss function verl's ``(model_output, data, dp_group)
-> (loss, metrics)`` contract. verl's engines cannot be constructed without CUDA (their ``__init__``
builds an HF model under FSDP), so the engine is the real ``FSDPEngineWithLMHead`` class with
``__init__`` and the model plumbing (``prepare_model_inputs``/``prepare_model_outputs``: a tiny LM
whose heads are ``log_probs`` and ``entropy``) replaced; a single-process gloo group stands in for the
data-parallel group, and the device helpers the engine module imported answer "cpu". Everything else
is verl's own code. On 0.8.0 ``forward_backward_batch`` keeps every micro-batch's ``model_output``
with its graph in ``output_lst`` (and returns them), so the mini-batch's graphs are all alive at the
optimizer step; 0.9.1 detaches what it records.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import _probe
import torch
import torch.distributed as dist
import verl.utils.tensordict_utils as tu
import verl.workers.engine.fsdp.transformer_impl as fsdp
from tensordict import TensorDict

STEPS = int(os.environ.get("GRADGUARD_FIELD_STEPS", "12"))
VOCAB, HIDDEN, SEQ, BATCH, MICRO = 1000, 64, 64, 16, 2


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(self.emb(input_ids)))


class CPUEngine(fsdp.FSDPEngineWithLMHead):
    def __init__(self) -> None:  # the real one builds an HF model under FSDP on CUDA
        self.module = TinyLM()
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-3)
        self.optimizer_config = SimpleNamespace(clip_grad=1.0)
        self.engine_config = SimpleNamespace(use_no_sync_for_gradient_accumulation=False)
        self.ulysses_sequence_parallel_size = 1
        self.ulysses_device_mesh = None
        self.scaler = None
        self._autocast_dtype = torch.float32
        self._qat_enabled = False

    def prepare_model_inputs(self, micro_batch: TensorDict) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"input_ids": micro_batch["input_ids"]}, {"input_ids": micro_batch["input_ids"]}

    def prepare_model_outputs(self, output: Any, output_args: Any, micro_batch: Any, logits_processor_func: Any) -> Any:
        logp = torch.log_softmax(output.logits.float(), dim=-1)
        log_probs = logp.gather(-1, output_args["input_ids"].unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return {"log_probs": log_probs, "entropy": entropy}


def loss_function(model_output: dict[str, torch.Tensor], data: TensorDict, dp_group: Any = None) -> Any:
    mask = data["loss_mask"]
    loss = -(model_output["log_probs"] * mask).sum() / mask.sum()
    return loss, {"actor/pg_loss": loss.detach().item()}


def batch(step: int) -> TensorDict:
    g = torch.Generator().manual_seed(step)
    data = TensorDict(
        {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), "loss_mask": torch.ones(BATCH, SEQ)},
        batch_size=[BATCH],
    )
    tu.assign_non_tensor(data, use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO, return_model_output=True)
    return data


def train_step(engine: CPUEngine, step: int) -> dict[str, Any]:
    """One mini-batch, as verl's actor worker runs it: the metrics are what leaves the step."""
    output = engine.train_batch(batch(step), loss_function=loss_function)
    return output["metrics"]


def main() -> None:
    _probe.install()
    torch.manual_seed(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    fsdp.get_device_name = fsdp.get_device_id = lambda: "cpu"  # verl has no CPU platform
    engine = CPUEngine()
    history = [train_step(engine, step) for step in range(STEPS)]
    print(f"{len(history)} mini-batches")
    dist.destroy_process_group()
    _probe.finish(engine.module)


if __name__ == "__main__":
    main()
