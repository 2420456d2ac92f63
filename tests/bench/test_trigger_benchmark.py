"""The memory trigger's study (``benchmarks/trigger.py``) runs and writes its schema, and the committed
results carry their machine line and still back the defaults ``gradguard._watch.trigger`` documents. No timing
is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gradguard._watch.trigger import RESIDENT_FLOOR, TriggerSettings

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def test_quick_run(tmp_path: Path) -> None:
    out, md, noise = tmp_path / "t.json", tmp_path / "t.md", tmp_path / "noise.json"
    command = [sys.executable, "-m", "benchmarks.trigger", "--quick", "--scenario", "lora-checkpoint"]
    command += ["--json", str(out), "--md", str(md), "--noise", str(noise)]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["machine_line"] in md.read_text()
    (row,) = doc["scenarios"]
    assert row["scenario"] == "lora-checkpoint" and row["mallinfo2"]["floor"] == TriggerSettings().floor
    assert row["mallinfo2"]["leak_first_request"] in (13, 14)  # the leak starts at step 12
    assert row["cost"]["clean"]["free_chunks_median"] > 0
    assert len(json.loads(noise.read_text())["scenarios"]["lora-checkpoint"]["mallinfo2"]["deltas"]) == 23


def test_the_committed_results_back_the_documented_defaults() -> None:
    doc = json.loads((RESULTS / "trigger-cpu.json").read_text())
    assert doc["machine_line"] and doc["machine_line"] in (RESULTS / "trigger-cpu.md").read_text()
    assert doc["trigger_settings"] == {
        "floor": 256 * 1024,
        "fraction": 1 / 1024,
        "window": 64,
        "boundaries": 2,
        "backoff": 2.0,
    }
    assert {row["scenario"] for row in doc["scenarios"]} == {"pp-last-stage", "lora-checkpoint", "megatron-gpt"}
    start = doc["settings"]["leak_start"]
    for row in doc["scenarios"]:
        glibc, resident = row["mallinfo2"], row["statm"]
        assert glibc["noise"]["over_low_water_max"] * 2.5 <= glibc["floor"]  # "2.5 times" the clean sawtooth
        assert glibc["clean_requests"] == [] and resident["clean_requests"] == []
        assert glibc["leak_first_request"] == start + 1
        assert glibc["leak_reported"] == start + 3  # the audit it asks for stamps the leak: judged two later
        assert resident["floor"] == RESIDENT_FLOOR and resident["noise"]["over_low_water_max"] < RESIDENT_FLOOR / 1.5
