"""megatron-core's real ``forward_backward_no_pipelining`` around a real ``GPTModel``, on CPU.

The harness (``gradguard/_tools/bench/megatron_gpt.py``, shared with ``gradguard bench --scenario
megatron-gpt``) builds a two-layer ``GPTModel`` from the local layer spec as a pipeline's last stage,
at world size 1 on gloo, and runs Megatron's schedule over 16 micro-batches with a verl-style
``loss_func`` that publishes ``log_probs`` and ``entropy`` with their graph. On CPU it redirects
exactly one schedule line (``total_num_tokens``'s ``device="cuda"``) and prepares two things the
attention needs (its score buffer, its dropout RNG tracker); the tests below show that each of the
three is needed, where megatron-core fails without it, and that a release with other CUDA lines on
this path is refused.

Memory is exact live tensor bytes (``MemoryProbe``), read after each micro-batch's backward.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
import wrapt
from _helpers import require_engine

import gradguard
from gradguard._tools.bench.scenarios import Size
from gradguard.testing import MemoryProbe

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
SIZE = Size(seq=32, batch=2, hidden=64, vocab=128)  # float32
N_MICRO = 16
PIN = 2 * 32 * 2 * 64 * 4  # the receive buffer [seq, batch, hidden] and its .grad
RECORD = 2 * 2 * 32 * 4  # log_probs and entropy, [batch, seq] float32
TIMEOUT_S = 300

# megatron's own layers call its linear function without a tp_group, once per layer and micro-batch
pytestmark = pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")


@pytest.fixture(scope="module")
def mg() -> Iterator[ModuleType]:
    """The harness module, with megatron imported, a world of one rank, and a cheap gc."""
    schedules = require_engine(SCHEDULES)
    from gradguard._tools.bench import megatron_gpt

    # megatron's import leaves ~400k objects for every gc.collect() (each reading takes one) to scan
    gc.collect()
    gc.freeze()
    megatron_gpt.ensure_world()
    try:
        yield megatron_gpt
    finally:
        megatron_gpt.teardown_world()
        gc.unfreeze()
    assert not isinstance(schedules.forward_step_calc_loss, wrapt.FunctionWrapper)


def measure(harness: Any, n: int = N_MICRO) -> tuple[list[Any], MemoryProbe]:
    harness.zero_grad()
    with MemoryProbe() as probe:
        store = harness.run(n, probe.step)
    assert len(probe.readings) == n + 1  # the start, then one per micro-batch
    return store, probe


def steps(probe: MemoryProbe) -> list[int]:
    """Bytes added by each micro-batch after the first (the first also allocates the parameters' grads)."""
    r = probe.readings[1:]
    return [b - a for a, b in zip(r, r[1:])]


# --------------------------------------------------------------------------------------------------
# The schedule: what leaks, by how much, and what the guard changes
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_real_schedule_pins_the_analytic_amount_and_enforce_releases_it(mg: ModuleType) -> None:
    assert (mg.pin_bytes(SIZE), mg.record_bytes(SIZE)) == (PIN, RECORD)
    harness = mg.GPTSchedule("cpu", SIZE)
    harness.run(2)  # warm-up: lazy initialisation outside the measurement

    store, probe = measure(harness)
    unguarded, unguarded_steps = probe.growth_per_step, steps(probe)
    graphs = gradguard.find_graphs(store)
    pinned = gradguard.pinned_bytes(store)
    alive = sum(ref() is not None for ref in harness.buffers)
    grads, losses = harness.grads(), list(harness.losses)
    values = [{k: v.detach().clone() for k, v in r.items()} for r in store]
    del store

    with gradguard.enforce(engines=["megatron"]):  # entered after megatron's import
        store, probe = measure(harness)
    guarded = probe.growth_per_step
    print(f"analytic pin {PIN} B + record {RECORD} B; growth unguarded {unguarded} B, guarded {guarded} B")

    # unguarded: every micro-batch's graph is kept, with its receive buffer and that buffer's .grad
    assert len(graphs) == 2 * N_MICRO and {g.path[g.path.index("]") + 1 :] for g in graphs} == {
        "['log_probs']",
        "['entropy']",
    }
    assert alive == N_MICRO
    assert pinned == N_MICRO * PIN  # gradguard's estimate from the graphs agrees with the shapes
    assert abs((unguarded - RECORD) - PIN) <= 0.05 * PIN  # the target
    assert unguarded_steps == [PIN + RECORD] * (N_MICRO - 1)  # CPU bytes are exact: to the byte
    # guarded: the records' own bytes, nothing else
    assert guarded == RECORD and steps(probe) == [RECORD] * (N_MICRO - 1)
    assert len(store) == N_MICRO and gradguard.find_graphs(store) == []
    assert sum(ref() is not None for ref in harness.buffers) == 0
    # the same values, the same losses, bitwise the same gradients
    assert all(torch.equal(a[k], b[k]) for a, b in zip(values, store) for k in ("log_probs", "entropy"))
    assert harness.losses == losses and len(losses) == N_MICRO
    after = harness.grads()
    assert len(grads) == len(after) == len(list(harness.model.parameters())) > 0
    assert all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(grads, after))
    # what the guard did, attributed to the schedule's call of forward_step_calc_loss
    rows = [row for (name, _), row in gradguard.stats().items() if name == "megatron.forward_data_store"]
    assert [(os.path.basename(r.site), r.records, r.tensors_detached) for r in rows] == [
        (f"schedules.py:{calc_loss_call_line()}", N_MICRO, 2 * N_MICRO)
    ]
    assert harness.redirected == 3  # one redirected total_num_tokens per schedule call, nothing else


