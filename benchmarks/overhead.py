"""Per-call overhead of gradguard against the hand-written alternatives, side by side in one run.

    python benchmarks/overhead.py                 # full run (~1 minute), writes benchmarks/results/
    python benchmarks/overhead.py --quick         # a few-second smoke run (same cases, fewer samples)
    python benchmarks/overhead.py --only append   # cases whose name contains "append"

Method. Every case pairs a *candidate* (gradguard) with a *baseline* (what it is compared to). Both
are timed in the same process, interleaved: each round times one batch of N calls of each, back to
back, the order alternating from round to round, with ``gc`` collected beforehand and disabled while
timing, and torch pinned to one thread. N is calibrated per side so a batch lasts ``--batch-ms``. The
loop and the call of the callable itself are inside both sides' times (same shape on both sides).

The verdict is *paired*: each round gives the ratio candidate / baseline of its two batches, taken
milliseconds apart; the paired ratio is the median of those. A ``delta_us`` target is checked against
(paired ratio - 1) x the baseline's fastest round, i.e. the overhead in microseconds at the machine's
undisturbed speed. Why: this shared machine changes speed by up to 2x within seconds, and a round's
two batches almost always run at the same speed, while two sides' medians over a whole case can mix
speeds. The table also gives the comparison on independent medians (each side's median over rounds)
and on best rounds (each side's fastest round).

Targets are of two kinds: ``ratio`` (candidate / baseline must be <= target) and ``delta_us``
(candidate - baseline, in microseconds, must be <= target). ``info`` cases report a ratio without a
target.

Adding a case: write a function decorated with ``@builder`` that returns a list of :class:`Case` (or
raises :class:`Unavailable` with a one-line reason when a dependency is missing). See the
``forward_step`` and megatron builders at the end of the case section.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree

import gradguard
from gradguard import detach_tree, guard, unwrap

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# --------------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------------

RATIO = "ratio"  # candidate / baseline <= target
DELTA_US = "delta_us"  # candidate - baseline <= target microseconds
INFO = "info"  # ratio reported, no target


@dataclass
class Case:
    """One comparison.

    ``candidate`` and ``baseline`` are called as ``fn(arg)`` (``arg`` / ``baseline_arg``; the latter
    defaults to ``arg``). ``reset`` runs outside the timed region before every batch (clear a store
    that grows, reset stats). ``check`` runs once before timing and may assert that both sides compute
    the same thing.
    """

    name: str
    candidate: Callable[[Any], Any]
    baseline: Callable[[Any], Any]
    arg: Any
    kind: str
    target: float | None
    candidate_label: str = "gradguard"
    baseline_label: str = "baseline"
    baseline_arg: Any = None
    reset: Callable[[], None] | None = None
    check: Callable[[], None] | None = None
    group: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in (RATIO, DELTA_US, INFO):
            raise ValueError(f"case {self.name}: unknown kind {self.kind!r}")
        if self.baseline_arg is None:
            self.baseline_arg = self.arg


class Unavailable(Exception):
    """Raised by a builder whose dependency is missing; the reason is printed, the run goes on."""


BUILDERS: list[Callable[[], list[Case]]] = []


def builder(fn: Callable[[], list[Case]]) -> Callable[[], list[Case]]:
    """Register a function that returns the cases of one group."""
    BUILDERS.append(fn)
    return fn


# --------------------------------------------------------------------------------------------------
# Payloads and reference implementations
# --------------------------------------------------------------------------------------------------

SHAPE = (4, 32)  # small: detach cost (a new TensorImpl sharing storage), not allocation, dominates


def _graph_tensor(leaf: torch.Tensor) -> torch.Tensor:
    return leaf * 2  # carries grad_fn (MulBackward0)


def verl_record(leaf: torch.Tensor) -> dict[str, Any]:
    """verl's per-micro-batch record, both tensors carrying grad_fn."""
    return {
        "model_output": {"log_probs": _graph_tensor(leaf), "entropy": _graph_tensor(leaf)},
        "loss": 0.25,
        "metrics": {"a": 1.0, "b": 2.0},
    }


def narrow_detach(x: Any) -> Any:
    """A verl-style hand-written detach: dict/list/tuple only, rebuilds every container."""
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


