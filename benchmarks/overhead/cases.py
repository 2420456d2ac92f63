"""The cases, in groups: each group builds its own payloads and owns its setup and teardown.

A :class:`Group` declares its case names up front, so ``--only`` selects before anything is built.
``group.setup(names)`` is a context manager: it sets up the selected cases, yields them, and undoes
what it set up when it exits (``enforce()`` scopes exited, stats reset, the process group it made
destroyed), also when a case fails. Nothing here freezes ``gc`` or registers ``atexit`` hooks (what
an import registers, torch._dynamo's on the first checkpointed step, is the import's); only the
Megatron groups import megatron-core, and only when entered.

Every case pairs a *candidate* (gradguard) with a *baseline*, both called as ``fn(arg)``. Kinds:

* ``ratio``: candidate / baseline (paired) must be <= ``target``;
* ``delta_us``: the paired overhead per call, in microseconds, must be <= ``target``;
* ``share``: the paired overhead per call over the *unguarded* call, times the calls per micro-batch,
  over the median micro-batch step of a ``gradguard bench`` scenario, must be <= ``target``;
* ``decide``: baseline / candidate - 1 (what the candidate's fast path saves) against ``target``,
  a threshold for a decision rather than a budget;
* ``info``: a ratio reported without a target.

Adding a case: add its name to a group's ``@group(...)`` names and build it in that group's body.
"""

from __future__ import annotations

import functools
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any

import torch
from torch.utils import _pytree

import gradguard
from gradguard import detach_tree, guard

from .registry import (
    DECIDE,
    DELTA_US,
    GROUPS,
    INFO,
    KINDS,
    RATIO,
    SHARE,
    Case,
    Group,
    Share,
    StepTime,
    Unavailable,
    group,
    select,
)

__all__ = [
    "DECIDE",
    "DELTA_US",
    "GROUPS",
    "INFO",
    "KINDS",
    "RATIO",
    "SHARE",
    "Case",
    "Group",
    "Share",
    "StepTime",
    "Unavailable",
    "select",
]


# --------------------------------------------------------------------------------------------------
# Payloads and the hand-written alternatives
# --------------------------------------------------------------------------------------------------

SHAPE = (4, 32)  # small: the cost of a detach (a new TensorImpl sharing storage), not of allocation


def _graph(leaf: torch.Tensor) -> torch.Tensor:
    return leaf * 2  # carries grad_fn (MulBackward0)


def verl_record(leaf: torch.Tensor) -> dict[str, Any]:
    """verl's per-micro-batch record, both tensors carrying a graph."""
    return {
        "model_output": {"log_probs": _graph(leaf), "entropy": _graph(leaf)},
        "loss": 0.25,
        "metrics": {"a": 1.0, "b": 2.0},
    }


def bench_record(leaf: torch.Tensor) -> dict[str, Any]:
    """The record ``gradguard bench``'s scenarios keep per micro-batch (``scenarios._record``'s shape)."""
    return {"model_output": {"log_probs": _graph(leaf), "entropy": _graph(leaf)}, "loss": 0.25}


def narrow_detach(x: Any) -> Any:
    """A verl-style hand-written detach: dict/list/tuple only, every container rebuilt."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, dict):
        return {k: narrow_detach(v) for k, v in x.items()}
    if isinstance(x, list):
        return [narrow_detach(v) for v in x]
    if isinstance(x, tuple):
        return tuple(narrow_detach(v) for v in x)
    return x


def bare_comprehension(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floor for a flat dict of tensors."""
    return {k: v.detach() for k, v in d.items()}


def _detach_if_tensor(t: Any) -> Any:
    return t.detach() if isinstance(t, torch.Tensor) else t


pytree_detach = functools.partial(_pytree.tree_map, _detach_if_tensor)


def same_values(a: Any, b: Any) -> None:
    """Raise unless ``a`` and ``b`` have the same structure and leaves, every tensor detached, same storage."""
    la, sa = _pytree.tree_flatten(a)
    lb, sb = _pytree.tree_flatten(b)
    if sa != sb:
        raise AssertionError(f"different structures: {sa} vs {sb}")
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.grad_fn is None and y.grad_fn is None):
                raise AssertionError("a tensor still carries a graph")
            if x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
                raise AssertionError("a detached tensor does not share its storage")
        elif x != y:
            raise AssertionError(f"{x!r} != {y!r}")


