"""The heap searches are counted in every mode: the audit that found its holder by a search counts that
search in the process's report (``figures.searches``) in ``raise`` mode, where the error stops the
program, as in ``warn`` mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LEAKY = """
import torch
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for step in range(6):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss)
"""


@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_the_search_that_found_the_holder_is_counted_in_the_report(mode: str, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LEAKY)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADGUARD")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    argv = [sys.executable, "-m", "gradguard", "run", "--mode", mode, "--report-dir", "reports", "python", "train.py"]
    run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == (1 if mode == "raise" else 0), run.stderr
    [report] = [json.loads(p.read_text()) for p in (tmp_path / "reports").glob("report-*.json")]
    figures = report["figures"]
    assert report["holders"] and figures["audits"] >= 1
    assert figures["searches"] >= 1, f"{mode}: {figures}"
