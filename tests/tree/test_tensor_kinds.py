"""Tensor kinds beyond plain tensors: nested (jagged and strided), a quantized wrapper subclass
modelled on Transformer Engine's Float8Tensor, and DTensor."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils import _pytree

from gradguard import detach_tree, find_graphs, pinned_bytes

# --------------------------------------------------------------------------------------------------
# nested tensors
# --------------------------------------------------------------------------------------------------


def _components() -> list[torch.Tensor]:
    return [torch.randn(2, 3), torch.randn(4, 3), torch.randn(1, 3)]


def test_jagged_nested_tensor() -> None:
    leaf = torch.nested.nested_tensor(_components(), layout=torch.jagged, requires_grad=True)
    out = leaf * 2
    assert out.grad_fn is not None and out.layout is torch.jagged

    rec = {"model_output": {"log_probs": out}, "loss": 1.0}
    new = detach_tree(rec)
    d = new["model_output"]["log_probs"]
    assert type(d) is type(out)
    assert d.is_nested and d.layout is torch.jagged
    assert not d.requires_grad and d.grad_fn is None
    assert d.values().data_ptr() == out.values().data_ptr()  # storage shared
    assert d.offsets().data_ptr() == out.offsets().data_ptr()
    assert torch.equal(d.values(), out.values().detach())
    assert rec["model_output"]["log_probs"] is out  # input untouched
    assert new["loss"] == 1.0

    (r,) = find_graphs(rec)
    assert r.path == "['model_output']['log_probs']"
    assert r.grad_fn == "MulBackward0"
    assert r.dtype == torch.float32 and r.device == torch.device("cpu")
    assert r.shape is not None and len(r.shape) == 3
    assert r.shape[0] == 3 and r.shape[2] == 3  # the ragged dim is symbolic
    assert find_graphs(new) == []

    # the jagged leaf requiring grad holds no graph: kept as it is
    assert detach_tree([leaf])[0] is leaf
    assert pinned_bytes(rec) > 0
    assert pinned_bytes(new) == 0


def test_strided_nested_tensor() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "prototype stage"
        leaf = torch.nested.nested_tensor(_components(), requires_grad=True)
    out = leaf.sin()
    assert out.is_nested and out.layout is torch.strided and out.grad_fn is not None

    d = detach_tree((out, 1))[0]
    assert d.is_nested and d.layout is torch.strided
    assert type(d) is type(out)
    assert not d.requires_grad and d.grad_fn is None
    assert d.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(d.unbind(), out.detach().unbind()))

    (r,) = find_graphs({"nt": out})
    assert r.path == "['nt']" and r.grad_fn == "SinBackward0"
    assert r.shape is None or len(r.shape) == 3  # strided nested tensors have no single shape
    # the leaf's storage (saved by sin as well): counted once
    assert pinned_bytes(out) == sum(c.numel() for c in _components()) * 4


# --------------------------------------------------------------------------------------------------
# a stand-in for Transformer Engine's QuantizedTensor / Float8Tensor
# --------------------------------------------------------------------------------------------------


class FakeFloat8Tensor(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper subclass: a uint8 payload ``_data`` and a ``_scale_inv``.

    Like TE's ``QuantizedTensor``, ``detach`` returns the same subclass sharing ``_data`` and
    ``_scale_inv`` (no copy, no dequantize); other ops dequantize.
    """

    _data: torch.Tensor
    _scale_inv: torch.Tensor
    dequantize_calls = 0
    detach_calls = 0

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor,
        scale_inv: torch.Tensor,
        dtype: torch.dtype = torch.float32,
        requires_grad: bool = False,
    ) -> FakeFloat8Tensor:
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=requires_grad
        )
        self._data = data
        self._scale_inv = scale_inv
        return self

    def __repr__(self) -> str:  # the default repr would dequantize through dispatch
        return f"FakeFloat8Tensor(shape={tuple(self.shape)}, requires_grad={self.requires_grad})"

    def dequantize_(self) -> torch.Tensor:
        type(self).dequantize_calls += 1
        return self._data.to(self.dtype) * self._scale_inv

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.detach.default:
            (src,) = args
            cls.detach_calls += 1
            return cls(src._data, src._scale_inv, dtype=src.dtype)

        def unwrap(t: Any) -> Any:
            return t.dequantize_() if isinstance(t, FakeFloat8Tensor) else t

        return func(*_pytree.tree_map(unwrap, args), **_pytree.tree_map(unwrap, kwargs))