@contextmanager
def _detach_mode() -> Iterator[None]:
    """Mode ``detach`` for the group's calls, whatever ``GRADGUARD`` says; stats start and end empty."""
    gradguard.reset_stats()
    try:
        with gradguard.enforce(mode="detach", engines="none"):
            yield
    finally:
        gradguard.reset_stats()


def _pick(selected: frozenset[str], factories: dict[str, Callable[[], Case]]) -> list[Case]:
    """Build only the selected cases, in declaration order."""
    return [make() for name, make in factories.items() if name in selected]


def _agrees(payload: Any, candidate: Callable[[Any], Any], *baselines: Callable[[Any], Any]) -> Callable[[], None]:
    """A check: every side gives the same detached values; a payload with nothing to detach comes back as itself."""

    def check() -> None:
        for baseline in baselines:
            same_values(candidate(payload), baseline(payload))
        if not gradguard.find_graphs(payload) and candidate(payload) is not payload:
            raise AssertionError("a payload with nothing to detach was rebuilt")

    return check


def _payloads(leaf: torch.Tensor) -> dict[str, Any]:
    rec = verl_record(leaf)
    return {
        "verl record, graph": rec,
        "verl record, clean": narrow_detach(rec),
        "8 dicts x 4 tensors": [{f"k{j}": _graph(leaf) for j in range(4)} for _ in range(8)],
        "dict of 32 tensors": {f"t{i}": _graph(leaf) for i in range(32)},
    }


# --------------------------------------------------------------------------------------------------
# detach_tree
# --------------------------------------------------------------------------------------------------

_D = "detach_tree"
_DETACH_TREE: dict[str, tuple[Callable[[Any], Any], str, float]] = {  # payload: (baseline, its label, target ratio)
    "verl record, graph": (narrow_detach, "verl-style narrow", 0.9),
    "verl record, clean": (narrow_detach, "verl-style narrow", 0.7),
    "8 dicts x 4 tensors": (pytree_detach, "_pytree.tree_map", 0.5),
    "dict of 32 tensors": (bare_comprehension, "{k: v.detach()}", 1.3),
}


@group("detach_tree", *(f"{_D}: {p}" for p in _DETACH_TREE))
def _detach_tree_cases(selected: frozenset[str]) -> Iterator[list[Case]]:
    payloads = _payloads(torch.randn(SHAPE, requires_grad=True))

    def make(p: str) -> Case:
        base, label, target = _DETACH_TREE[p]
        x = payloads[p]
        return Case(
            f"{_D}: {p}", RATIO, detach_tree, base, _D, label, x, target=target, check=_agrees(x, detach_tree, base)
        )

    yield [make(p) for p in _DETACH_TREE if f"{_D}: {p}" in selected]


_A = "apply_to_collection"
_ATC = ("verl record, graph", "8 dicts x 4 tensors", "dict of 32 tensors")


@group("detach_tree vs lightning's apply_to_collection (info)", *(f"{_A}: {p}" for p in _ATC))
def _apply_to_collection_cases(selected: frozenset[str]) -> Iterator[list[Case]]:
    try:
        from lightning_utilities.core.apply_func import apply_to_collection
    except ImportError as exc:
        raise Unavailable(f"lightning_utilities not importable ({exc})") from None
    atc = functools.partial(apply_to_collection, dtype=torch.Tensor, function=torch.Tensor.detach)
    payloads = _payloads(torch.randn(SHAPE, requires_grad=True))
    yield [
        Case(f"{_A}: {p}", INFO, detach_tree, atc, _D, _A, payloads[p], check=_agrees(payloads[p], detach_tree, atc))
        for p in _ATC
        if f"{_A}: {p}" in selected
    ]


# --------------------------------------------------------------------------------------------------
# The walk's inline scan of exact dict/list/tuple children
# --------------------------------------------------------------------------------------------------

_F = "fast path"


