"""Run one release's driver the five ways and read what each run left: verdict, holders, memory, weights.

* ``plain``: ``python driver.py``, memory read after each optimizer step, final weights saved;
* ``raise``: ``gradguard run --mode raise driver.py``, no other flag (the defaults a user gets);
* ``detach``: ``gradguard run --mode detach driver.py``, memory read after each optimizer step;
* ``warn``: ``gradguard run --mode warn driver.py``, final weights saved (compared bitwise with plain's);
* ``every1``: ``gradguard run --mode raise --audit-every 1 driver.py``, a diagnostic beside the
  verdict: what the detector finds when every boundary is audited, apart from the default schedule;
* ``remedy``: ``gradguard run --mode raise driver.py`` with the change gradguard's fix names on the
  user's side applied by the driver (``GRADGUARD_FIELD_REMEDY=1``), final weights saved: a leaky
  release's only, for a case whose remedy is not just upgrading (``Case.remedy``).

``gradguard run`` announces where its reports go (a new folder under the temporary directory): the
runner points ``TMPDIR`` at its own scratch folder, reads that line, and reads the reports there
(the holders the summary prints, the boundary each was found at). Every run gets one torch thread
(``OMP_NUM_THREADS=1``), no ``GRADGUARD*`` variable from the caller, and Hugging Face's hub offline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .cases import Case, Release

__all__ = ["DRIVERS", "Run", "growth_per_step", "portable", "run_release", "run_way"]

DRIVERS = Path(__file__).resolve().parent / "drivers"
WAYS = ("plain", "raise", "detach", "warn", "every1", "remedy")
LEAKY_WAYS = WAYS
FIXED_WAYS = WAYS[:-1]
_ANNOUNCED = re.compile(r"gradguard run: each process's report goes to (\S+)")
_RANK = r"(?:\[rank\d+\]: )?"  # torch.distributed prefixes a rank's uncaught traceback with this
_ERROR = re.compile(rf"^{_RANK}gradguard\.GraphRetentionError: (.*(?:\n{_RANK}  .*)*)", re.MULTILINE)
_RANK_PREFIX = re.compile(rf"^{_RANK}", re.MULTILINE)
_WARNING = re.compile(r"GraphRetentionWarning: (.*)$", re.MULTILINE)
_TAIL = 4000  # characters of each run's stderr kept in the results
_SITE_PACKAGES = re.compile(r"\S*/site-packages/")
_SCRATCH = re.compile(r"\S*/gradguard-field-[^/\s]+/")
_SOURCE_DIR = re.compile(r"(?<![\w.+-])/(?:[\w.+-]+/)+(?=[\w.+-]+\.py\b)")
REPO = Path(__file__).resolve().parents[2]


def portable(value: Any, roots: Sequence[Path] = ()) -> Any:
    """``value`` (a string, or lists and dicts of them) with no path of this machine in it: a file in the
    repository named from its root (``benchmarks/field/drivers/run_torchmetrics.py``), one under a
    ``site-packages`` or under one of ``roots`` (a release's folder, gradguard's snapshot) from there
    (``transformers/trainer.py``), a run's scratch folder as ``<scratch>/``, any other source file by its
    name."""
    if isinstance(value, dict):
        return {k: portable(v, roots) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, roots) for v in value]
    if not isinstance(value, str):
        return value
    for root in sorted({str(REPO), *map(str, roots)}, key=len, reverse=True):
        value = value.replace(root.rstrip("/") + "/", "")
    value = _SCRATCH.sub("<scratch>/", value)
    return _SOURCE_DIR.sub("", _SITE_PACKAGES.sub("", value))


@dataclasses.dataclass
class Run:
    """What one run of a driver left."""

    way: str
    command: list[str]
    returncode: int | None
    seconds: float
    stderr_tail: str
    steps: int | None = None
    memory: list[int] = dataclasses.field(default_factory=list)
    weights: dict[str, torch.Tensor] | None = None
    reports: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    error: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)
    timed_out: bool = False


def driver_path(case: Case) -> Path:
    return DRIVERS / f"run_{case.key.replace('-', '_')}.py"


def _environ(
    scratch: Path, out: Path, memory: bool, steps: int | None, pythonpath: list[Path], remedy: bool = False
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADGUARD")}
    env.update(
        TMPDIR=str(scratch), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled",
        GRADGUARD_FIELD_OUT=str(out), GRADGUARD_FIELD_MEMORY="1" if memory else "0",
        GRADGUARD_FIELD_REMEDY="1" if remedy else "0",
    )  # fmt: skip
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    if steps is not None:
        env["GRADGUARD_FIELD_STEPS"] = str(steps)
    return env


def _reports(folder: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(folder.glob("report-*.json")):
        try:
            found.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return found


def run_way(
    python: Path, case: Case, way: str, scratch: Path, *, steps: int | None = None, timeout: float = 600.0,
    audit_every: str | None = None, pythonpath: list[Path] | None = None,
) -> Run:  # fmt: skip
    """Run ``case``'s driver with ``python``'s environment in one of the ways of the module documentation.

    ``audit_every`` adds ``--audit-every`` to a ``gradguard run`` (the benchmark never does: it
    measures the defaults; the CI subset also checks detection apart from the schedule).
    ``pythonpath``: folders every process imports from first (``PYTHONPATH``; the caller's is not
    passed on): a snapshot of gradguard ahead of the environment's editable install, or a release
    unpacked with ``pip install --target`` on top of the running environment.

    Raises:
        ValueError: ``way`` is not one of ``WAYS``.
    """
    if way not in WAYS:
        raise ValueError(f"way {way!r} is not one of {', '.join(WAYS)}")
    out = scratch / way
    out.mkdir(parents=True)
    tmp = scratch / f"{way}-tmp"
    tmp.mkdir()
    driver = str(driver_path(case))
    if way == "plain":
        command = [str(python), driver]
    else:
        mode, audit_every = ("raise", "1") if way == "every1" else ("raise" if way == "remedy" else way, audit_every)
        extra = ["--audit-every", audit_every] if audit_every is not None else []
        command = [str(python.parent / "gradguard"), "run", "--mode", mode, *extra, driver]
    env = _environ(
        tmp, out, memory=way in ("plain", "detach"), steps=steps, pythonpath=pythonpath or [], remedy=way == "remedy"
    )
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=scratch)
        code, stderr, timed_out = done.returncode, done.stderr, False
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr
        code, stderr, timed_out = None, err.decode(errors="replace") if isinstance(err, bytes) else err or "", True
    run = Run(way, command, code, time.perf_counter() - start, stderr[-_TAIL:], timed_out=timed_out)
    probe = out / "probe.json"
    if probe.exists():
        record = json.loads(probe.read_text())
        run.steps, run.memory = record["steps"], record["memory"]
    if (out / "weights.pt").exists():
        run.weights = torch.load(out / "weights.pt", weights_only=True)
    announced = _ANNOUNCED.search(stderr)
    if announced:
        run.reports = _reports(Path(announced.group(1)))
    error = _ERROR.search(stderr)
    run.error = _RANK_PREFIX.sub("", error.group(1)) if error else None
    run.warnings = sorted(set(_WARNING.findall(stderr)))
    return run


def growth_per_step(memory: list[int], skip: int = 2) -> float | None:
    """The least-squares slope of the in-use bytes over the steps, the first ``skip`` readings left out
    (start-up allocations); ``None`` with fewer than three readings left."""
    ys = memory[skip:]
    if len(ys) < 3:
        return None
    n = len(ys)
    mean_x, mean_y = (n - 1) / 2, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in range(n))
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(ys)) / sxx


def _median(values: list[int]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return float(s[mid]) if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def same_weights(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> bool | None:
    """Bitwise equality of two saved ``state_dict`` copies (``None`` when either is missing)."""
    if a is None or b is None:
        return None
    return a.keys() == b.keys() and all(
        x.dtype == b[k].dtype and x.shape == b[k].shape and torch.equal(x, b[k]) for k, x in a.items()
    )


def _holders(run: Run) -> list[dict[str, Any]]:
    rows = []
    for report in run.reports:
        for h in report.get("holders", []):
            rows.append({k: h.get(k) for k in ("holder", "path", "found_at", "survived", "outcome", "alive",
                                                "tensors", "pinned_bytes", "nodes", "node_bytes", "fix")})  # fmt: skip
    return rows


def _watch_line(run: Run) -> str | None:
    lines = [line for line in run.stderr_tail.splitlines() if line.startswith("gradguard watch:")]
    return lines[-1] if lines else None


def summarize(run: Run) -> dict[str, Any]:
    """The JSON record of one run (weights and raw memory readings summarized)."""
    return {
        "command": " ".join(Path(c).name if i < 1 else c for i, c in enumerate(run.command)),
        "returncode": run.returncode,
        "timed_out": run.timed_out,
        "seconds": round(run.seconds, 2),
        "optimizer_steps": run.steps,
        "boundaries": sum(r["figures"]["boundaries"] for r in run.reports) if run.reports else None,
        "audits": sum(r["figures"]["audits"] for r in run.reports) if run.reports else None,
        "holders": _holders(run),
        "error": run.error,
        "warnings": run.warnings,
        "watch_line": _watch_line(run),
        "growth_bytes_per_step": growth_per_step(run.memory),
        "in_use_median_bytes": _median(run.memory),
        "memory_bytes": run.memory,
        "stderr_tail": run.stderr_tail,
    }


def run_release(
    python: Path, case: Case, release: Release, *, steps: int | None = None, timeout: float = 600.0,
    ways: tuple[str, ...] = WAYS, log: Any = sys.stdout, pythonpath: list[Path] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Every way of one release, and the comparisons between them; ``"weights"``: the final weights of the
    ``plain`` and ``remedy`` runs (for comparisons across releases; not JSON: the caller drops them)."""
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix=f"gradguard-field-{release.name}-") as folder:
        for way in ways:
            run = run_way(python, case, way, Path(folder), steps=steps, timeout=timeout, pythonpath=pythonpath)
            runs[way] = run
            print(f"  {release.name:<26} {way:<6} exit {run.returncode} in {run.seconds:.1f} s", file=log, flush=True)
    plain, warn, detach = runs.get("plain"), runs.get("warn"), runs.get("detach")
    return {
        "release": release.name,
        "runs": {way: summarize(run) for way, run in runs.items()},
        "warn_weights_equal_plain": same_weights(plain.weights, warn.weights) if plain and warn else None,
        "detach_weights_equal_plain": same_weights(plain.weights, detach.weights) if plain and detach else None,
        "weights": {way: runs[way].weights for way in ("plain", "remedy") if way in runs},
    }