def calc_loss_call_line() -> int:
    """The line of forward_step's call of forward_step_calc_loss in the installed schedules.py."""
    lines, start = inspect.getsourcelines(sys.modules[SCHEDULES].forward_step)
    (i,) = [i for i, line in enumerate(lines) if "= forward_step_calc_loss(" in line]
    return start + i


@pytest.mark.integration
def test_bf16_casts_the_whole_model_and_pins_the_bf16_buffer(mg: ModuleType) -> None:
    """As Megatron-LM's Float16Module does (torch's LayerNorm ignores params_dtype); the seed preset is bf16."""
    size = Size(seq=32, batch=2, hidden=64, vocab=128, dtype=torch.bfloat16)
    harness = mg.GPTSchedule("cpu", size)
    assert {p.dtype for p in harness.model.parameters()} == {torch.bfloat16}
    harness.run(2)
    store, probe = measure(harness, 4)
    assert mg.pin_bytes(size) == PIN // 2 and mg.record_bytes(size) == RECORD  # the record is float32
    assert steps(probe) == [PIN // 2 + RECORD] * 3
    with gradguard.enforce(engines=["megatron"]):
        store, probe = measure(harness, 4)
    assert steps(probe) == [RECORD] * 3


# --------------------------------------------------------------------------------------------------
# enforce() entered before megatron is imported (a fresh interpreter)
# --------------------------------------------------------------------------------------------------

BEFORE_IMPORT = textwrap.dedent(
    """
    import gc, json, sys, warnings
    import torch, wrapt
    import gradguard
    from gradguard._tools.bench.megatron_gpt import GPTSchedule, ensure_world
    from gradguard._tools.bench.scenarios import Size
    from gradguard.testing import MemoryProbe

    SIZE, N = Size(seq=32, batch=2, hidden=64, vocab=128), 16
    assert not any(m == "megatron" or m.startswith("megatron.") for m in sys.modules), "megatron already imported"

    def measure(h):
        h.zero_grad()
        with MemoryProbe() as probe:
            store = h.run(N, probe.step)
        r = probe.readings[1:]
        return store, probe.growth_per_step, [b - a for a, b in zip(r, r[1:])]

    with gradguard.enforce(engines=["megatron"]):
        h = GPTSchedule("cpu", SIZE)  # imports megatron-core: the post-import hook patches it
        from megatron.core.pipeline_parallel import schedules
        patched = schedules.forward_step_calc_loss
        assert isinstance(patched, wrapt.FunctionWrapper), type(patched)
        gc.collect(); gc.freeze()  # keep each reading's gc.collect() cheap
        h.run(2)
        store, guarded, guarded_steps = measure(h)
        graphs = len(gradguard.find_graphs(store))
        grads_g = h.grads()
        del store
    assert schedules.forward_step_calc_loss is patched.__wrapped__, "not restored"
    store, unguarded, unguarded_steps = measure(h)  # control: unguarded after exit, the leak is back
    equal = all(torch.equal(a, b) for a, b in zip(grads_g, h.grads()))
    leaked = len(gradguard.find_graphs(store))
    del store
    gc.unfreeze()  # let interpreter shutdown free them (else triton's nanobind reports leaks)
    print(json.dumps({"guarded": guarded, "guarded_steps": guarded_steps, "graphs": graphs,
                      "unguarded": unguarded, "unguarded_steps": unguarded_steps, "leaked": leaked,
                      "grads_equal": equal, "redirected": h.redirected}))
    """
)


@pytest.mark.integration
def test_enforce_entered_before_the_megatron_import(mg: ModuleType) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRADGUARD"}
    proc = subprocess.run(
        [sys.executable, "-c", BEFORE_IMPORT], capture_output=True, text=True, env=env, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["graphs"] == 0 and result["leaked"] == 2 * N_MICRO, result
    assert result["guarded"] == RECORD and result["guarded_steps"] == [RECORD] * (N_MICRO - 1), result
    assert abs((result["unguarded"] - RECORD) - PIN) <= 0.05 * PIN, result
    assert result["unguarded_steps"] == [PIN + RECORD] * (N_MICRO - 1), result
    assert result["grads_equal"] is True and result["redirected"] == 3, result


# --------------------------------------------------------------------------------------------------
# The loss is checked at the real schedule
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_detached_loss_is_reported_at_the_schedules_line(mg: ModuleType) -> None:
    """The silent trap: a detach placed before the loss. Megatron skips backward and goes on."""

    def detached_first(labels: torch.Tensor, advantages: torch.Tensor, output: torch.Tensor) -> Any:
        return mg.verl_style_loss(labels, advantages, output.detach())

    harness = mg.GPTSchedule("cpu", SIZE, loss_func=detached_first)
    with gradguard.enforce(engines=["megatron"]), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store = harness.run(2)
    contract = [w for w in caught if issubclass(w.category, gradguard.LossContractWarning)]
    assert len(contract) == 2, [str(w.message) for w in caught]
    assert {(os.path.basename(w.filename), w.lineno) for w in contract} == {("schedules.py", calc_loss_call_line())}
    assert all("does not require grad" in str(w.message) for w in contract)
    assert all(p.grad is None for p in harness.model.parameters())  # no backward ran
    assert len(store) == 2 and gradguard.find_graphs(store) == []


# --------------------------------------------------------------------------------------------------
# What runs on CPU, and only that: the known CUDA lines, the narrow redirect, each accommodation
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_the_schedule_mentions_cuda_in_the_known_lines_only(mg: ModuleType) -> None:
    schedules = sys.modules[SCHEDULES]
    found = mg.check_schedule_cuda_lines(schedules)
    assert set(found) == set(mg.KNOWN_CUDA_LINES)
    source = inspect.getsource(schedules).splitlines()
    assert source[found[(mg.ENTRY, mg.REDIRECTED)] - 1].strip() == mg.REDIRECTED
    # the walk reaches what the entry point calls: forward_step is in, the pipelined schedules are not
    functions = {name for name, _ in found}
    assert functions == {"forward_backward_no_pipelining", "forward_step"}


def _edit(source: str, function: str, anchor: str, new_line: str) -> str:
    """``source`` with ``new_line`` inserted after the first line of ``function`` that contains ``anchor``."""
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {function}("))
    at = next(i for i in range(start, len(lines)) if anchor in lines[i])
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    return "\n".join([*lines[: at + 1], indent + new_line, *lines[at + 1 :]])


@pytest.mark.integration
def test_a_release_with_another_cuda_line_is_refused(mg: ModuleType) -> None:
    schedules = sys.modules[SCHEDULES]
    source = inspect.getsource(schedules)
    added = _edit(source, "backward_step", "input_tensor_grad = [None]", 'marker = torch.ones(1, device="cuda")')
    with pytest.raises(
        gradguard.GradGuardError, match=r"new: .*schedules\.py:\d+ in backward_step: marker = torch\.ones"
    ):
        mg.check_schedule_cuda_lines(schedules, added)
    # a new helper, reached through a call, is found too
    helper = added.replace('marker = torch.ones(1, device="cuda")', "marker = _new_helper()")
    helper += "\n\ndef _new_helper():\n    return torch.cuda.current_device()\n"
    with pytest.raises(gradguard.GradGuardError, match=r"in _new_helper: return torch\.cuda\.current_device\(\)"):
        mg.check_schedule_cuda_lines(schedules, helper)
    # and a known line that is gone (the harness would redirect nothing)
    gone = source.replace(mg.REDIRECTED, "total_num_tokens = torch.zeros([], dtype=torch.int)")
    with pytest.raises(gradguard.GradGuardError, match=r"gone: in forward_backward_no_pipelining: total_num_tokens"):
        mg.check_schedule_cuda_lines(schedules, gone)


@pytest.mark.integration
def test_the_redirect_touches_nothing_but_its_line(mg: ModuleType) -> None:
    schedules = sys.modules[SCHEDULES]
    line = mg.check_schedule_cuda_lines(schedules)[(mg.ENTRY, mg.REDIRECTED)]
    mode = mg._CPURedirect(schedules.forward_backward_no_pipelining.__code__, line)
    with mode:
        assert torch.zeros([], dtype=torch.int).device.type == "cpu"
        # the same call from anywhere else is not redirected: it fails as it would without the harness
        # (a CPU-only torch) or is refused (a CUDA torch would otherwise make a CUDA tensor)
        with pytest.raises((AssertionError, RuntimeError, gradguard.GradGuardError)):
            torch.zeros([], dtype=torch.int, device="cuda")
    assert mode.redirected == 0


@pytest.mark.integration
@pytest.mark.skipif(torch.cuda.is_available(), reason="shows where a CPU-only torch fails without each accommodation")
@pytest.mark.parametrize("without", ["redirect", "score buffer", "rng tracker"])
def test_each_cpu_accommodation_is_needed(mg: ModuleType, without: str) -> None:
    """Without any one of the three, megatron-core 0.19.2 stops at a named line, and nothing else does."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    harness = mg.GPTSchedule("cpu", SIZE)
    if without == "redirect":
        harness._redirect = lambda: mg._CPURedirect(None, 0)  # a redirect that matches no call
        where = rf"schedules\.py:{harness.cuda_lines[(mg.ENTRY, mg.REDIRECTED)]} \({mg.ENTRY}\)"
    elif without == "score buffer":
        del parallel_state.get_global_memory_buffer().buffer[("mpu", SIZE.dtype)]
        where = r"megatron/core/utils\.py:\d+ \(get_tensor\)"
    else:
        megatron_random.initialize_rng_tracker(force_reset=True)  # the default, CUDA, tracker
        where = r"megatron/core/tensor_parallel/random\.py:\d+ \(fork\)"
    with pytest.raises(gradguard.GradGuardError, match=where) as excinfo:
        harness.run(2)
    print(f"without the {without}: {excinfo.value}")
    mg.GPTSchedule("cpu", SIZE)  # puts the buffer and the tracker back for the next test


# --------------------------------------------------------------------------------------------------
# CUDA (benchmarks/device/run.sh runs it): the same schedule, no redirect, allocator bytes
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_real_schedule_on_cuda(mg: ModuleType) -> None:
    size = Size(seq=256, batch=2, hidden=256, vocab=512)
    pin, record = mg.pin_bytes(size), mg.record_bytes(size)
    harness = mg.GPTSchedule("cuda", size)
    harness.run(2)
    harness.zero_grad()
    with MemoryProbe("cuda") as probe:
        store = harness.run(N_MICRO, probe.step)
    unguarded, grads = probe.growth_per_step, harness.grads()
    del store
    harness.zero_grad()
    with gradguard.enforce(engines=["megatron"]), MemoryProbe("cuda") as probe:
        store = harness.run(N_MICRO, probe.step)
    guarded = probe.growth_per_step
    print(f"CUDA: analytic pin {pin} B + record {record} B; growth unguarded {unguarded} B, guarded {guarded} B")
    assert abs((unguarded - record) - pin) <= 0.05 * pin
    assert guarded <= record + 0.01 * pin
    assert gradguard.find_graphs(store) == []
    assert all(a is not None and b is not None and torch.equal(a, b) for a, b in zip(grads, harness.grads()))


# --------------------------------------------------------------------------------------------------
# gradguard bench --scenario megatron-gpt
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_bench_scenario_on_cpu(mg: ModuleType, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from gradguard._tools.cli import main

    threads = torch.get_num_threads()
    try:
        argv = ["bench", "--device", "cpu", "--scenario", "megatron-gpt", "--micro-batches", "4", "--no-progress"]
        assert main([*argv, "--json", str(tmp_path / "r.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "megatron-gpt: grads bitwise equal: True ok" in out, out
    result = json.loads((tmp_path / "r.json").read_text())["scenarios"]["megatron-gpt"]
    size = Size()  # the bench's default size
    pin, record = mg.pin_bytes(size), mg.record_bytes(size)
    assert (result["expected_pinned_bytes_per_microbatch"], result["record_bytes_per_microbatch"]) == (pin, record)
    assert result["unguarded"]["growth_bytes_per_microbatch"] == pin + record  # CPU: exact bytes
    assert result["guarded"]["growth_bytes_per_microbatch"] == record
    assert result["grads_equal"] is True


def test_bench_scenario_without_megatron_refuses_in_one_line() -> None:
    """Not an integration test: it hides megatron (installed or not) from a fresh interpreter."""
    code = (
        "import sys; sys.modules['megatron'] = None\n"
        "from gradguard._tools.cli import main\n"
        "raise SystemExit(main(['bench', '--device', 'cpu', '--scenario', 'megatron-gpt', '--no-progress']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GRADGUARD"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "gradguard bench: --scenario megatron-gpt needs megatron-core: megatron-core does not import "
        "(ModuleNotFoundError: "
    ), line
