"""Smoke tests: every example in ``examples/`` runs, shows the leak, and shows the guard removing it.

Each example runs in a fresh interpreter (as a user would run it) with ``GRADGUARD`` unset. Examples
that need an engine are integration tests: a missing engine skips locally and fails in CI
(``GRADGUARD_REQUIRE_ENGINES=1``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import require_engine

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT_S = 300  # each takes seconds; a loaded CI runner gets plenty of slack


def run_example(name: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GRADGUARD"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=EXAMPLES.parent,
        env=env,
    )
    assert proc.returncode == 0, (
        f"{name} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc.stdout


def section(out: str, start: str, end: str | None = None) -> str:
    """The part of ``out`` from the line starting with ``start`` up to the one starting with ``end``."""
    begin = out.index("\n" + start) if not out.startswith(start) else 0
    stop = out.index("\n" + end, begin + 1) if end else len(out)
    return out[begin:stop]


def test_classic_loop() -> None:
    out = run_example("classic_loop.py")
    assert re.search(r"^unguarded: 8/8 micro-batch leaves still alive, graphs pin [1-9][\d.]* MiB", out, re.M), out
    assert "guarded  : 0/8 micro-batch leaves still alive, graphs pin 0.00 MiB" in out, out
    assert re.search(r"^losses\s+\S+classic_loop\.py:\d+\s+8\s+8\s", out, re.M), out  # the stats row


def test_verl_style_engine() -> None:
    out = run_example("verl_style_engine.py")
    plain = section(out, "plain forward_step:", "@gradguard.forward_step:")
    guarded = section(out, "@gradguard.forward_step:", "losses equal")
    assert re.search(r"output_lst: [1-9]\d* tensors carry a graph .*\['model_output'\]\['log_probs'\]", plain), out
    assert re.search(r"gradguard.pinned_bytes\): [1-9]\d* bytes", plain), out
    assert "embedding-output leaves still alive: 8/8" in plain, out
    assert "output_lst: 0 tensors carry a graph" in guarded, out
    assert "gradguard.pinned_bytes): 0 bytes" in guarded, out
    assert "embedding-output leaves still alive: 0/8" in guarded, out
    assert "losses equal: True; parameter grads bitwise equal (torch.equal): True" in out, out
    assert "lm_head gets no gradient: True" in out, out
    assert re.search(
        r"raised LossContractError:\n .*reaches none of these trainable parameters: lm_head\.weight, lm_head\.bias", out
    ), out
    assert "OK: the guard released every graph" in out, out


@pytest.mark.integration
def test_pipelining_two_ranks() -> None:
    require_engine("torch.distributed.pipelining")
    out = run_example("pipelining_two_ranks.py")
    assert re.search(r"^without gradguard: [1-9]\d* tensors still carry a graph", out, re.M), out
    assert 'inside gradguard.enforce(engines=["pipelining"]): 0 tensors still carry a graph' in out, out
    guarded = section(out, "inside gradguard.enforce(")
    assert "graph-held memory (gradguard.pinned_bytes): 0 bytes" in guarded, out
    assert "rank 0: parameter grads bitwise equal (torch.equal): True" in out, out
    assert "rank 1: parameter grads bitwise equal (torch.equal): True" in out, out
    assert "OK: the guard released every graph and changed no gradient" in out, out


@pytest.mark.integration
def test_megatron_forward_step() -> None:
    require_engine("megatron.core.pipeline_parallel.schedules")
    out = run_example("megatron_forward_step.py")
    plain = section(out, "without gradguard:", "inside gradguard.enforce():")
    guarded = section(out, "inside gradguard.enforce():", "what the guard did")
    assert re.search(r"forward_data_store: 16 tensors carry a graph .*'logits_sq'", plain), out
    assert "(gradguard.pinned_bytes): 6291456 bytes" in plain, out  # 8 x (buffer + grad + saved output)
    assert "receive buffers still alive: 8/8" in plain, out
    assert "forward_data_store: 0 tensors carry a graph" in guarded, out
    assert "(gradguard.pinned_bytes): 0 bytes" in guarded, out
    assert "receive buffers still alive: 0/8" in guarded, out
    assert re.search(r"megatron\.forward_data_store\s+\S+schedules\.py:\d+\s+8\s+16\s", out), out  # the stats row
    assert "reports equal with and without the guard: True" in out, out
    assert "parameter grads bitwise equal (torch.equal): True" in out, out
    assert "OK: the guard released every graph" in out, out


@pytest.mark.integration
def test_peft_lora() -> None:
    require_engine("transformers")
    require_engine("peft")
    out = run_example("peft_lora.py")
    plain = section(out, "plain forward_step:", "@gradguard.forward_step:")
    guarded = section(out, "@gradguard.forward_step:", "analytic:")
    growth = {
        name: float(re.search(r"MemoryProbe\): ([-\d,]+) bytes", part).group(1).replace(",", ""))
        for name, part in (("plain", plain), ("guarded", guarded))
    }
    leaf_and_grad = 2 * 4 * 128 * 64 * 4  # batch x seq x hidden fp32, and its .grad
    assert growth["plain"] - growth["guarded"] >= leaf_and_grad, out
    assert growth["guarded"] <= 2 * 4 * 128 * 4 * 1.5, out  # only the detached log_probs + entropy remain
    assert "embedding-output leaves still alive: 8/8" in plain, out
    assert "output_lst: 0 tensors carry a graph; gradguard.pinned_bytes: 0 bytes" in guarded, out
    assert "embedding-output leaves still alive: 0/8" in guarded, out
    assert "LoRA grads bitwise equal (torch.equal): True" in out, out
    assert "OK: the guard stopped the per-micro-batch growth" in out, out


@pytest.mark.integration
def test_megatron_gpt_schedule() -> None:
    require_engine("megatron.core.pipeline_parallel.schedules")
    out = run_example("megatron_gpt_schedule.py")
    plain = section(out, "without gradguard:", "inside gradguard.enforce()")
    guarded = section(out, "inside gradguard.enforce()", "what the guard did")
    pin, record = 2 * 64 * 2 * 128 * 4, 2 * 2 * 64 * 4  # receive buffer + .grad; log_probs + entropy
    assert f"the receive buffer [64, 2, 128] float32 and its .grad = {pin:,} B" in out, out
    assert "forward_data_store: 32 tensors carry a graph ['entropy'] ['log_probs']" in plain, out
    assert f"(MemoryProbe): {pin + record:,} B = {pin:,} pinned + {record:,} record" in plain, out
    assert f"(gradguard.pinned_bytes): {16 * pin:,} bytes" in plain, out
    assert "receive buffers still alive: 16/16" in plain, out
    assert "forward_data_store: 0 tensors carry a graph" in guarded, out
    assert f"(MemoryProbe): {record:,} B = 0 pinned + {record:,} record" in guarded, out
    assert "(gradguard.pinned_bytes): 0 bytes" in guarded, out
    assert "receive buffers still alive: 0/16" in guarded, out
    assert re.search(r"megatron\.forward_data_store\s+\S+schedules\.py:\d+\s+16\s+32\s", out), out  # the stats row
    assert 'device="cuda")` to the CPU, 3 time(s) (once per schedule call), nothing else' in out, out
    assert "losses equal: True; records equal: True; parameter grads bitwise equal (torch.equal): True" in out, out
    assert "OK: the guard released every graph and changed no gradient" in out, out


def test_find_leaks() -> None:
    out = run_example("find_leaks.py")
    plain = section(out, "without the watch:", "under gradguard.watch(")
    watched = section(out, "under gradguard.watch(")
    growth = {
        name: float(re.search(r"growth ([-+\d,]+) bytes per step", part).group(1).replace(",", ""))
        for name, part in (("plain", plain), ("watched", watched))
    }
    leaf, scores = 2 * 8 * 64 * 64 * 4, 8 * 4 * 64 * 64 * 4  # the embedding-output leaf + .grad; attention scores
    assert leaf + scores <= growth["plain"] < leaf + scores + 256, out  # the scalars kept add a few bytes
    assert abs(growth["watched"]) < (leaf + scores) / 8, out
    assert "gradguard.audit: 3 holder(s)" in plain, out
    nodes = r"\d+ \((?:~[\d.]+ \S*B|shared)\)"  # the graph's nodes and what they take
    assert re.search(
        rf"in main: leaky\.model\.attn\.current_max_attn_logits\s+1\s+4\.5 MiB\s+{nodes}\s+no\s+MaximumBackward0", plain
    ), out
    assert re.search(
        rf"^__main__:HISTORY\[\*\]\['loss'\]\s+6\s+\S+ B\s+{nodes}\s+no\s+NllLossBackward0", plain, re.M
    ), out
    assert re.search(rf"in main: leaky\.metrics\['loss_sum'\]\s+1\s+\S+ B\s+{nodes}\s+no\s+AddBackward0", plain), out
    assert "3 holders kept autograd graphs across step boundaries" in watched, out
    for holder in (
        r"self\.model\.attn\.current_max_attn_logits",
        r"__main__:HISTORY\[\*\]\['loss'\]",  # a list at the script's top level: a variable's grace, then 2 at once
        r"self\.metrics\['loss_sum'\]",
    ):
        assert re.search(holder + rf"\s+\d+\s+\S+ \S*B\s+{nodes}\s+\d+\s+repaired\s", watched), (holder, out)
    assert "parameters bitwise equal with and without the watch (torch.equal): True" in out, out