def _apply_to_collection() -> Callable[[Any], Any]:
    try:
        from lightning_utilities.core.apply_func import apply_to_collection
    except ImportError as exc:
        raise Unavailable(f"lightning_utilities not importable ({exc})") from None
    return functools.partial(apply_to_collection, dtype=torch.Tensor, function=torch.Tensor.detach)


def _same_values(a: Any, b: Any) -> None:
    """Assert both sides produced the same leaves, all without grad_fn."""
    la, _ = _pytree.tree_flatten(a)
    lb, _ = _pytree.tree_flatten(b)
    assert len(la) == len(lb), (len(la), len(lb))
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.grad_fn is None and y.grad_fn is None
            assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
        else:
            assert x == y


# --------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------


@builder
def detach_tree_cases() -> list[Case]:
    leaf = torch.randn(SHAPE, requires_grad=True)
    rec = verl_record(leaf)
    clean = narrow_detach(rec)
    flat32 = {f"t{i}": _graph_tensor(leaf) for i in range(32)}
    nested = [{f"k{j}": _graph_tensor(leaf) for j in range(4)} for _ in range(8)]

    def check() -> None:
        _same_values(detach_tree(rec), narrow_detach(rec))
        assert detach_tree(clean) is clean
        _same_values(detach_tree(flat32), bare_comprehension(flat32))
        _same_values(detach_tree(nested), pytree_detach(nested))

    g = "detach_tree (#2)"
    return [
        Case("verl record, graph", detach_tree, narrow_detach, rec, RATIO, 0.9,
             "detach_tree", "verl-style narrow", check=check, group=g),
        Case("verl record, already detached", detach_tree, narrow_detach, clean, RATIO, 0.7,
             "detach_tree", "verl-style narrow", group=g),
        Case("dict of 32 tensors, graph", detach_tree, bare_comprehension, flat32, RATIO, 1.15,
             "detach_tree", "{k: v.detach()}", group=g),
        Case("list of 8 dicts x 4 tensors, graph", detach_tree, pytree_detach, nested, RATIO, 0.5,
             "detach_tree", "_pytree.tree_map", group=g),
    ]


@builder
def apply_to_collection_cases() -> list[Case]:
    atc = _apply_to_collection()
    leaf = torch.randn(SHAPE, requires_grad=True)
    rec = verl_record(leaf)
    flat32 = {f"t{i}": _graph_tensor(leaf) for i in range(32)}
    nested = [{f"k{j}": _graph_tensor(leaf) for j in range(4)} for _ in range(8)]

    def check() -> None:
        _same_values(detach_tree(rec), atc(rec))

    g = "detach_tree vs lightning apply_to_collection (informational)"
    lab = "apply_to_collection"
    return [
        Case("verl record, graph [atc]", detach_tree, atc, rec, INFO, None, "detach_tree", lab,
             check=check, group=g),
        Case("dict of 32 tensors, graph [atc]", detach_tree, atc, flat32, INFO, None, "detach_tree", lab,
             group=g),
        Case("list of 8 dicts x 4 tensors, graph [atc]", detach_tree, atc, nested, INFO, None,
             "detach_tree", lab, group=g),
    ]


@builder
def guarded_append_cases() -> list[Case]:
    leaf = torch.randn(SHAPE, requires_grad=True)
    rec = verl_record(leaf)  # detach_tree never mutates it, so one object serves every append
    clean = narrow_detach(rec)

    # Both sides fetch ``append`` from the store on every call, as engine code does
    # (``forward_data_store.append(...)``): on a guarded store that fetch goes through the proxy.
    g_graph = guard([], mode="detach", name="bench-graph")
    plain_graph: list[Any] = []

    def guarded_append_graph(r: Any) -> None:
        g_graph.append(r)

    def detach_then_append(r: Any) -> None:
        plain_graph.append(detach_tree(r))

    def reset_graph() -> None:
        unwrap(g_graph).clear()
        plain_graph.clear()

    g_clean = guard([], mode="detach", name="bench-clean")
    plain_clean: list[Any] = []

    def guarded_append_clean(r: Any) -> None:
        g_clean.append(r)

    def plain_append(r: Any) -> None:
        plain_clean.append(r)

    def reset_clean() -> None:
        unwrap(g_clean).clear()
        plain_clean.clear()

    def check() -> None:
        gradguard.reset_stats()  # stats stay one entry per (store, site): steady state is timed
        reset_graph()
        g_graph.append(rec)
        _same_values(unwrap(g_graph)[0], detach_tree(rec))
        reset_clean()
        g_clean.append(clean)
        assert unwrap(g_clean)[0] is clean

    grp = "guarded append (#3), mode detach"
    return [
        Case("guard([]).append(verl record, graph)", guarded_append_graph, detach_then_append, rec, DELTA_US, 0.5,
             "guarded append", "detach_tree + list.append", reset=reset_graph, check=check, group=grp),
        Case("guard([]).append(clean record)", guarded_append_clean, plain_append, clean, DELTA_US, 1.3,
             "guarded append", "list.append", reset=reset_clean, group=grp),
    ]


