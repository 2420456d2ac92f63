"""FSDP2 (``fully_shard``) and ``DTensor`` on a one-process gloo group, on CPU.

FSDP2 registers sharded ``DTensor`` parameters; with ``reshard_after_forward=True`` it swaps in
unsharded ones for forward and back afterwards, so the graph reaches parameters
``named_parameters()`` no longer yields. ``reaches_params`` maps them through the module; where it
cannot, it says so and never raises. ``pinned_bytes`` counts a ``DTensor`` by its local shard.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

import gradguard
from gradguard import LossContractError, LossContractWarning
from gradguard._guards.contract import LossCheck

dist = pytest.importorskip("torch.distributed", reason="torch built without torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available", allow_module_level=True)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# FSDP2 as an engine: imported by the tests, not at collection (torch.distributed.fsdp brings sympy,
# some 75k objects that every later gc.collect() and heap audit in the process would walk), and run
# with the integration tests, last.
pytestmark = pytest.mark.integration


def fully_shard(module: nn.Module, **kwargs: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(module, **kwargs)


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    """A one-process gloo group for this module; a process can hold one, so it is destroyed after."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a multi-process group is already initialized in this process")
        yield init_device_mesh("cpu", (1,))
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in-process: no port
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sharded(mesh: DeviceMesh, reshard_after_forward: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def trap_loss(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The first layer's output detached: layer 0 gets no gradient, the loss still requires grad."""
    return model[1](model[0](x).detach()).pow(2).mean()


X = torch.randn(4, 8)


def test_the_premise_the_graph_reaches_other_parameters(mesh: DeviceMesh) -> None:
    from torch.distributed.tensor import DTensor

    model = sharded(mesh)
    loss = model(X).pow(2).mean()
    leaves = {id(n.variable) for n in gradguard._graph.nodes.nodes([loss.grad_fn]) if hasattr(n, "variable")}
    assert len(leaves) == 4 and not leaves & {id(p) for p in model.parameters()}
    assert all(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fully_shard_passes_a_correct_model(mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    model = sharded(mesh, reshard_after_forward)

    @gradguard.forward_step(check="reaches_params", params=model)
    def fs(x: torch.Tensor) -> Any:
        y = model(x)
        return y.pow(2).mean(), {"y": y}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided: no "cannot decide" either
        loss, _ = fs(X)
        gradguard.check_loss(model(X).sum(), params=model)
    loss.backward()
    assert all(p.grad is not None and p.grad.to_local().abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_the_trap_under_fully_shard_is_still_caught(mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    model = sharded(mesh, reshard_after_forward)
    with pytest.raises(LossContractError, match=r"trainable parameters: 0\.weight, 0\.bias\. They"):
        gradguard.check_loss(trap_loss(model, X), params=model)


def test_sharded_parameters_without_their_module_cannot_decide(mesh: DeviceMesh) -> None:
    model = sharded(mesh)
    with pytest.warns(
        LossContractWarning, match=r"cannot decide.*param\[0\], param\[1\], param\[2\], param\[3\]"
    ) as rec:
        gradguard.check_loss(model(X).sum(), params=model.parameters())  # DTensors, no module to map them
    assert "pass the module itself as params=" in str(rec[0].message)


def test_parameters_read_before_fully_shard_cannot_decide(mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    stale = LossCheck("reaches_params", model.parameters())  # the originals, replaced below
    live = LossCheck("reaches_params", model)  # re-read: sees the sharded parameters
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.warns(LossContractWarning, match=r"cannot decide.*FSDP2"):
        stale(model(X).sum())  # never a false error
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        live(model(X).sum())
    with pytest.raises(LossContractError, match=r"0\.weight, 0\.bias\. They"):
        live(trap_loss(model, X))


def test_gradients_are_bitwise_identical_with_and_without_the_check(mesh: DeviceMesh) -> None:
    def grads(check: bool) -> list[torch.Tensor]:
        model = sharded(mesh)
        loss = model(X).pow(2).mean()
        if check:
            gradguard.check_loss(loss, params=model)
            assert gradguard.pinned_bytes(loss) >= 0
        loss.backward()
        return [p.grad.to_local().clone() for p in model.parameters()]

    plain, checked = grads(False), grads(True)
    assert len(plain) == 4 and all(torch.equal(a, b) for a, b in zip(plain, checked))


def test_pinned_bytes_counts_a_dtensor_by_its_local_shard(mesh: DeviceMesh) -> None:
    from torch.distributed.tensor import DTensor, Shard

    # one rank holding 4 rows of a tensor whose global shape says 8: only the 4 rows are memory here
    local = torch.randn(4, 6)
    leaf = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((8, 6)), stride=(6, 1))
    leaf.requires_grad_()
    assert leaf.shape == (8, 6) and leaf.to_local().shape == (4, 6)
    out = leaf.exp()  # saves its result: another local 4 x 6
    assert gradguard.pinned_bytes({"out": out}) == 2 * 4 * 6 * 4
