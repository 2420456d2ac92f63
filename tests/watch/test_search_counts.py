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


METRIC = """
import torch

class Metric:
    def __init__(self):
        self.total = torch.zeros(())

    def update(self, value):
        self.total = self.total + value  # the bug: its graph is kept, step after step
"""


def test_a_holder_found_keeping_a_graph_for_one_boundary_is_judged_again_without_a_second_search() -> None:
    """The start-up check finds the metric keeping the first step's graph for one boundary (bounded so far);
    at the next boundary it keeps it for two: that holder is read again by name, and no second search of
    the heap runs to report it."""
    import gc
    import warnings

    import torch

    import gradguard

    space: dict[str, object] = {"__name__": "search_counts_metric"}
    exec(compile(METRIC, "search_counts_metric.py", "exec"), space)
    sys.modules["search_counts_metric"] = module = type(sys)("search_counts_metric")
    vars(module).update(space)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        module.metric = space["Metric"]()  # type: ignore[attr-defined,operator]
        gc.collect()
        with warnings.catch_warnings(record=True), gradguard.watch(mode="warn") as scope:
            warnings.simplefilter("always")
            for _ in range(6):
                loss = model(torch.randn(4, 8)).pow(2).mean()
                loss.backward()
                module.metric.update(loss)  # type: ignore[attr-defined]
                opt.step()
                opt.zero_grad()
        [entry] = scope.watcher.history()
        assert entry.holder == "search_counts_metric:metric.total" and entry.survived >= 2
        assert entry.found_at == 3  # found leaking at the third boundary (listed as bounded at the second)
        # the start-up check's, and no other of the step clock's; the micro-batch clock's first two (the running
        # sum keeps each backward's graph across the next: not a store, nothing to follow)
        micro = scope.watcher.figures().micro_searches
        assert scope.watcher.searches - micro == 1 and micro <= 2, scope.watcher.summary()
    finally:
        sys.modules.pop("search_counts_metric", None)
