"""``reaches_params`` through megatron-core's own recompute, on CPU.

``tensor_parallel.checkpoint`` (``CheckpointFunction``) is reentrant: its forward runs under
``no_grad`` and backward recomputes it. ``CheckpointWithoutOutput`` recomputes from a hook and keeps
its function where the graph cannot see it. Both read CUDA RNG state, which a CPU build has not:
the tests replace Megatron's ``_get_all_rng_states`` / ``_set_all_rng_states`` with their CPU
halves; the checkpoint functions themselves are Megatron's, unchanged.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import pytest
import torch
from _helpers import require_engine
from torch import nn

import gradguard
from gradguard import LossContractError, LossContractWarning

pytestmark = pytest.mark.integration


@pytest.fixture
def random(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = require_engine("megatron.core.tensor_parallel.random")
    monkeypatch.setattr(module, "_get_all_rng_states", lambda: (torch.get_rng_state(), None, {}))
    monkeypatch.setattr(module, "_set_all_rng_states", lambda cpu, cuda, tracker: torch.set_rng_state(cpu))
    return module


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.policy = nn.Linear(8, 8)
        self.block = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)


def _loss(model: Model, random: ModuleType, *, trap: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 8, requires_grad=True)  # Megatron's P2P receive buffer
    h = model.policy(x)
    if trap:
        h = h.detach()
    h = random.checkpoint(model.block, False, h + x)  # CheckpointFunction, distribute_saved_activations=False
    return model.head(h).pow(2).mean(), x


def test_checkpoint_function_passes_a_correct_model(random: ModuleType) -> None:
    model = Model()
    model.norm.requires_grad_(False)  # not used here
    loss, _ = _loss(model, random)
    nodes = list(gradguard._graph.nodes.nodes([loss.grad_fn]))
    assert "CheckpointFunctionBackward" in {type(n).__name__ for n in nodes}
    leaves = {id(n.variable) for n in nodes if hasattr(n, "variable")}
    assert id(model.block.weight) not in leaves  # the premise: reached by the recompute only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gradguard.check_loss(loss, params=model)


def test_checkpoint_function_trap_is_still_caught(random: ModuleType) -> None:
    model = Model()
    model.norm.requires_grad_(False)
    loss, _ = _loss(model, random, trap=True)
    with pytest.raises(LossContractError, match=r"parameters: policy\.weight, policy\.bias\. They"):
        gradguard.check_loss(loss, params=model)


def test_gradients_are_bitwise_identical_with_and_without_the_check(random: ModuleType) -> None:
    def step(check: bool) -> list[torch.Tensor]:
        model = Model()
        model.norm.requires_grad_(False)
        torch.manual_seed(3)
        loss, x = _loss(model, random)
        if check:
            gradguard.check_loss(loss, params=model)
        loss.backward()
        return [x.grad, *(p.grad for p in model.parameters() if p.requires_grad)]

    plain, checked = step(False), step(True)
    assert len(plain) == 7 and all(torch.equal(a, b) for a, b in zip(plain, checked))


def test_checkpoint_without_output_cannot_decide_and_says_so(random: ModuleType) -> None:
    """Megatron's layernorm recompute: the function is out of the graph's sight; a warning, no error."""
    model = Model()
    x = torch.randn(4, 8, requires_grad=True)
    ckpt = random.CheckpointWithoutOutput(fp8=None)  # None: no FP8 (its test is `fp8 is not None`)
    normed = ckpt.checkpoint(model.norm, model.block(x))
    out = model.head(normed)
    ckpt.discard_output_and_register_recompute(out)
    loss = out.pow(2).mean()
    with pytest.warns(LossContractWarning) as record:
        gradguard.check_loss(loss, params=model)
    msg = str(record[0].message)
    assert "norm.weight, norm.bias" in msg and "CheckpointWithoutOutputFunctionBackward" in msg
    assert "policy.weight" in msg  # not used at all, but nothing can be decided beside that recompute
    loss.backward()
    assert model.norm.weight.grad is not None  # the recompute did reach it