class _Quantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> FakeFloat8Tensor:  # type: ignore[override]
        data = (x / scale).round().clamp(0, 255).to(torch.uint8)
        return FakeFloat8Tensor(data, torch.tensor(scale), dtype=x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


@pytest.fixture
def fp8() -> Iterator[tuple[torch.Tensor, FakeFloat8Tensor]]:
    x = (torch.rand(4, 8) * 100).requires_grad_()
    q = _Quantize.apply(x, 0.5)
    FakeFloat8Tensor.dequantize_calls = 0
    FakeFloat8Tensor.detach_calls = 0
    yield x, q


def _assert_fp8_detached(new: Any, old: FakeFloat8Tensor) -> None:
    assert type(new) is FakeFloat8Tensor
    assert new is not old
    assert not new.requires_grad and new.grad_fn is None
    assert new._data is old._data  # the same payload object: no copy
    assert new._data.data_ptr() == old._data.data_ptr()
    assert new._scale_inv is old._scale_inv
    assert new._data.dtype is torch.uint8
    assert new.shape == old.shape and new.dtype == old.dtype


def test_quantized_subclass_detach_shares_payload(fp8: tuple[torch.Tensor, FakeFloat8Tensor]) -> None:
    x, q = fp8
    assert type(q) is FakeFloat8Tensor and q.grad_fn is not None
    new = detach_tree(q)
    _assert_fp8_detached(new, q)
    assert FakeFloat8Tensor.detach_calls >= 1
    assert FakeFloat8Tensor.dequantize_calls == 0  # never dequantized
    assert q.requires_grad  # input untouched


@dataclasses.dataclass
class _Out:
    weight_fp8: Any
    note: str


def test_quantized_subclass_inside_containers(fp8: tuple[torch.Tensor, FakeFloat8Tensor]) -> None:
    x, q = fp8
    plain = torch.ones(2)
    rec = {"layers": [(q, plain), _Out(q, "n")], "keep": [plain]}
    new = detach_tree(rec)
    assert new["keep"] is rec["keep"]
    _assert_fp8_detached(new["layers"][0][0], q)
    assert new["layers"][0][1] is plain
    assert type(new["layers"][1]) is _Out and new["layers"][1].note == "n"
    _assert_fp8_detached(new["layers"][1].weight_fp8, q)
    assert FakeFloat8Tensor.dequantize_calls == 0
    assert rec["layers"][0][0] is q and rec["layers"][1].weight_fp8 is q

    recs = find_graphs(rec)
    assert [r.path for r in recs] == ["['layers'][0][0]"]  # one record per distinct tensor
    assert recs[0].shape == (4, 8) and recs[0].grad_fn == "_QuantizeBackward"
    assert FakeFloat8Tensor.dequantize_calls == 0
    assert find_graphs(new) == []


def test_quantized_leaf_requiring_grad_is_kept(fp8: tuple[torch.Tensor, FakeFloat8Tensor]) -> None:
    _, q = fp8
    leaf = FakeFloat8Tensor(q._data, q._scale_inv, requires_grad=True)
    assert leaf.is_leaf and leaf.requires_grad
    assert detach_tree({"w": leaf})["w"] is leaf
    no_grad = FakeFloat8Tensor(q._data, q._scale_inv)
    assert detach_tree([no_grad])[0] is no_grad


# --------------------------------------------------------------------------------------------------
# DTensor on a one-process gloo mesh
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    dist = pytest.importorskip("torch.distributed", reason="torch built without torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available on this platform")
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():  # another test left one up: use it if it is a one-process group
        if dist.get_world_size() != 1:
            pytest.skip("a multi-process group is already initialized in this process")
        yield init_device_mesh("cpu", (1,))
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in-process: no port
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor(mesh: Any) -> None:
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    except ImportError:
        pytest.skip("torch.distributed.tensor is public from torch 2.5")

    for placement in (Replicate(), Shard(0)):
        leaf = distribute_tensor(torch.randn(4, 6, requires_grad=True), mesh, [placement])
        out = leaf * 2
        assert isinstance(out, DTensor) and out.grad_fn is not None

        rec = {"out": out, "n": [leaf]}
        new = detach_tree(rec)
        d = new["out"]
        assert type(d) is DTensor
        assert not d.requires_grad and d.grad_fn is None
        assert d.placements == out.placements and d.device_mesh is out.device_mesh
        loc, orig = d.to_local(), out.to_local()
        assert loc.untyped_storage().data_ptr() == orig.untyped_storage().data_ptr()
        assert torch.equal(loc, orig.detach())
        assert new["n"][0] is leaf  # a leaf holds no graph: kept
        assert rec["out"] is out and rec["n"][0] is leaf

        (r,) = find_graphs(rec)
        assert r.path == "['out']" and r.shape == (4, 6) and r.grad_fn == "MulBackward0"
        assert find_graphs(new) == []
