"""``benchmarks/lightning_suite``: the runner and its recorder plugin, on a stand-in checkout laid out
like Lightning's (``tests/tests_pytorch/...`` under a root with a pytest configuration), one of whose
tests keeps its losses in a module-level list. No Lightning needed, no timing asserted; the committed
results carry their machine line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

TRAIN = """
import torch

_losses = []


def train(keep):
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    for _ in range(3):
        loss = (w * 2).sum()
        loss.backward()
        keep(loss)
        opt.step()
        opt.zero_grad()


def test_clean():
    train(lambda loss: None)


def test_keeps_losses():
    train(_losses.append)
"""


def _checkout(tmp_path: Path) -> Path:
    root = tmp_path / "lightning"
    tests = root / "tests" / "tests_pytorch"
    for sub in ("loops", "trainer/optimization", "core"):
        (tests / sub).mkdir(parents=True)
    (root / "pyproject.toml").write_text("[tool.pytest.ini_options]\naddopts = ['--disable-pytest-warnings']\n")
    (root / "LIGHTNING_REF").write_text("a stand-in\n")
    (tests / "loops" / "test_train.py").write_text(TRAIN)
    (tests / "trainer" / "optimization" / "test_one.py").write_text("def test_one():\n    pass\n")
    (tests / "core" / "test_lightning_optimizer.py").write_text("def test_two():\n    pass\n")
    return root


def _run(tmp_path: Path, checkout: Path, *args: str) -> dict:
    out, md = tmp_path / "suite.json", tmp_path / "suite.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.lightning_suite", str(checkout), *args, "--json", str(out), "--md", str(md)]
        + ["--logs", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["machine_line"] in md.read_text()
    return doc


def _logs(tmp_path: Path) -> str:
    """The inner pytest runs' output, for a failure's message."""
    return "\n".join(
        f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
        for log in sorted((tmp_path / "logs").glob("*.log"))
    )


def test_runs_plain_and_watched_names_the_retention_and_its_test_and_samples(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path)
    doc = _run(tmp_path, checkout, "--runs", "plain,every-step")
    assert doc["baseline_green"] and doc["lightning"]["tests_ref"] == "a stand-in"
    plain, watched = doc["runs"]["plain"], doc["runs"]["every-step"]
    assert plain["selected"] == watched["selected"] == 4 and plain["outcomes"] == {"passed": 4}, _logs(tmp_path)
    assert plain["retentions"] == [] and plain["modules"]["gradguard"] is None  # a plain run never imports it
    assert watched["options"] == ["--gradguard-audit=1", "--gradguard=warn"]
    assert watched["outcomes"] == {"passed": 4} and watched["ratio_to_plain"] > 0, _logs(tmp_path)
    assert watched["modules"]["gradguard"] == "gradguard/__init__.py"  # named from the repository, not the machine
    (retention,) = watched["retentions"]
    assert "_losses" in retention["holder"] and retention["warnings"] == 1
    assert retention["tests"] == ["tests/tests_pytorch/loops/test_train.py::test_keeps_losses"]

    # A configuration of one's own, on every 2nd test, paired with plain on the same sample; --merge
    # keeps the runs above.
    args = ["--runs", "strict", "--option", "strict=--gradguard-audit=1 --gradguard=raise"]
    doc = _run(tmp_path, checkout, *args, "--sample-every", "2", "--sampled", "strict", "--merge")
    assert list(doc["runs"]) == ["plain", "plain@1/2", "every-step", "strict"]
    sample, strict = doc["runs"]["plain@1/2"], doc["runs"]["strict"]
    assert sample["selected"] == strict["selected"] == 2 and strict["keep_every"] == 2, _logs(tmp_path)
    assert strict["estimated_full_wall_s"] > 0 and doc["runs"]["every-step"] == watched


def test_committed_results_carry_their_machine_line() -> None:
    doc = json.loads((RESULTS / "lightning-suite-cpu.json").read_text())
    assert doc["machine_line"] and doc["machine_line"] in (RESULTS / "lightning-suite-cpu.md").read_text()
    assert doc["baseline_green"] and doc["runs"]["plain"]["selected"] > 300
