"""What a user reads fits a terminal of 100 columns: the warning, the error, the summary and the audit's
table of a real leak, each line within 100 columns but for one that holds only a holder's long path, and
the fix on lines of its own under the holder."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import env
from _tables import last_fix, table_rows, too_wide
from torch import nn

import gradguard

ROOT = Path(__file__).resolve().parents[2]
TRAIN = (ROOT / "README.md").read_text().split("<!-- file: train.py -->\n```python\n", 1)[1].split("```", 1)[0]
"""The README's leaking ``train.py``, as the README shows it."""
FIX = (
    "detach before storing into losses[0] (in __main__): t.detach() or t.item(); "
    "or losses = gradguard.guard([]), which detaches what is stored, or refuses it in raise mode"
)


def _run(tmp_path: Path, mode: str) -> str:
    (tmp_path / "train.py").write_text(TRAIN)
    run = subprocess.run(
        [sys.executable, "-m", "gradguard", "run", "--mode", mode, "train.py"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
        env=env(GRADGUARD_AUDIT=None, TMPDIR=str(tmp_path), COLUMNS=None),
    )  # fmt: skip
    assert run.returncode == (1 if mode == "raise" else 0), run.stderr
    # the first line is the run folder's path (the machine's, not gradguard's to fit)
    return run.stderr.split("\n", 1)[1]


@pytest.mark.parametrize("mode", ["warn", "raise"])
def test_the_readmes_leaking_train_py_reads_in_a_100_column_terminal(tmp_path: Path, mode: str) -> None:
    err = _run(tmp_path, mode)
    said = err[err.index("GraphRetention") :]
    assert too_wide(said, ("__main__:losses[*]",)) == [], said
    assert last_fix(said[: said.index("gradguard stats")]) == FIX  # the warning's or the error's fix
    (row,) = table_rows(said)
    assert row[0] == "__main__:losses[*]" and row[-2] == ("warned" if mode == "warn" else "raised")
    assert row[-1] == FIX  # the summary's: on its own lines under the row
    assert "is the net" not in err and "stamped" not in err and "start-up" not in err


class _Engine:
    """The seed's shape: each micro-batch's output published into ``output_lst``, cleared before the step."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.output_lst: list[dict[str, Any]] = []

    def run(self, batches: list[torch.Tensor]) -> None:
        for x in batches:
            logp = torch.log_softmax(self.model(x), -1)
            (-logp.mean()).backward()
            self.output_lst.append({"model_output": {"log_probs": logp}})
        self.output_lst.clear()


ENGINE: list[_Engine] = []  # a module global: the holder's path is long


def _mine(entry: gradguard.Retention) -> bool:
    return "ENGINE" not in entry.path


def test_a_long_holders_path_stands_alone_and_every_other_line_fits() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ENGINE[:] = [_Engine(model)]
    try:
        with warnings.catch_warnings(record=True) as caught, gradguard.watch(mode="warn", ignore=_mine) as scope:
            warnings.simplefilter("always")
            for _ in range(2):
                ENGINE[0].run([torch.randn(4, 8) for _ in range(6)])
                opt.step()
                opt.zero_grad()
        with pytest.raises(gradguard.GraphRetentionError) as raised, gradguard.watch(mode="raise", ignore=_mine):
            ENGINE[0].run([torch.randn(4, 8) for _ in range(6)])
    finally:
        ENGINE.clear()
    path = f"{__name__}:ENGINE[*].output_lst[*]['model_output']['log_probs']"
    (warning,) = [str(w.message) for w in caught if issubclass(w.category, gradguard.GraphRetentionWarning)]
    summary = scope.watcher.summary()
    for text in (warning, summary, str(raised.value)):
        assert too_wide(text, (path, f"{path}:")) == [], text
        assert last_fix(text).startswith("detach before storing into ENGINE[0].output_lst[0]['model_output']")
    assert warning.splitlines()[:2] == [
        f"gradguard: {path}",
        "  keeps an autograd graph across the micro-batches of one step",
    ]
    (row,) = table_rows(summary)
    assert row[0] == path and row[-1].startswith("detach before storing into ENGINE[0].output_lst[0]")
    assert path in summary.splitlines()  # too long for its column beside the others: a line of its own


def test_the_audits_table_puts_each_fix_under_its_row() -> None:
    model = nn.Linear(8, 1)
    ENGINE[:] = [_Engine(model)]
    try:
        ENGINE[0].output_lst.append({"model_output": {"log_probs": model(torch.randn(4, 8))}})
        report = str(gradguard.audit(ignore=_mine))
    finally:
        ENGINE.clear()
    path = f"{__name__}:ENGINE[0].output_lst[0]['model_output']['log_probs']"
    assert too_wide(report, (path,)) == [], report
    (row,) = table_rows(report)
    assert row[0] == path and row[-1].startswith("detach before storing into ENGINE[0].output_lst[0]")
