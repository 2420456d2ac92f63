"""find_graphs records and paths; pinned_bytes' analytic accounting; unreached_params."""

from __future__ import annotations

import collections
import dataclasses
import gc
import types
import warnings
import weakref
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from gradguard import GraphRecord, _compat, detach_tree, find_graphs, pinned_bytes
from gradguard._graph.reach import Unreached, unreached_params

F32 = 4  # bytes per float32 element


class Step(NamedTuple):
    logits: Any
    entropy: Any


@dataclasses.dataclass
class StepDC:
    logits: Any
    entropy: Any


def grad_tensor(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True) * 2


# --------------------------------------------------------------------------------------------------
# find_graphs
# --------------------------------------------------------------------------------------------------


def test_verl_style_record_paths_and_fields() -> None:
    x = torch.randn(2, 5, 7, requires_grad=True)
    log_probs = x.log_softmax(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    rec = {
        "model_output": {"log_probs": log_probs, "entropy": entropy, "mask": torch.ones(2, 5)},
        "loss": 0.25,
        "metrics": {"lr": [1e-4], "leaf": x},  # a leaf has no grad_fn: not reported
    }
    recs = find_graphs(rec)
    assert recs == [
        GraphRecord(
            "['model_output']['log_probs']", (2, 5, 7), torch.float32, torch.device("cpu"), "LogSoftmaxBackward0"
        ),
        GraphRecord("['model_output']['entropy']", (2, 5), torch.float32, torch.device("cpu"), "NegBackward0"),
    ]
    assert isinstance(recs[0].shape, tuple)
    assert recs[0]._fields == ("path", "shape", "dtype", "device", "grad_fn")


@pytest.mark.parametrize("cls", [Step, StepDC], ids=["namedtuple", "dataclass"])
def test_list_of_attribute_containers_paths(cls: type) -> None:
    steps = [cls(torch.zeros(2), torch.zeros(1)) for _ in range(3)]
    ent = grad_tensor(4)
    steps.append(cls(torch.zeros(3), ent))
    recs = find_graphs(steps)
    assert [r.path for r in recs] == ["[3].entropy"]
    assert recs[0].shape == (4,) and recs[0].grad_fn == "MulBackward0"


def test_return_types_paths() -> None:
    r = torch.max(torch.randn(3, 4, requires_grad=True), 0)
    assert [(x.path, x.grad_fn) for x in find_graphs(r)] == [(".values", "MaxBackward0")]
    assert [x.path for x in find_graphs({"m": [r]})] == ["['m'][0].values"]


def test_paths_for_other_containers() -> None:
    g = grad_tensor(2)
    assert [r.path for r in find_graphs(g)] == [""]
    assert [r.path for r in find_graphs((1, g))] == ["[1]"]
    assert [r.path for r in find_graphs({0: g})] == ["[0]"]
    assert [r.path for r in find_graphs(collections.deque([1, 2, g]))] == ["[2]"]
    assert [r.path for r in find_graphs(collections.OrderedDict(b=g))] == ["['b']"]
    assert [r.path for r in find_graphs(types.MappingProxyType({"mp": g}))] == ["['mp']"]
    assert [r.path for r in find_graphs(Step(logits=g, entropy=None))] == [".logits"]


def test_container_order() -> None:
    a, b, c = grad_tensor(1), grad_tensor(2), grad_tensor(3)
    rec = {"z": [a, {"y": b}], "a": (c,)}
    assert [r.path for r in find_graphs(rec)] == ["['z'][0]", "['z'][1]['y']", "['a'][0]"]


def test_one_record_per_distinct_tensor() -> None:
    g = grad_tensor(3)
    h = g + 1  # a different tensor of the same graph
    rec = {"a": g, "b": [g, h], "c": (g,)}
    recs = find_graphs(rec)
    assert [r.path for r in recs] == ["['a']", "['b'][1]"]
    assert [r.grad_fn for r in recs] == ["MulBackward0", "AddBackward0"]


def test_no_records_without_graphs() -> None:
    leaf = torch.randn(3, requires_grad=True)
    assert find_graphs({"leaf": leaf, "t": torch.ones(2), "s": "x", "n": None}) == []
    assert find_graphs(detach_tree({"g": grad_tensor(3)})) == []
    with torch.no_grad():
        assert find_graphs([leaf * 2]) == []


def test_dtype_and_shape_fields() -> None:
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    y = x.to(torch.float16)
    (rec,) = find_graphs([y])
    assert rec.dtype == torch.float16 and rec.shape == (2, 3)
    assert rec.device == torch.device("cpu") and rec.grad_fn == "ToCopyBackward0"
    (rec0,) = find_graphs([x.sum()])
    assert rec0.shape == ()


def test_record_holds_no_reference_to_tensor() -> None:
    leaf = torch.randn(8, requires_grad=True)
    out = leaf.exp()
    wr_out, wr_leaf = weakref.ref(out), weakref.ref(leaf)
    recs = find_graphs({"o": out})
    assert len(recs) == 1
    del out, leaf
    gc.collect()
    assert wr_out() is None
    assert wr_leaf() is None
    assert recs[0].grad_fn == "ExpBackward0"  # the record itself is still usable


# --------------------------------------------------------------------------------------------------
# pinned_bytes
# --------------------------------------------------------------------------------------------------


def test_pinned_bytes_nothing() -> None:
    assert pinned_bytes({"a": torch.ones(10), "b": 1}) == 0
    leaf = torch.randn(10, requires_grad=True)
    assert pinned_bytes(leaf) == 0  # a bare leaf has no graph
    assert pinned_bytes(detach_tree({"y": leaf.exp()})) == 0


def test_pinned_bytes_leaf_saved_and_grad() -> None:
    x = torch.randn(6, 5, requires_grad=True)  # a non-Parameter leaf: 120 bytes
    y = x.exp()  # ExpBackward0 saves its result (120 bytes)
    rec = {"y": y}
    assert pinned_bytes(rec) == 30 * F32 + 30 * F32
    y.sum().backward()
    # the saved result is freed; the leaf and its .grad stay
    assert x.grad is not None
    assert pinned_bytes(rec) == 30 * F32 + 30 * F32


def test_pinned_bytes_saved_freed_after_backward() -> None:
    x = torch.randn(16, requires_grad=True)
    y = x.sin().exp().tanh()  # sin saves x (shared), exp saves its result, tanh saves its result
    before = pinned_bytes(y)
    assert before == 16 * F32 * 3
    y.sum().backward()
    assert pinned_bytes(y) == 16 * F32 * 2  # x and x.grad only


def test_pinned_bytes_parameters_not_counted() -> None:
    w = nn.Parameter(torch.randn(5))
    x = torch.randn(5, requires_grad=True)
    y = w * x  # MulBackward0 saves both w and x
    assert pinned_bytes(y) == 5 * F32
    y.sum().backward()
    assert w.grad is not None
    assert pinned_bytes(y) == 2 * 5 * F32  # x and x.grad; w and w.grad are not counted


def test_pinned_bytes_linear_layer() -> None:
    lin = nn.Linear(4, 3)
    x = torch.randn(8, 4, requires_grad=True)  # 128 bytes
    z = lin(x).tanh()  # addmm saves x and weight.t() (a view of a Parameter); tanh saves z (96 bytes)
    assert pinned_bytes({"z": z}) == 8 * 4 * F32 + 8 * 3 * F32
    z.sum().backward()
    assert pinned_bytes({"z": z}) == 2 * 8 * 4 * F32


def test_pinned_bytes_frozen_parameter_not_counted() -> None:
    frozen = nn.Parameter(torch.randn(7), requires_grad=False)
    x = torch.randn(7, requires_grad=True)
    y = x * frozen  # saves frozen (a Parameter without an AccumulateGrad node)
    assert pinned_bytes(y) == 7 * F32


def test_pinned_bytes_shared_storage_counted_once() -> None:
    base = torch.randn(10)
    a = base[:4].detach().requires_grad_()  # two leaves on one 40-byte storage
    b = base[6:].detach().requires_grad_()
    assert a.is_leaf and b.is_leaf
    y = a * b  # saves a and b: the same storage again
    z = a + b
    assert pinned_bytes({"y": y, "z": z, "again": [y]}) == 10 * F32
    (y.sum() + z.sum()).backward()
    # a.grad and b.grad are separate 16-byte storages
    assert pinned_bytes({"y": y, "z": z}) == 10 * F32 + 2 * 4 * F32


def test_pinned_bytes_two_records_share_a_graph() -> None:
    x = torch.randn(9, requires_grad=True)
    h = x.exp()  # saves its result
    a, b = h.neg(), h.sum()  # save no tensors
    assert pinned_bytes(h) == 2 * 9 * F32
    # each graph node and each storage once, whatever the order and the repetition
    assert pinned_bytes([a, b, h]) == pinned_bytes({"b": b, "a": [a, a]}) == 2 * 9 * F32


def test_pinned_bytes_does_not_recompute_checkpoint() -> None:
    calls = []

    def block(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t.sin().exp().tanh()

    x = torch.randn(16, requires_grad=True)
    y = checkpoint(block, x, use_reentrant=False)
    assert len(calls) == 1
    n = pinned_bytes({"y": y})
    assert len(calls) == 1  # no recomputation
    # the checkpoint's holders are opaque: only the input leaf is visible
    assert n == 16 * F32
    find_graphs({"y": y})
    assert len(calls) == 1
    y.sum().backward()
    assert len(calls) == 2  # backward recomputes exactly once
    xd = x.detach()
    e = xd.sin().exp()
    assert torch.allclose(x.grad, (1 - e.tanh() ** 2) * e * xd.cos())
    n_after = pinned_bytes({"y": y})
    assert len(calls) == 2
    assert n_after == 2 * 16 * F32


@pytest.mark.skipif(
    not _compat.SAVED_TENSORS_READABLE,
    reason="before torch 2.13 a hooked saved tensor is not measured (docs/support.md)",
)
def test_pinned_bytes_save_on_cpu() -> None:
    x = torch.randn(16, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        y = x.sin().exp()
    hooked = pinned_bytes(y)
    x2 = x.detach().clone().requires_grad_()
    plain = pinned_bytes(x2.sin().exp())
    # on CPU the packed form is (device, the same tensor): x and exp's result
    assert hooked == plain == 2 * 16 * F32
    y.sum().backward()
    assert torch.allclose(x.grad, x.detach().cos() * x.detach().sin().exp())


@pytest.mark.skipif(
    not _compat.SAVED_TENSORS_READABLE,
    reason="before torch 2.13 a hooked saved tensor is not measured (docs/support.md)",
)
def test_pinned_bytes_saved_tensor_hooks_never_unpacked() -> None:
    unpacked = []

    def pack_clone(t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(1)
        return t

    x = torch.randn(8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack_clone, unpack):
        y = x.exp()  # saves its result, packed as a clone: a separate 32-byte storage
    assert pinned_bytes(y) == 8 * F32 + 8 * F32
    assert unpacked == []

    class Opaque:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    with torch.autograd.graph.saved_tensors_hooks(Opaque, lambda o: o.t):
        y2 = x.exp()
    assert pinned_bytes(y2) == 8 * F32  # the opaque holder is not visible; the leaf is
    # The Opaque holds y2, whose graph holds the Opaque: a cycle through C++ the collector cannot
    # break, which would stay on the heap for every later test in this process. A backward frees it.
    y2.sum().backward()


def test_pinned_bytes_after_detach_tree_is_zero() -> None:
    x = torch.randn(100, requires_grad=True)
    rec = {"out": x.exp(), "nested": [x.sin()]}
    assert pinned_bytes(rec) > 0
    assert pinned_bytes(detach_tree(rec)) == 0


# --------------------------------------------------------------------------------------------------
# pinned_bytes counts the memory tensors really hold: sparse, meta, wrapper subclasses
# --------------------------------------------------------------------------------------------------

I64 = 8  # bytes per int64 element


def _sparse_leaf() -> torch.Tensor:
    """A 200000 x 200000 COO leaf with two elements: 2 x 2 int64 indices + 2 float32 values = 40 bytes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Sparse invariant checks are implicitly disabled"
        return torch.sparse_coo_tensor([[0, 1], [2, 3]], [1.0, 2.0], (200_000, 200_000), requires_grad=True)


def test_pinned_bytes_sparse_coo_counts_indices_and_values() -> None:
    s = _sparse_leaf()
    y = torch.sparse.sum(s)  # coalesces: ValuesBackward0 saves the coalesced copy (40 bytes more)
    assert pinned_bytes(y) == 2 * (2 * 2 * I64 + 2 * F32)  # not 200000**2 x 4 bytes
    y.backward()
    assert s.grad is not None and s.grad.layout is torch.sparse_coo
    assert pinned_bytes(y) == 2 * (2 * 2 * I64 + 2 * F32)  # saved copy freed, the sparse .grad counted


def test_pinned_bytes_sparse_csr_counts_its_index_and_value_arrays() -> None:
    crow, col, values = torch.tensor([0, 1, 2]), torch.tensor([0, 1]), torch.tensor([1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Sparse CSR tensor support is in beta state"
        leaf = torch.sparse_csr_tensor(crow, col, values, (2, 100_000), requires_grad=True)
    assert pinned_bytes(leaf.to_dense().sum()) == 3 * I64 + 2 * I64 + 2 * F32


def test_pinned_bytes_meta_tensors_hold_nothing() -> None:
    leaf = torch.empty(1 << 26, device="meta", requires_grad=True)  # 256 MiB on paper, 0 bytes real
    assert pinned_bytes(leaf.exp()) == 0  # the leaf and exp's saved result: both meta
    assert pinned_bytes({"a": leaf.sum(), "b": leaf.tanh()}) == 0


def test_pinned_bytes_freed_storage_counts_zero() -> None:
    x = torch.randn(256, requires_grad=True)
    y = x.exp()  # saves its result
    assert pinned_bytes(y) == 2 * 256 * F32
    y.untyped_storage().resize_(0)  # what Megatron's deallocate_output_tensor and FSDP do to free memory
    freed = pinned_bytes(y)  # (an assert on the call would show y on failure: printing it would crash)
    assert freed == 256 * F32  # the freed saved result no longer counts; the leaf does


class _Payload(torch.Tensor):
    """A float32 wrapper subclass whose data is a uint8 ``payload`` (as quantized tensors keep theirs)."""

    payload: torch.Tensor

    @staticmethod
    def __new__(cls, payload: torch.Tensor, requires_grad: bool = False) -> _Payload:
        t = torch.Tensor._make_wrapper_subclass(cls, payload.shape, dtype=torch.float32, requires_grad=requires_grad)
        t.payload = payload
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def unwrap(t: Any) -> Any:
            return t.payload.float() if isinstance(t, _Payload) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


class _FlatPayload(_Payload):
    """The same, traceable: it names its payload in ``__tensor_flatten__``."""

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["payload"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: None, size: Any, stride: Any) -> _FlatPayload:
        return _FlatPayload(inner["payload"])


@pytest.mark.parametrize("cls", [_FlatPayload, _Payload], ids=["tensor_flatten", "attributes"])
def test_pinned_bytes_wrapper_subclass_counts_its_payload(cls: type[_Payload]) -> None:
    leaf = cls(torch.zeros(1000, dtype=torch.uint8), requires_grad=True)
    assert is_traceable_wrapper_subclass(leaf) == (cls is _FlatPayload)
    assert pinned_bytes(leaf.sum()) == 1000  # the uint8 payload, not 1000 x float32


def test_pinned_bytes_jagged_nested_tensor_counts_its_components() -> None:
    parts = [torch.randn(2, 3), torch.randn(4, 3), torch.randn(1, 3)]
    leaf = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
    components = [getattr(leaf, name) for name in leaf.__tensor_flatten__()[0]]
    assert components[0].shape == (7, 3) and components[1].shape == (4,)  # values and offsets first
    expected = sum(c.untyped_storage().nbytes() for c in components)
    assert expected >= 7 * 3 * F32 + 4 * I64
    assert pinned_bytes(leaf.sin()) == expected  # sin saves the leaf itself: counted once


# --------------------------------------------------------------------------------------------------
# unreached_params
# --------------------------------------------------------------------------------------------------


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.policy = nn.Linear(3, 2)
        self.value = nn.Linear(3, 1)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def test_unreached_params_all_reached() -> None:
    m = TwoHeads()
    x = torch.randn(4, 3)
    h = m.frozen(x)
    loss = m.policy(h).sum() + m.value(h).sum()
    assert unreached_params(loss, m.named_parameters()) == Unreached()


def test_unreached_params_reports_missing() -> None:
    m = TwoHeads()
    x = torch.randn(4, 3)
    # the loss still requires grad (through the value head) but never reaches the policy
    policy_out = m.policy(x).detach()
    loss = m.value(x).sum() + policy_out.sum()
    assert loss.requires_grad
    assert sorted(unreached_params(loss, m.named_parameters()).missing) == ["policy.bias", "policy.weight"]


def test_unreached_params_ignores_frozen_and_empty() -> None:
    m = TwoHeads()
    loss = m.value(torch.randn(2, 3)).sum()
    names = unreached_params(loss, m.named_parameters()).missing
    assert "frozen.weight" not in names and "frozen.bias" not in names
    assert sorted(names) == ["policy.bias", "policy.weight"]
    assert unreached_params(loss, m.frozen.named_parameters()) == Unreached()
    assert unreached_params(loss, []) == Unreached()


def test_unreached_params_through_checkpoint() -> None:
    m = TwoHeads()
    x = torch.randn(2, 3, requires_grad=True)
    out = checkpoint(m.policy, x, use_reentrant=False)
    loss = out.sum()
    assert sorted(unreached_params(loss, m.named_parameters()).missing) == ["value.bias", "value.weight"]
