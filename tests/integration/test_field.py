"""Two leaks that shipped (torchmetrics 0.7.2, transformers 3.1.0) and their fixed releases, run by ``gradguard run``.

The CI subset of the field benchmark (``benchmarks/field``): the same drivers, each release unpacked
with ``pip install --no-deps --target`` into a folder of ``$GRADGUARD_FIELD_SITE`` (``.ci/run`` makes
them) and put first on the driver's ``PYTHONPATH``, over this environment's own torchmetrics and
transformers. What fails here: a change that stops finding either leak or names another holder, and
one that cries wolf on either fix, each with every boundary audited (``--audit-every 1``) and with
the defaults (no flag but the mode).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from benchmarks.field.cases import Case, by_key
from benchmarks.field.runner import Run, run_way

pytestmark = pytest.mark.integration

SITE = "GRADGUARD_FIELD_SITE"
STEPS = 8  # enough boundaries for a graph to outlive two of them; each run stays in seconds
TIMEOUT_S = 420.0  # a loaded 2-core machine under xdist: a run takes 5-30 s, the limit is for a hang only
LEAKS = ["torchmetrics", "transformers-trainer"]


def _release_folder(case: Case, leaky: bool) -> Path:
    release = case.leaky if leaky else case.fixed
    root = os.environ.get(SITE)
    reason = f"set {SITE} to a folder holding {release.name}/ (pip install --no-deps --target; see .ci/run)"
    if root and (Path(root) / release.name).is_dir():
        return Path(root) / release.name
    if os.environ.get("GRADGUARD_REQUIRE_ENGINES") == "1":
        pytest.fail(f"GRADGUARD_REQUIRE_ENGINES=1: {reason}")
    pytest.skip(reason)


def _run(case: Case, leaky: bool, tmp_path: Path, audit_every: str | None) -> Run:
    folder = _release_folder(case, leaky)
    return run_way(
        Path(sys.executable), case, "raise", tmp_path, steps=STEPS, timeout=TIMEOUT_S, audit_every=audit_every,
        pythonpath=[folder],
    )  # fmt: skip


def _said(run: Run) -> str:
    return f"exit {run.returncode}; stderr ends:\n{run.stderr_tail}"


def _holders(run: Run) -> list[str]:
    return [h["holder"] for report in run.reports for h in report.get("holders", [])]


@pytest.mark.parametrize("audit_every", ["1", None], ids=["every-boundary", "defaults"])
@pytest.mark.parametrize("key", LEAKS)
def test_the_leaky_release_is_reported_with_its_holder(key: str, audit_every: str | None, tmp_path: Path) -> None:
    case = by_key(key)
    run = _run(case, True, tmp_path, audit_every=audit_every)
    assert not run.timed_out, _said(run)
    assert run.returncode == 1, _said(run)
    holders = _holders(run)
    assert holders and case.expect in holders[0], f"holders {holders}; {_said(run)}"
    assert run.error is not None and case.expect in run.error, _said(run)
    # a graph kept from the first step outlives a boundary by the second or third
    found_at = [h["found_at"] for report in run.reports for h in report.get("holders", [])]
    assert 2 <= found_at[0] <= 3, f"found at boundary {found_at[0]}; {_said(run)}"
    assert run.steps is not None and run.steps <= found_at[0] < STEPS, _said(run)  # raise stopped the run there


@pytest.mark.parametrize("audit_every", ["1", None], ids=["every-boundary", "defaults"])
@pytest.mark.parametrize("key", LEAKS)
def test_the_fixed_release_is_silent(key: str, audit_every: str | None, tmp_path: Path) -> None:
    case = by_key(key)
    run = _run(case, False, tmp_path, audit_every=audit_every)
    assert not run.timed_out, _said(run)
    assert run.returncode == 0, _said(run)
    assert run.steps == STEPS, _said(run)
    assert _holders(run) == [] and run.error is None and run.warnings == [], _said(run)
    assert run.reports, _said(run)  # the process was reached and reported
    if audit_every == "1":
        assert sum(r["figures"]["audits"] for r in run.reports) >= 1, _said(run)  # silent because clean, not unchecked
