"""Committed results name no path of the machine that produced them, and the field benchmark's results
are made so (``benchmarks.field.runner.portable``); the field table carries each leak's remedy and
whether applying it passed ``--mode raise``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.field.runner import REPO, portable

RESULTS = REPO / "benchmarks" / "results"
# an absolute path to a source file, or a file under a site-packages: where this machine keeps it
_MACHINE_PATH = re.compile(r"(?<![\w.+-])/(?:[\w.+-]+/)+[\w.+-]+\.py\b|site-packages/")
_WRITTEN_BEFORE: dict[str, str] = {}


def _results() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.suffix in (".md", ".json"))


@pytest.mark.parametrize("path", _results(), ids=lambda p: p.name)
def test_results_name_no_path_of_the_machine_that_produced_them(path: Path, request: pytest.FixtureRequest) -> None:
    if path.name in _WRITTEN_BEFORE:
        request.applymarker(pytest.mark.xfail(strict=True, reason=_WRITTEN_BEFORE[path.name]))
    found = sorted(set(_MACHINE_PATH.findall(path.read_text(encoding="utf-8"))))
    assert found == []


def test_portable_names_files_from_the_repository_the_package_or_by_name() -> None:
    text = (
        f"{REPO}/benchmarks/field/drivers/run_torchmetrics.py:31 in main; "
        "/work/field-envs/trl-0.8.3/lib/python3.11/site-packages/transformers/trainer.py:1 in train; "
        "/ci/field/torchmetrics-0.7.2/torchmetrics/metric.py:2 in update; "
        "/tmp/gradguard-field-trl-0.8.3-abc/raise-tmp/gradguard-run-x; "
        "/somewhere/else/script.py:3 in main"
    )
    assert portable({"a": [text], "n": 1}, [Path("/ci/field/torchmetrics-0.7.2")]) == {
        "a": [
            "benchmarks/field/drivers/run_torchmetrics.py:31 in main; transformers/trainer.py:1 in train; "
            "torchmetrics/metric.py:2 in update; <scratch>/raise-tmp/gradguard-run-x; script.py:3 in main"
        ],
        "n": 1,
    }


def test_the_field_table_carries_each_leaks_remedy_and_its_check() -> None:
    doc = json.loads((RESULTS / "field-cpu.json").read_text(encoding="utf-8"))
    table = (RESULTS / "field-cpu.md").read_text(encoding="utf-8")
    assert "| remedy | remedy applied |" in table
    for case in doc["cases"]:
        remedy = case["remedy"]
        assert remedy["by"] in ("driver", "upgrade")
        assert case["leaky"]["verdict"]["fix"] or case["leaky"]["verdict"]["holder"].startswith("(refused)")
