"""The megatron-core integration tests' model, loss functions, micro-batch loop and fixtures.

The tests drive Megatron's own ``schedules.forward_step``, ``schedules.forward_step_calc_loss`` and
``schedules.backward_step``: the full schedules hard-code CUDA, but with ``cp_group_size=1`` and
``is_last_stage=True`` these three run without ``torch.distributed`` or ``parallel_state``; the loop
below is what ``forward_backward_no_pipelining`` does per micro-batch.
"""

from __future__ import annotations

import gc
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

import gradguard

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
N_MICRO = 4
TIMEOUT_S = 300


# --------------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------------


class TinyModel(torch.nn.Module):
    """``forward_step`` calls ``get_attr_wrapped_model(model, "set_input_tensor")``: it must exist."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.input_tensor = input_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def ns_config() -> SimpleNamespace:
    """Exactly the attributes forward_step / forward_step_calc_loss / backward_step read on CPU."""
    return SimpleNamespace(
        timers=None,
        enable_autocast=False,
        autocast_dtype=torch.float32,
        calculate_per_token_loss=False,
        grad_scale_func=None,
        deallocate_pipeline_outputs=False,
    )


def transformer_config() -> Any:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)


# loss_func(target, output) shapes -----------------------------------------------------------------


def loss_2tuple(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The common user bug: ``output.mean()`` published undetached."""
    loss = torch.nn.functional.mse_loss(output, target)
    return loss, {"lm loss": loss.detach().clone(), "logits": output.mean()}


def loss_2tuple_heavy(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """Plus a branch backward never traverses: ``PowBackward0`` saves the activation itself."""
    loss, report = loss_2tuple(target, output)
    report["logits_sq"] = (output**2).mean()
    return loss, report


def loss_3tuple(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    loss_sum = ((output - target) ** 2).sum()
    num_tokens = torch.tensor(output.numel(), dtype=torch.int)
    report = {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()]), "logits": output.mean()}
    return loss_sum, num_tokens, report


def loss_clean(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = torch.nn.functional.mse_loss(output, target)
    return loss, {"lm loss": loss.detach().clone()}


def loss_detached(target: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """The loss-contract trap: a detach placed before the loss."""
    loss = torch.nn.functional.mse_loss(output.detach(), target)
    return loss, {"lm loss": loss.detach().clone()}


def loss_non_loss_data(target: torch.Tensor, output: torch.Tensor, non_loss_data: bool = False) -> Any:
    assert non_loss_data, "collect_non_loss_data=True calls loss_func(output, non_loss_data=True)"
    return {"out": output * 2, "mean": output.mean()}


@dataclass
class Run:
    store: list[Any]
    model: TinyModel
    activations: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)  # what forward_step returned (kept only on request)

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.clone() for n, p in self.model.named_parameters()}

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.activations)


def run_forward_step(
    schedules: ModuleType,
    loss_fn: Callable[..., Any] | None,
    *,
    n: int = N_MICRO,
    seed: int = 0,
    config: Any = None,
    store: list[Any] | None = None,
    backward: bool = True,
    collect_non_loss_data: bool = False,
    keep_outputs: bool = False,
) -> Run:
    """Megatron's no-pipelining loop on the last (and only) stage, one micro-batch at a time."""
    torch.manual_seed(seed)
    model = TinyModel()
    data = iter([(torch.randn(2, 8), torch.randn(2, 4)) for _ in range(n)])
    config = ns_config() if config is None else config
    run = Run(store=[] if store is None else store, model=model)

    def forward_step_func(data_iterator: Iterator[Any], model: TinyModel) -> tuple[torch.Tensor, Any]:
        x, y = next(data_iterator)
        out = model(x)
        run.activations.append(weakref.ref(out))
        return out, (None if loss_fn is None else partial(loss_fn, y))

    for i in range(n):
        output_tensor, _num_tokens = schedules.forward_step(
            forward_step_func,
            data,
            model,
            n,
            None,  # input_tensor: first stage
            run.store,  # forward_data_store (positional index 5)
            config,
            1,  # cp_group_size (positional index 7, required)
            collect_non_loss_data=collect_non_loss_data,
            is_first_microbatch=(i == 0),
            current_microbatch=i,
            is_last_stage=True,
        )
        if backward:
            grad = None if loss_fn is not None else torch.ones_like(output_tensor)
            schedules.backward_step(None, output_tensor, grad, config)
        if keep_outputs:
            run.outputs.append(output_tensor)
        del output_tensor
    return run


def append_line(schedules: ModuleType, statement: str) -> int:
    """The line number of ``statement`` in the installed schedules.py (exactly one occurrence)."""
    path = inspect.getsourcefile(schedules)
    assert path is not None
    with open(path, encoding="utf-8") as f:
        lines = [i for i, text in enumerate(f, start=1) if text.strip() == statement]
    assert len(lines) == 1, f"{statement!r} found at lines {lines} of {path}"
    return lines[0]


CALC_LOSS_CALL = "output_tensor, num_tokens = forward_step_calc_loss("  # in forward_step


def graph_paths(store: list[Any]) -> list[tuple[str, str]]:
    return [(g.path, g.grad_fn) for g in gradguard.find_graphs(store)]


def assert_detached_records(store: list[Any], keys: set[str]) -> None:
    assert type(store) is list  # the caller's own list, never a proxy
    assert gradguard.find_graphs(store) == []
    for record in store:
        assert type(record) is dict and set(record) == keys
        for value in record.values():
            assert not value.requires_grad and value.grad_fn is None