def _walks() -> tuple[Callable[[Any], Any], Callable[[Any], Any], Callable[[Any], Any]]:
    """``detach`` through ``_Walk.visit`` (the inline scan), through the spec path at the top level only
    (``_Walk.container`` of the record itself; its children are visited as usual), and through the spec
    path at every level (the walk as it would be without ``_Walk.builtin``: the choice item 2 makes)."""
    from gradguard._tree import walk as _tree
    from gradguard._tree.containers import ATOM, OPAQUE, SEALED, TENSOR, spec_for

    walk_cls = _tree._Walk
    detach_tensor = _tree._detach_tensor
    tensor_cls = torch.Tensor

    class SpecWalk(walk_cls):  # type: ignore[misc, valid-type]
        """``_Walk.visit`` without its dict/list/tuple branch: every container through its spec."""

        __slots__ = ()

        def visit(self, obj: Any, depth: int) -> Any:
            cls = type(obj)
            if cls is tensor_cls:
                return obj if obj.grad_fn is None and self.fn is detach_tensor else self.tensor(obj)
            if cls is str or cls is int or cls is float or cls is bool or obj is None:
                return obj
            spec = spec_for(cls)
            if spec is TENSOR:
                return self.tensor(obj)
            if spec is ATOM or spec is OPAQUE or spec is SEALED:
                return obj
            return self.container(obj, spec, depth)

    def fast(obj: Any) -> Any:
        return walk_cls(detach_tensor).visit(obj, 0)

    def top_level(obj: Any) -> Any:
        return walk_cls(detach_tensor).container(obj, spec_for(type(obj)), 0)

    def every_level(obj: Any) -> Any:
        return SpecWalk(detach_tensor).visit(obj, 0)

    return fast, top_level, every_level


_FAST = {  # name: (payload, the general path)
    f"{_F}: verl record, graph": ("verl record, graph", "every level"),
    f"{_F}: verl record, graph, top level only": ("verl record, graph", "top level"),
    f"{_F}: verl record, clean": ("verl record, clean", "every level"),
    f"{_F}: dict of 32 tensors": ("dict of 32 tensors", "every level"),
}


@group("walk fast path: _Walk.builtin vs the spec path", *_FAST)
def _fast_path_cases(selected: frozenset[str]) -> Iterator[list[Case]]:
    fast, top_level, every_level = _walks()
    general = {"top level": top_level, "every level": every_level}
    payloads = _payloads(torch.randn(SHAPE, requires_grad=True))

    def make(name: str, payload: Any, path: str) -> Case:
        spec = general[path]
        check = _agrees(payload, fast, spec, detach_tree)
        return Case(name, DECIDE, fast, spec, "_Walk.builtin", f"spec path, {path}", payload, target=0.10, check=check)

    yield [make(name, payloads[p], path) for name, (p, path) in _FAST.items() if name in selected]


# --------------------------------------------------------------------------------------------------
# Guarded append, @forward_step, the loss contract
# --------------------------------------------------------------------------------------------------

_G = "guarded append"


@group("guarded append", f"{_G}: graph record", f"{_G}: clean record")
def _append_cases(selected: frozenset[str]) -> Iterator[list[Case]]:
    leaf = torch.randn(SHAPE, requires_grad=True)
    rec = verl_record(leaf)  # detach_tree never mutates it: one object serves every append
    clean = narrow_detach(rec)
    with _detach_mode():
        # Both sides fetch ``append`` from the store at every call, as engine code does.
        graph_store = guard([], name="bench-graph")
        clean_store = guard([], name="bench-clean")
        plain: list[Any] = []

        def guarded_graph(r: Any) -> None:
            graph_store.append(r)

        def by_hand(r: Any) -> None:
            plain.append(detach_tree(r))

        def guarded_clean(r: Any) -> None:
            clean_store.append(r)

        def plain_append(r: Any) -> None:
            plain.append(r)

        def reset() -> None:
            graph_store.clear()
            clean_store.clear()
            plain.clear()

        def check() -> None:
            guarded_graph(rec)
            same_values(graph_store[0], detach_tree(rec))
            guarded_clean(clean)
            if clean_store[0] is not clean:
                raise AssertionError("a clean record was not stored as itself")
            reset()

        rows = {  # name: (candidate, baseline, its label, record)
            f"{_G}: graph record": (guarded_graph, by_hand, "list.append(detach_tree(r))", rec),
            f"{_G}: clean record": (guarded_clean, plain_append, "list.append", clean),
        }
        yield [
            Case(name, DELTA_US, c, b, "guard([]).append", label, r, target=2.0, reset=reset, check=check)
            for name, (c, b, label, r) in rows.items()
            if name in selected
        ]


