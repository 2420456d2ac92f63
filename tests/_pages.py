"""Run folders for the page's tests (``tests/tools/test_page.py``, ``tests/tools/test_page_browser.py``):
a synthetic two-rank run whose rank 1 leaks, written as processes write their reports, and real
``gradguard run`` runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from _helpers import env
from _reports import holder, process

from gradguard._launch import _names, _report
from gradguard._watch.timeline import Timeline

__all__ = ["LEAKY", "CLEAN", "gradguard", "two_ranks"]

LEAKY = """\
import torch

model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for step in range(6):
    for micro in range(2):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss)  # keeps every step's graph
"""
CLEAN = LEAKY.replace("losses.append(loss)", "losses.append(loss.item())")


def _timeline(leaks: bool) -> dict[str, Any]:
    timeline = Timeline(most=256)
    for i in range(400):
        memory = 10_000_000 + (i * 20_000 if leaks else 0) + (i % 4) * 30_000
        timeline.point("micro", i // 4, i, memory, 50, i * 0.01)
        if i % 4 == 3:
            timeline.point("step", i // 4 + 1, i + 1, memory - 3 * 30_000, 50, i * 0.01 + 0.005)
    if leaks:
        timeline.event("leak-start", "__main__:losses[*]", 1, 4, 0.04, bytes=64)
        timeline.event("report", "__main__:losses[*]", 3, 12, 0.12, bytes=64, text="warned")
    return timeline.to_dict()


def two_ranks(folder: Path, corrupt: bool = False) -> Path:
    """A run folder of run ``r1``: ranks 0 and 1 of 2, rank 1 keeping ``__main__:losses[*]`` (and, with
    ``corrupt``, a third report cut short)."""
    folder.mkdir(parents=True, exist_ok=True)
    for r in (0, 1):
        leaks = r == 1
        holders = (
            [holder(64, outcome="warned", path="__main__:losses[*]", holder="__main__:losses[*]")] if leaks else []
        )
        report = {
            **process(pid=200 + r, rank=r, world_size=2, rank_from="RANK", label=f"rank {r}/2", boundaries=100,
                      audits=5, holders=holders, mode="warn"),
            "timeline": _timeline(leaks),
            "platform": {"python": "3.11.2", "torch": "2.13.0", "gradguard": "0.1.0", "machine": "Linux, 2 CPUs"},
        }  # fmt: skip
        _report.write(str(folder / _names.file_name("r1", "node-1", 200 + r)), report)
    if corrupt:
        (folder / "report-r1-node-1-999-00.json").write_text('{"format": "gradguard-run-report", "vers')
    return folder


def gradguard(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m gradguard ARGV`` in ``cwd``, its own process watch unset."""
    return subprocess.run(
        [sys.executable, "-m", "gradguard", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env(GRADGUARD_AUDIT=None, TMPDIR=str(cwd), PYTHONPATH=os.environ.get("PYTHONPATH")),
        timeout=300,
    )