@builder
def forward_step_cases() -> list[Case]:
    """``@gradguard.forward_step`` (#4): <= 3 us per call plus the detach itself.

    Candidate: the decorated verl-style step returning ``(loss, record)``; baseline: the same
    undecorated step followed by ``detach_tree`` of the record, so the delta is the decorator's own
    overhead. Two records: one whose tensors carry a graph, and the same already detached. The
    graph record is also timed through a method, as engines define ``forward_step``: each
    ``engine.forward_step`` then costs wrapt a bound wrapper, on top of the plain function's call.
    """
    fs = getattr(gradguard, "forward_step", None)
    if fs is None:
        raise Unavailable("gradguard.forward_step not implemented yet (#4)")
    leaf = torch.randn(SHAPE, requires_grad=True)
    loss = (leaf * 3).sum()
    cases = []
    # The record with a graph (what verl <= 0.8 published), and the same record detached (verl 0.9.1
    # detaches it itself): the decorator then only walks it.
    for what, rec in (("record", verl_record(leaf)), ("detached record", narrow_detach(verl_record(leaf)))):

        def step(batch: Any, rec: Any = rec) -> tuple[torch.Tensor, dict[str, Any]]:
            return loss, rec

        def undecorated_then_detach(batch: Any, step: Any = step) -> tuple[torch.Tensor, Any]:
            live, out = step(batch)
            return live, detach_tree(out)

        cases.append(
            Case(f"@forward_step, verl (loss, {what})", fs(step), undecorated_then_detach, None, DELTA_US, 3.0,
                 "decorated step", "step + detach_tree", group="@forward_step (#4)")
        )

    method_rec = verl_record(leaf)

    class Engine:
        def forward_step(self, batch: Any, rec: Any = method_rec) -> tuple[torch.Tensor, dict[str, Any]]:
            return loss, rec

        decorated = fs(forward_step)

    engine = Engine()

    def method_decorated(batch: Any) -> Any:
        return engine.decorated(batch)

    def method_then_detach(batch: Any) -> tuple[torch.Tensor, Any]:
        live, out = engine.forward_step(batch)
        return live, detach_tree(out)

    cases.append(
        Case("@forward_step method, verl (loss, record)", method_decorated, method_then_detach, None, DELTA_US, 3.0,
             "engine.decorated", "method + detach_tree", group="@forward_step (#4)")
    )
    return cases


@builder
def reaches_params_cases() -> list[Case]:
    """``check_loss(params=...)`` (#4): the graph walk's cost against graph size (informational).

    A chain of ``n`` ``AddBackward0`` nodes over one parameter: the walk visits every node before it
    reaches the parameter's ``AccumulateGrad``. Baseline: the ``requires_grad`` check alone.
    """
    cases = []
    for n in (100, 1_000, 10_000):
        param = torch.nn.Parameter(torch.ones(4))
        y = param * 1.0
        for _ in range(n):
            y = y + 1.0
        loss = y.sum()
        params = [("param", param)]
        cases.append(
            Case(f"reaches_params, {n + 3}-node graph", functools.partial(gradguard.check_loss, params=params),
                 gradguard.check_loss, loss, INFO, None, "check_loss(params=)", "check_loss()",
                 group="loss contract (#4)", note=f"{n + 3} nodes")
        )
    return cases


