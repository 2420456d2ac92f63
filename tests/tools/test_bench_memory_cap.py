"""``gradguard bench``'s memory cap: a run whose reading passes it stops there, and says so.

On a GPU the cap (default: 85% of the device) keeps an unguarded run from filling the device; it is
device-agnostic, so it is checked here on CPU, with a cap placed between two readings.
"""

from __future__ import annotations

import pytest
import torch

from gradguard._tools.bench.report import table, verdicts
from gradguard._tools.bench.runner import run_scenario
from gradguard._tools.bench.scenarios import Size
from gradguard._tools.cli import main

CPU = torch.device("cpu")
TINY = Size(seq=8, batch=1, hidden=16, vocab=32)


def test_a_run_past_the_cap_stops_and_is_reported() -> None:
    free = run_scenario("pp-last-stage", CPU, TINY, 8)
    unguarded = free["unguarded"]["allocated_bytes"]
    cap = unguarded[2]  # passed by the 4th reading of the unguarded run
    assert max(free["guarded"]["allocated_bytes"]) <= cap  # the guarded run stays under it

    result = run_scenario("pp-last-stage", CPU, TINY, 8, memory_cap=cap)
    u, g = result["unguarded"], result["guarded"]
    assert (u["stopped_at_microbatch"], u["memory_cap_bytes"]) == (4, cap)
    assert u["allocated_bytes"] == unguarded[:4] and u["micro_batches"] == 8
    assert "stopped_at_microbatch" not in g and len(g["allocated_bytes"]) == 8
    assert result["grads_equal"] is None  # the unguarded run did half the work: nothing to compare
    checks = {check: (ok, detail) for check, ok, detail in verdicts(result)}
    assert checks["grads bitwise equal"] == (False, "not compared: a run stopped at the memory cap")
    text = table({"scenarios": {"pp-last-stage": result}})
    assert f"pp-last-stage: unguarded run stopped after micro-batch 4: allocated {unguarded[3] / 2**30:.2f} GiB" in text
    assert "pp-last-stage: grads bitwise equal: not compared: a run stopped at the memory cap FAIL" in text


@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_cap_that_is_not_positive_refuses(capsys: pytest.CaptureFixture[str], value: str) -> None:
    assert main(["bench", "--device", "cpu", "--memory-cap", value, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (
        f"gradguard bench: --memory-cap={value!r} is not accepted; accepted: a positive number of GiB"
    )
