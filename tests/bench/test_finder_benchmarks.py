"""The audit and watch benchmarks (``benchmarks/audit``, ``benchmarks/watch``) run and write their
schema; the committed results carry their machine line. No timing is asserted here: the benchmarks
measure, docs/benchmarks.md and ``benchmarks/results/`` report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _run(tmp_path: Path, module: str, *args: str) -> tuple[dict, str]:
    out = tmp_path / f"{module}.json"
    md = tmp_path / f"{module}.md"
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--quick", *args, "--json", str(out), "--md", str(md)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text()), md.read_text()


def test_audit_benchmark_quick_run(tmp_path: Path) -> None:
    doc, md = _run(tmp_path, "audit")
    assert doc["machine_line"] in md
    kinds = [case["case"] for case in doc["cases"]]
    assert kinds.count("clean") >= 1 and "leak" in kinds
    for case in doc["cases"]:
        assert case["candidate_s"]["median"] > 0 and case["live_objects"] > 0
    leak = next(case for case in doc["cases"] if case["case"] == "leak")
    # loss, logits and the saved ReLU output per record (the saved weight.t() views are the parameter's)
    assert leak["graph_tensors"] == 300 and leak["entries"] == 2 and leak["heap_passes"] >= 1
    assert "LEAKED[*]['loss']" in leak["report"]


def test_watch_benchmark_quick_run(tmp_path: Path) -> None:
    doc, md = _run(tmp_path, "watch", "--scenario", "pp-last-stage")
    assert doc["machine_line"] in md
    cases = {entry["case"]: entry for entry in doc["cases"]}
    storms = {f"storm/{name}" for name in ("kept-exception", "cycles", "gc-off", "grad-fn-kept")}
    assert set(cases) == {
        "late/pp-last-stage",
        "late/pp-last-stage clean",
        "fast/eval-forward",
        "growth-then-leak",
        "thread-backward",
        "frame-local",
        "short-6",
        "short-30",
        "micro/seed",
        "fast/clean",
        "sawtooth",
        "cost/clean-0.5ms",
        "cost/clean-4mb",
        "cost/clean-64mb",
        *storms,
        "library-leak/30",
        "library-leak/60",
    }
    leaks = ("late/pp-last-stage", "fast/eval-forward", "thread-backward", "frame-local", "short-6", "short-30")
    for name in leaks:  # each leak is reported
        watched = cases[name]["watched"]
        assert watched["reported_at"] is not None and watched["holders"], name
    for name in ("fast/clean", "sawtooth", "late/pp-last-stage clean"):  # the clean runs are silent
        watched = cases[name]["watched"]
        assert watched["holders"] == [] and watched["audits"] >= 1, name
        assert len(watched["memory"]) == watched["steps"] == len(cases[name]["unwatched"]["memory"])
        assert watched["stamp_us"] > 0 and watched["boundary_us"] > 0 and watched["backwards"] >= watched["steps"]
        assert watched["read_us"] >= 0 and watched["boundary_us"] * watched["boundaries"] <= 1e6 * watched["signals_s"]
    for name, entry in cases.items():
        if entry["kind"] not in ("cost", "library leak"):
            continue
        assert entry["pairs"] and entry["cpu"] > 0 and entry["wall"] > 0 and entry["step_ms"] > 0, name
        for pair in entry["pairs"]:  # each pair: the same steps, unwatched and watched, timed both ways
            plain, watched = pair["unwatched"], pair["watched"]
            assert plain["steps"] == watched["steps"] == entry["steps"], name
            assert plain["cpu_s"] > 0 and watched["wall_s"] > 0 and watched["boundaries"] == entry["steps"], name
            assert watched["summary"].startswith("gradguard watch: "), name
    seed = cases["micro/seed"]  # the seed's shape, per micro-batch: reported in its first step, repaired
    assert seed["unit"] == "micro-batch" and seed["watched"]["micro_batches_a_step"] == seed["watched"]["steps"] == 32
    assert 1 <= seed["watched"]["reported_at"] <= 4
    assert [o for _, o in seed["watched"]["holders"]] == ["repaired"]
    assert "output_lst[*]['model_output']['log_probs']" in seed["watched"]["holders"][0][0]
    assert len(seed["watched"]["memory"]) == len(seed["unwatched"]["memory"]) == 32
    micro = cases["cost/clean-64mb"]  # gradient accumulation: every backward a micro-batch boundary
    assert micro["micro_batches_a_step"] == 64 and micro["micro_ms"] > 0 and micro["micro_ms_range"] == [0.5, 2.0]
    assert all(p["watched"]["backwards"] == 64 * micro["steps"] for p in micro["pairs"])
    for name in ("cost/clean-0.5ms", "cost/clean-4mb", "cost/clean-64mb"):  # clean steps: nothing reported
        assert all(pair["watched"]["holders"] == [] for pair in cases[name]["pairs"]), name
    for name in ("library-leak/30", "library-leak/60"):  # a library's state: reported, never written
        for pair in cases[name]["pairs"]:
            watched = pair["watched"]
            assert watched["reported_at"] is not None, name
            assert [outcome for _, outcome in watched["holders"]] == ["not repairable"], name
            assert watched["holders"][0][0].endswith(".metric.total"), name
    assert cases["library-leak/60"]["shorter"]["steps"] == 30
    assert doc["settings"]["quick"] and "MISSED" not in "".join(  # a quick run judges no ratio
        line for line in md.splitlines() if "watched / unwatched" in line
    )
    assert doc["floor"]["stamp_us"] > 0 and doc["floor"]["signals_us"] > 0  # the floor of the watch's own time
    assert doc["floor"]["token_us"] > 0
    assert "The floor (the fast step, unwatched" in md and "floor (unwatched)" in md


@pytest.mark.parametrize("name", ["audit-cpu", "watch-cpu"])
def test_committed_results_carry_their_machine_line(name: str) -> None:
    doc = json.loads((RESULTS / f"{name}.json").read_text())
    assert doc["machine_line"] and doc["machine_line"] in (RESULTS / f"{name}.md").read_text()