@builder
def megatron_cases() -> list[Case]:
    """A patched megatron-core ``forward_step_calc_loss`` (#4): <= 5 us per call plus the detach.

    Candidate: ``schedules.forward_step_calc_loss`` as the adapter patches it (inside
    ``gradguard.enforce(engines=["megatron"])``, entered for the rest of the run); baseline: the
    original function object, then ``detach_tree`` of the record it appended. Both call the same
    ``loss_func`` (a fresh loss, so megatron's in-place loss scaling never chains graphs), last stage,
    training, ``num_microbatches=1``. Two ``loss_func``s: one reporting undetached logits (a user's
    bug), one reporting a detached loss as Megatron's own loss functions do.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron warns about missing TE / apex on import
            from megatron.core.pipeline_parallel import schedules
    except Exception as exc:  # noqa: BLE001 - any import failure means: not measurable here
        raise Unavailable(f"megatron-core not importable ({type(exc).__name__}: {exc})") from None
    from types import SimpleNamespace

    gc.freeze()  # megatron's import leaves a large heap; keep gc out of the timings
    import atexit

    atexit.register(gc.unfreeze)  # triton's nanobind reports frozen objects as leaks at exit
    original = schedules.forward_step_calc_loss
    scope = gradguard.enforce(engines=["megatron"])
    scope.__enter__()  # left entered: the patched function is what the candidate times
    patched = schedules.forward_step_calc_loss
    assert patched is not original
    leaf = torch.randn(SHAPE, requires_grad=True)
    config = SimpleNamespace(timers=None, calculate_per_token_loss=False)
    model = SimpleNamespace()
    store: list[Any] = []

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        return leaf.sum() * 1.0, {"lm loss": 0.5, "logits": output}  # the user bug: logits undetached

    def loss_func_detached(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        loss = leaf.sum() * 1.0
        return loss, {"lm loss": loss.detach()}  # what Megatron's own loss functions report

    output = _graph_tensor(leaf)
    cases = []
    for what, fn in (("", loss_func), (", detached report", loss_func_detached)):

        def candidate(_: Any, fn: Any = fn) -> Any:
            return patched(model, output, fn, config, None, False, 1, store, 1, True)

        def baseline(_: Any, fn: Any = fn) -> Any:
            result = original(model, output, fn, config, None, False, 1, store, 1, True)
            store[-1] = detach_tree(store[-1])
            return result

        def check(candidate: Any = candidate, baseline: Any = baseline) -> None:
            candidate(None)
            baseline(None)
            assert [r.path for r in gradguard.find_graphs(store)] == [], "both sides must store detached records"
            store.clear()

        cases.append(
            Case(f"patched forward_step_calc_loss{what}", candidate, baseline, None, DELTA_US, 5.0,
                 "patched (enforce)", "original + detach_tree", reset=store.clear, check=check,
                 group="megatron adapter (#4)")
        )
    return cases


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


def _batch(fn: Callable[[Any], Any], arg: Any, n: int) -> int:
    """Nanoseconds for ``n`` calls of ``fn(arg)``."""
    it = range(n)
    t0 = time.perf_counter_ns()
    for _ in it:
        fn(arg)
    return time.perf_counter_ns() - t0


def _calibrate(fn: Callable[[Any], Any], arg: Any, reset: Callable[[], None] | None, batch_ns: int) -> int:
    n = 16
    while True:
        if reset is not None:
            reset()
        t = _batch(fn, arg, n)
        if t >= batch_ns / 4 or n >= 1 << 22:
            return max(16, int(n * batch_ns / max(t, 1)))
        n *= 4


@dataclass
class Result:
    case: Case
    candidate_us: float
    baseline_us: float
    candidate_spread: float  # (p75 - p25) / median over rounds
    baseline_spread: float
    n_candidate: int
    n_baseline: int
    rounds: int
    candidate_min_us: float = 0.0
    baseline_min_us: float = 0.0
    paired_ratio: float = 0.0  # median over rounds of candidate / baseline within the round

    @property
    def ratio(self) -> float:
        """Independent medians: candidate median / baseline median."""
        return self.candidate_us / self.baseline_us

    @property
    def delta_us(self) -> float:
        """Independent medians: candidate median - baseline median."""
        return self.candidate_us - self.baseline_us

    @property
    def paired_delta_us(self) -> float:
        """The paired ratio's excess, in microseconds at the baseline's fastest round."""
        return (self.paired_ratio - 1.0) * self.baseline_min_us

    @property
    def value(self) -> float:
        """What the target is checked against: the paired statistic."""
        return self.paired_delta_us if self.case.kind == DELTA_US else self.paired_ratio

    @property
    def passed(self) -> bool | None:
        if self.case.kind == INFO or self.case.target is None:
            return None
        return self.value <= self.case.target


def _spread(xs: list[float]) -> float:
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def measure(case: Case, rounds: int, batch_ms: float) -> Result:
    batch_ns = int(batch_ms * 1e6)
    sides = [(case.candidate, case.arg), (case.baseline, case.baseline_arg)]
    gc.collect()
    gc.disable()
    try:
        for fn, arg in sides:  # warm-up: caches, specs, first-site bookkeeping
            if case.reset is not None:
                case.reset()
            _batch(fn, arg, 64)
        ns = [_calibrate(fn, arg, case.reset, batch_ns) for fn, arg in sides]
        samples: list[list[float]] = [[], []]
        for r in range(rounds):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for i in order:
                fn, arg = sides[i]
                if case.reset is not None:
                    case.reset()
                samples[i].append(_batch(fn, arg, ns[i]) / ns[i] / 1e3)
    finally:
        if case.reset is not None:
            case.reset()
        gc.enable()
        gc.collect()
    return Result(
        case,
        statistics.median(samples[0]),
        statistics.median(samples[1]),
        _spread(samples[0]),
        _spread(samples[1]),
        ns[0],
        ns[1],
        rounds,
        min(samples[0]),
        min(samples[1]),
        statistics.median(c / b for c, b in zip(samples[0], samples[1])),
    )


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 0
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": cores,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gradguard": gradguard.__version__,
        "loadavg_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_line(m: dict[str, Any]) -> str:
    return (
        f"{m['platform']}; CPU: {m['cpu']}; {m['cores']} cores; Python {m['python']}; "
        f"torch {m['torch']}; gradguard {m['gradguard']}; {m['date']}; load avg {m['loadavg_1min']}"
    )


def _target_str(c: Case) -> str:
    if c.kind == RATIO:
        return f"<= {c.target:g}x"
    if c.kind == DELTA_US:
        return f"<= +{c.target:g} us"
    return "(info)"


def _value_str(r: Result) -> str:
    """The verdict's statistic: paired within rounds."""
    if r.case.kind == DELTA_US:
        return f"{r.paired_delta_us:+.2f} us ({r.paired_ratio:.2f}x)"
    return f"{r.paired_ratio:.3f}x"


