"""``benchmarks.versus`` writes commands the committed results can carry: no folder of the machine that ran it."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.field.runner import REPO
from benchmarks.versus import portable

RESULTS = REPO / "benchmarks" / "results"


def test_a_command_names_the_run_s_scratch_the_repository_s_files_and_no_other_folder(tmp_path: Path) -> None:
    scratch = tmp_path / "gradguard-versus-x"
    command = (
        f"python -m benchmarks.watch --json {scratch}/head-0.json --md {REPO}/benchmarks/results/versus-cpu.md "
        "--other /somewhere/else/out.json --only cost/"
    )
    assert portable(command, scratch) == (
        "python -m benchmarks.watch --json <scratch>/head-0.json --md benchmarks/results/versus-cpu.md "
        "--other <scratch>/out.json --only cost/"
    )


def test_the_committed_side_by_side_results_name_no_absolute_path() -> None:
    doc = json.loads((RESULTS / "versus-cpu.json").read_text(encoding="utf-8"))
    commands = [doc["settings"]["command"]] + [
        run["settings"]["command"] for runs in doc["runs"].values() for run in runs
    ]
    assert len(commands) == 1 + 2 * doc["settings"]["rounds"]
    assert [c for c in commands if any(word.startswith("/") for word in c.split())] == []
    table = (RESULTS / "versus-cpu.md").read_text(encoding="utf-8")
    assert portable(doc["settings"]["command"]) in table