_S = "@forward_step"


@group(
    "@forward_step", f"{_S}: function, graph record", f"{_S}: function, detached record", f"{_S}: method, graph record"
)
def _forward_step_cases(selected: frozenset[str]) -> Iterator[list[Case]]:
    leaf = torch.randn(SHAPE, requires_grad=True)
    loss = (leaf * 3).sum()
    records = {"graph record": verl_record(leaf), "detached record": narrow_detach(verl_record(leaf))}

    def function_case(what: str) -> Case:
        rec = records[what]

        def step(batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
            return loss, rec

        decorated = gradguard.forward_step(step)

        def by_hand(batch: Any) -> tuple[torch.Tensor, Any]:
            live, out = step(batch)
            return live, detach_tree(out)

        def check() -> None:
            got, want = decorated(None), by_hand(None)
            if got[0] is not loss or want[0] is not loss:
                raise AssertionError("the loss was not passed through")
            same_values(got[1], want[1])

        labels = ("decorated step", "step + detach_tree")
        return Case(f"{_S}: function, {what}", DELTA_US, decorated, by_hand, *labels, target=4.0, check=check)

    def method_case() -> Case:
        rec = records["graph record"]

        class Engine:
            def forward_step(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
                return loss, rec

            decorated = gradguard.forward_step(forward_step)

        engine = Engine()

        def method_decorated(batch: Any) -> Any:
            return engine.decorated(batch)  # each access binds: what engine code pays

        def by_hand(batch: Any) -> tuple[torch.Tensor, Any]:
            live, out = engine.forward_step(batch)
            return live, detach_tree(out)

        def check() -> None:
            same_values(method_decorated(None)[1], by_hand(None)[1])

        labels = ("engine.decorated", "method + detach_tree")
        return Case(
            f"{_S}: method, graph record", DELTA_US, method_decorated, by_hand, *labels, target=4.0, check=check
        )

    with _detach_mode():
        yield _pick(
            selected,
            {
                f"{_S}: function, graph record": lambda: function_case("graph record"),
                f"{_S}: function, detached record": lambda: function_case("detached record"),
                f"{_S}: method, graph record": method_case,
            },
        )


_L = "check_loss(params=)"
_NODES = (100, 1_000, 10_000)


@group("loss contract (info)", *(f"{_L}: {n + 3}-node graph" for n in _NODES))
def _loss_contract_cases(selected: frozenset[str]) -> Iterator[list[Case]]:
    """A chain of ``n`` ``AddBackward0`` nodes over one parameter: the walk visits every node before it
    reaches the parameter's ``AccumulateGrad``. Baseline: the ``requires_grad`` check alone."""

    def make(n: int) -> Case:
        param = torch.nn.Parameter(torch.ones(4))
        y = param * 1.0
        for _ in range(n):
            y = y + 1.0
        loss = y.sum()
        check = functools.partial(gradguard.check_loss, params=[("param", param)])
        return Case(f"{_L}: {n + 3}-node graph", INFO, check, gradguard.check_loss, _L, "check_loss()", loss)

    yield [make(n) for n in _NODES if f"{_L}: {n + 3}-node graph" in selected]


# --------------------------------------------------------------------------------------------------
# gradguard's share of a micro-batch step on gradguard bench's scenarios
# --------------------------------------------------------------------------------------------------


def scenario_steps(name: str) -> Callable[[int], StepTime]:
    """``step(micro_batches)``: the guarded run of bench scenario ``name`` on the CPU at its default size,
    each micro-batch timed (no memory meter: its tracker would slow the step), and what stats counted."""

    def step(micro_batches: int) -> StepTime:
        from gradguard._tools.bench.scenarios import Size, build

        scenario = build(name, torch.device("cpu"), Size())
        times: list[float] = []
        start = 0.0

        def after_microbatch() -> None:
            nonlocal start
            now = time.perf_counter()
            times.append(now - start)
            start = now

        store: Any = None
        gradguard.reset_stats()
        try:
            with gradguard.enforce(mode="detach", engines=list(scenario.engines) or "none"):
                if scenario.run is not None:  # warm-up, outside the measurement
                    scenario.run(2, True, lambda: None)
                else:
                    scenario.step(micro_batches, scenario.new_store(True), True)
                for p in scenario.model.parameters():
                    p.grad = None
                gradguard.reset_stats()
                start = time.perf_counter()
                if scenario.run is not None:  # the engine loops over the micro-batches itself
                    store = scenario.run(micro_batches, True, after_microbatch)
                else:
                    store = scenario.new_store(True)
                    for i in range(micro_batches):
                        scenario.step(i, store, True)
                        after_microbatch()
                publishes = sum(s.records for s in gradguard.stats().values())
        finally:
            gradguard.reset_stats()
            del store
        return StepTime(name, micro_batches, statistics.median(times), min(times), publishes / micro_batches)

    return step


_H = "share"


@group("share: pp-last-stage", f"{_H}: pp-last-stage")
def _share_pp(selected: frozenset[str]) -> Iterator[list[Case]]:
    """pp-last-stage's guarded run appends each micro-batch's record to ``guard([])``."""
    rec = bench_record(torch.randn(SHAPE, requires_grad=True))
    with _detach_mode():
        store: list[Any] = guard([], name="forward_data_store")
        plain: list[Any] = []

        def guarded(r: Any) -> None:
            store.append(r)  # the attribute fetched at each call, as in the scenario

        def unguarded(r: Any) -> None:
            plain.append(r)

        def reset() -> None:
            store.clear()
            plain.clear()

        share = Share("pp-last-stage", 1, scenario_steps("pp-last-stage"))
        labels = ("guard([]).append", "list.append (unguarded)")
        yield [
            Case(
                f"{_H}: pp-last-stage", SHARE, guarded, unguarded, *labels, rec, target=0.001, reset=reset, share=share
            )
        ]


@group("share: lora-checkpoint", f"{_H}: lora-checkpoint")
def _share_lora(selected: frozenset[str]) -> Iterator[list[Case]]:
    """lora-checkpoint's guarded run calls ``@forward_step(forward_only=None)`` once per micro-batch."""
    leaf = torch.randn(SHAPE, requires_grad=True)
    loss, rec = (leaf * 3).sum(), bench_record(leaf)

    def step(batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return loss, rec

    decorated = gradguard.forward_step(step, forward_only=None)
    share = Share("lora-checkpoint", 1, scenario_steps("lora-checkpoint"))
    with _detach_mode():
        labels = ("decorated step", "step (unguarded)")
        yield [Case(f"{_H}: lora-checkpoint", SHARE, decorated, step, *labels, target=0.001, share=share)]


# --------------------------------------------------------------------------------------------------
# Megatron (imported only when these groups are entered)
# --------------------------------------------------------------------------------------------------


def _schedules() -> ModuleType:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron warns about missing TE / apex on import
            from megatron.core.pipeline_parallel import schedules
    except Exception as exc:  # noqa: BLE001 - any import failure means: not measurable here
        raise Unavailable(f"megatron-core not importable ({type(exc).__name__}: {exc})") from None
    return schedules


class _CalcLoss:
    """``forward_step_calc_loss`` as the schedules call it at the last stage (training, one micro-batch),
    original and patched, appending to one ``forward_data_store``."""

    def __init__(self, original: Callable[..., Any], patched: Callable[..., Any]) -> None:
        self.original, self.patched = original, patched
        self.store: list[Any] = []
        self.config = SimpleNamespace(timers=None, calculate_per_token_loss=False)
        self.model = SimpleNamespace()
        self.leaf = torch.randn(SHAPE, requires_grad=True)
        self.output = _graph(self.leaf)

    def caller(self, fn: Callable[..., Any], loss_func: Callable[..., Any]) -> Callable[[Any], Any]:
        def call(_: Any) -> Any:
            return fn(self.model, self.output, loss_func, self.config, None, False, 1, self.store, 1, True)

        return call


@contextmanager
def _calc_loss() -> Iterator[_CalcLoss]:
    """``forward_step_calc_loss``, patched inside ``enforce(engines=["megatron"])`` for the ``with`` block."""
    schedules = _schedules()
    original = schedules.forward_step_calc_loss
    gradguard.reset_stats()
    try:
        with gradguard.enforce(mode="detach", engines=["megatron"]):
            if schedules.forward_step_calc_loss is original:
                raise RuntimeError("enforce(engines=['megatron']) did not patch forward_step_calc_loss")
            yield _CalcLoss(original, schedules.forward_step_calc_loss)
    finally:
        gradguard.reset_stats()
    if schedules.forward_step_calc_loss is not original:
        raise RuntimeError("forward_step_calc_loss is still patched after the scope exited")


_M = "patched forward_step_calc_loss"


@group("megatron adapter", f"{_M}: report with logits", f"{_M}: detached report")
def _megatron_cases(selected: frozenset[str]) -> Iterator[list[Case]]:
    """Candidate: the patched function; baseline: the original, then ``detach_tree`` of what it appended.
    Both call the same ``loss_func`` (a fresh loss each call, so the schedule's in-place scaling never
    chains graphs)."""
    with _calc_loss() as calc:
        leaf, store = calc.leaf, calc.store

        def with_logits(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            return leaf.sum() * 1.0, {"lm loss": 0.5, "logits": output_tensor}  # the user bug: undetached

        def detached(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            loss = leaf.sum() * 1.0
            return loss, {"lm loss": loss.detach()}  # what Megatron's own loss functions report

        def make(what: str, loss_func: Callable[..., Any]) -> Case:
            candidate, original = calc.caller(calc.patched, loss_func), calc.caller(calc.original, loss_func)

            def by_hand(_: Any) -> Any:
                result = original(None)
                store[-1] = detach_tree(store[-1])
                return result

            def check() -> None:
                candidate(None)
                by_hand(None)
                if gradguard.find_graphs(store):
                    raise AssertionError("both sides must store detached records")
                store.clear()

            labels = ("patched (enforce)", "original + detach_tree")
            return Case(
                f"{_M}: {what}", DELTA_US, candidate, by_hand, *labels, target=6.0, reset=store.clear, check=check
            )

        losses = {"report with logits": with_logits, "detached report": detached}
        yield [make(what, fn) for what, fn in losses.items() if f"{_M}: {what}" in selected]


@group("share: megatron-gpt", f"{_H}: megatron-gpt")
def _share_megatron(selected: frozenset[str]) -> Iterator[list[Case]]:
    """megatron-gpt's guarded run calls the patched ``forward_step_calc_loss`` once per micro-batch, its
    ``loss_func`` reporting ``log_probs`` and ``entropy`` with their graph."""
    import torch.distributed as dist

    _schedules()  # megatron-core imports, or the group is unavailable
    from megatron.core import parallel_state

    from gradguard._tools.bench import megatron_gpt

    made_world = not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    try:
        with _calc_loss() as calc:
            leaf = calc.leaf

            def verl_loss(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
                return leaf.sum() * 1.0, {"log_probs": _graph(leaf), "entropy": _graph(leaf)}

            guarded, unguarded = calc.caller(calc.patched, verl_loss), calc.caller(calc.original, verl_loss)
            share = Share("megatron-gpt", 1, scenario_steps("megatron-gpt"))
            labels = ("patched (enforce)", "original (unguarded)")
            reset = calc.store.clear
            yield [
                Case(f"{_H}: megatron-gpt", SHARE, guarded, unguarded, *labels, target=0.001, reset=reset, share=share)
            ]
    finally:
        if made_world and (dist.is_initialized() or parallel_state.model_parallel_is_initialized()):
            megatron_gpt.teardown_world()