def _medians_str(r: Result) -> str:
    """The same comparison on independent medians (each side's own median over rounds)."""
    if r.case.kind == DELTA_US:
        return f"{r.delta_us:+.2f} us"
    return f"{r.ratio:.3f}x"


def _best_str(r: Result) -> str:
    """The same comparison on each side's fastest round: the least-disturbed estimate."""
    if r.case.kind == DELTA_US:
        return f"{r.candidate_min_us - r.baseline_min_us:+.2f} us"
    return f"{r.candidate_min_us / r.baseline_min_us:.3f}x"


def _verdict(r: Result) -> str:
    return {True: "PASS", False: "FAIL", None: "-"}[r.passed]


def table_rows(results: list[Result]) -> list[tuple[str, ...]]:
    return [
        (
            r.case.name,
            f"{r.case.candidate_label}",
            f"{r.candidate_us:.3f}",
            f"{r.case.baseline_label}",
            f"{r.baseline_us:.3f}",
            _value_str(r),
            _target_str(r.case),
            _verdict(r),
            _medians_str(r),
            _best_str(r),
        )
        for r in results
    ]


HEADER = (
    "case", "candidate", "cand us", "baseline", "base us", "paired", "target", "result", "medians", "best rounds",
)


def text_table(results: list[Result]) -> str:
    rows = [HEADER, *table_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(results: list[Result], m: dict[str, Any], skipped: list[tuple[str, str]], args: Any) -> str:
    out = [
        f"Machine: {machine_line(m)}",
        "",
        f"`python benchmarks/overhead.py{' --quick' if args.quick else ''}` — {args.rounds} interleaved rounds, "
        f"batches of ~{args.batch_ms:g} ms per side; torch threads = 1, gc disabled while timing. "
        "*paired* (the verdict): median over rounds of candidate / baseline within a round; a delta is "
        "(that ratio - 1) x the baseline's fastest round. *medians*: each side's median over rounds. "
        "*best rounds*: each side's fastest round. cand us / base us: each side's median.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" for _ in HEADER) + "|",
    ]
    out += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    if skipped:
        out += ["", "Not measured:"]
        out += [f"- {name}: {why}" for name, why in skipped]
    return "\n".join(out) + "\n"


