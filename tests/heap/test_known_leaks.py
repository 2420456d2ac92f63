"""The known-leak table: its schema, its lookup by holder and by installed version, the field benchmark
proving every entry, ``gradguard doctor`` naming an installed match, and packages pip put into a
folder of ``sys.path`` (``--target``) counted as installed."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from benchmarks.field.cases import CASES
from gradguard._heap import installed
from gradguard._heap.known_leaks import KNOWN_LEAKS, KnownLeak
from gradguard._tools.doctor import known_leak_lines

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "known-leaks.md"

_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


@pytest.mark.parametrize("entry", KNOWN_LEAKS, ids=lambda e: e.distribution)
def test_every_entry_is_well_formed(entry: KnownLeak) -> None:
    assert dataclasses.is_dataclass(entry) and type(entry).__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert entry.package.isidentifier() and entry.distribution
    affected, fixed = SpecifierSet(entry.affected), Version(entry.fixed)
    assert fixed not in affected and all(Version(s.version) < fixed for s in affected)  # fixed after every affected one
    assert entry.reference.startswith("https://")
    assert _DOTTED.fullmatch(entry.owner) and entry.owner.startswith(entry.package + ".")
    assert entry.hook is None or (_DOTTED.fullmatch(entry.hook) and entry.hook.startswith(entry.package + "."))
    assert entry.remedy is None or entry.remedy.strip()
    assert entry.what and entry.attribute is None or entry.attribute.isidentifier()  # type: ignore[union-attr]


def test_the_table_is_data_only_and_one_entry_per_release() -> None:
    assert isinstance(KNOWN_LEAKS, tuple) and all(type(e) is KnownLeak for e in KNOWN_LEAKS)
    keys = [(e.distribution, e.affected) for e in KNOWN_LEAKS]
    assert len(keys) == len(set(keys))


def test_every_entry_is_proven_by_a_field_case_and_every_case_has_an_entry() -> None:
    """An entry's leaky and fixed releases are the ones a driver of ``benchmarks/field`` runs."""
    releases = {(c.leaky.name, c.fixed.name) for c in CASES}
    for entry in KNOWN_LEAKS:
        [leaky] = [s.version for s in SpecifierSet(entry.affected)]
        assert any(name == f"{entry.distribution}-{leaky}" for name, _ in releases), entry
    named = {f"{e.distribution}-{s.version}" for e in KNOWN_LEAKS for s in SpecifierSet(e.affected)}
    assert {c.leaky.name for c in CASES} <= named


def test_lookup_matches_the_package_the_version_the_shape_and_the_key() -> None:
    shapes = ["pytorch_lightning.loops.epoch.training_epoch_loop.TrainingEpochLoop", "builtins.object"]
    entry = installed.known_leak("pytorch_lightning", "1.9.5", shapes, ["_fit_loop", "_outputs"])
    assert entry is not None and entry.fixed == "2.0.0"
    assert installed.known_leak("pytorch_lightning", "2.0.0", shapes, ["_outputs"]) is None  # the fixed release
    assert installed.known_leak("pytorch_lightning", "1.9.5", shapes, ["_results"]) is None  # another attribute
    assert installed.known_leak("pytorch_lightning", "1.9.5", ["mypkg.Loop"], ["_outputs"]) is None  # another owner
    assert installed.known_leak("pytorch_lightning", None, shapes, ["_outputs"]) is None  # no version known
    assert installed.known_leak("lightning", "1.9.5", shapes, ["_outputs"]) is None  # another package
    # an entry without an attribute matches any key; its owner matches through a subclass's bases
    metric = installed.known_leak("torchmetrics", "0.7.2", ["torchmetrics.metric.Metric"], [])
    assert metric is not None and metric.fixed == "0.7.3"


def test_the_documented_table_is_the_shipped_one() -> None:
    """docs/reference/known-leaks.md lists every entry, its affected versions, fix and reference."""
    rows = [line for line in PAGE.read_text(encoding="utf-8").splitlines() if line.startswith("| ")][
        1:
    ]  # the header left out
    assert len(rows) == len(KNOWN_LEAKS)
    for row, entry in zip(rows, KNOWN_LEAKS):
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[:3] == [entry.distribution, f"`{entry.affected}`", entry.fixed], row
        assert cells[-1] == entry.reference and f"`{entry.owner}`" in cells[3]
        assert cells[4] == (f"`{entry.remedy}`" if entry.remedy else "none: upgrade")


def _dist_info(folder: Path, name: str, version: str) -> Path:
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder


@pytest.mark.parametrize(("version", "named"), [("0.7.2", True), ("0.7.3", False)])
def test_doctor_names_an_installed_release_with_a_known_leak(
    version: str, named: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(_dist_info(tmp_path, "torchmetrics", version)))
    lines = known_leak_lines()
    matching = [line for line in lines if line.startswith("known leak: torchmetrics")]
    if named:
        assert matching == [
            f"known leak: torchmetrics {version} installed: Metric.update accumulates its state with the graph of the "
            "predictions it is given; fixed in 0.7.3: upgrade (https://github.com/Lightning-AI/torchmetrics/releases/tag/v0.7.3)"
        ]
    else:
        assert matching == [] and not any("torchmetrics" in line for line in lines)


def test_a_folder_pip_installed_into_is_a_library_dir_and_a_source_tree_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = _dist_info(tmp_path / "target", "fakepkg", "1.0")
    (tmp_path / "src" / "mine.egg-info").mkdir(parents=True)  # an editable install's metadata, in the source tree
    monkeypatch.syspath_prepend(str(target))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    installed.library_dirs.cache_clear()
    try:
        dirs = installed.library_dirs()
        assert str(target.resolve()) + "/" in dirs
        assert str((tmp_path / "src").resolve()) + "/" not in dirs
    finally:
        installed.library_dirs.cache_clear()


def test_gradguard_doctor_names_the_installed_known_leak_before_the_engines(tmp_path: Path) -> None:
    """The command itself, in a fresh interpreter that sees a torchmetrics 0.7.2 installed (its metadata)."""
    folder = _dist_info(tmp_path / "site", "torchmetrics", "0.7.2")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADGUARD")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(folder)])
    run = subprocess.run(
        [sys.executable, "-m", "gradguard", "doctor"], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    [at] = [i for i, line in enumerate(lines) if line.startswith("known leak: torchmetrics 0.7.2 installed: ")]
    assert at < min(i for i, line in enumerate(lines) if line.startswith("engine "))
    assert "fixed in 0.7.3: upgrade" in lines[at]