def to_json(results: list[Result], m: dict[str, Any], skipped: list[tuple[str, str]], args: Any) -> dict[str, Any]:
    return {
        "machine": m,
        "machine_line": machine_line(m),
        "settings": {"quick": args.quick, "rounds": args.rounds, "batch_ms": args.batch_ms, "torch_threads": 1},
        "cases": [
            {
                "name": r.case.name,
                "group": r.case.group,
                "candidate": r.case.candidate_label,
                "baseline": r.case.baseline_label,
                "candidate_us": r.candidate_us,
                "baseline_us": r.baseline_us,
                "candidate_iqr_rel": r.candidate_spread,
                "baseline_iqr_rel": r.baseline_spread,
                "calls_per_batch": [r.n_candidate, r.n_baseline],
                "paired_ratio": r.paired_ratio,
                "paired_delta_us": r.paired_delta_us,
                "ratio": r.ratio,
                "delta_us": r.delta_us,
                "ratio_of_minima": r.candidate_min_us / r.baseline_min_us,
                "delta_of_minima_us": r.candidate_min_us - r.baseline_min_us,
                "kind": r.case.kind,
                "target": r.case.target,
                "passed": r.passed,
            }
            for r in results
        ],
        "skipped": [{"builder": n, "reason": why} for n, why in skipped],
        "all_passed": all(r.passed is not False for r in results),
    }


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def collect(only: str | None) -> tuple[list[Case], list[tuple[str, str]]]:
    cases: list[Case] = []
    skipped: list[tuple[str, str]] = []
    for b in BUILDERS:
        try:
            built = b()
        except Unavailable as exc:
            skipped.append((b.__name__, str(exc)))
            continue
        cases += [c for c in built if only is None or only.lower() in c.name.lower()]
    return cases, skipped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few-second smoke run")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per case (default 61; quick 3)")
    p.add_argument("--batch-ms", type=float, default=None, help="ms per timed batch (default 5; quick 2)")
    p.add_argument("--json", default=os.path.join(RESULTS, "overhead-cpu.json"), help="JSON output path")
    p.add_argument("--markdown", default=None, help="markdown output path (default: JSON path with .md)")
    p.add_argument("--only", default=None, help="run only cases whose name contains this text")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 61
    if args.batch_ms is None:
        args.batch_ms = 2.0 if args.quick else 5.0
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    md_path = args.markdown or os.path.splitext(args.json)[0] + ".md"

    torch.set_num_threads(1)
    gradguard.reset_stats()
    m = machine_info()
    print(f"Machine: {machine_line(m)}")
    cases, skipped = collect(args.only)
    for name, why in skipped:
        print(f"  skipped {name}: {why}")
    for c in cases:
        if c.check is not None:
            c.check()
    results = []
    t0 = time.perf_counter()
    for c in cases:
        r = measure(c, args.rounds, args.batch_ms)
        print(f"  {c.name}: {r.candidate_us:.3f} us vs {r.baseline_us:.3f} us -> paired {_value_str(r)} {_verdict(r)}",
              flush=True)
        results.append(r)
    gradguard.reset_stats()
    print(f"\n{text_table(results)}\n\n({time.perf_counter() - t0:.1f} s)")

    for path in (args.json, md_path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(to_json(results, m, skipped, args), f, indent=2)
        f.write("\n")
    with open(md_path, "w") as f:
        f.write(markdown(results, m, skipped, args))
    print(f"wrote {args.json}\nwrote {md_path}")
    failed = [r.case.name for r in results if r.passed is False]
    if failed:
        print("missed targets: " + "; ".join(failed))
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
