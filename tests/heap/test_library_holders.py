"""A graph kept in an installed package's state: the fix names the package and its version, the program's
object or call through which the value reached it with the change there, and ends with upgrading or
reporting upstream (or, for a leak of the known-leak table, the release that fixed it); the mode's
warning, not the fix, says that ``detach`` leaves it alone, once; the watch leaves the package's
objects as they are."""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from _tables import flat
from torch import nn

import gradguard
from gradguard._heap import installed

LIBRARY = textwrap.dedent(
    '''
    """A stand-in for an installed package with a metric that keeps what it is given with its graph."""
    import torch
    from torch import nn

    __version__ = "1.2.3"


    class SumOfSquares(nn.Module):
        def __init__(self):
            super().__init__()
            self.total = torch.tensor(0.0)

        def update(self, preds):
            self.total = self.total + preds.pow(2).sum()  # the bug: preds' graph is kept


    def fit(model, opt, batches, keep):
        """A library's training loop that sums the losses with their graphs in a local."""
        tr_loss = torch.tensor(0.0)
        for x in batches:
            loss = model(x).pow(2).mean()
            loss.backward()
            tr_loss = tr_loss + loss  # the bug: every step's graph stays reachable from this local
            opt.step()
            opt.zero_grad()
        keep.append(tr_loss.item())
    '''
)


@pytest.fixture
def fakelib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """``fakelib``, imported from a folder that gradguard takes for a ``site-packages``."""
    site = tmp_path / "site-packages"
    (site / "fakelib").mkdir(parents=True)
    (site / "fakelib" / "__init__.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(installed, "library_dirs", lambda: (str(site.resolve()) + "/",))
    installed.library_of_module.cache_clear()
    installed.package_version.cache_clear()
    module = importlib.import_module("fakelib")
    yield module
    sys.modules.pop("fakelib", None)
    installed.library_of_module.cache_clear()
    installed.package_version.cache_clear()


METRICS: dict[str, nn.Module] = {}


def test_a_packages_module_keeping_a_graph_is_named_with_its_version_and_left_alone(fakelib: ModuleType) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    METRICS["mse"] = metric = fakelib.SumOfSquares()
    try:
        with pytest.warns(gradguard.GraphRetentionWarning) as caught, gradguard.watch(mode="detach") as scope:
            for _ in range(4):
                preds = model(torch.randn(3, 4))
                preds.pow(2).mean().backward()
                metric.update(preds)
                opt.step()
                opt.zero_grad()
        [entry] = [e for e in scope.watcher.history() if "METRICS" in e.holder]
        assert entry.outcome == "not repairable" and metric.total.grad_fn is not None  # not written
        assert "fakelib 1.2.3 keeps it in fakelib.SumOfSquares (its state, not your program's)" in entry.fix
        assert "it reached that state through your METRICS['mse']: detach what you hand it" in entry.fix
        assert entry.fix.endswith("else upgrade fakelib or report it upstream")
        [warning] = [flat(str(w.message)) for w in caught if "METRICS" in str(w.message)]
        assert "fakelib.SumOfSquares (fakelib's state, which gradguard never writes)" in warning
        assert warning.count("repair") == 1 and warning.count("never writes") == 1  # said once
    finally:
        METRICS.clear()


def test_a_packages_frame_local_names_the_programs_call_that_led_there(fakelib: ModuleType) -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: list[float] = []
    with pytest.raises(gradguard.GraphRetentionError) as caught, gradguard.watch(mode="raise"):
        fakelib.fit(model, opt, [torch.randn(3, 4) for _ in range(6)], kept)  # the call the fix points at
    assert re.search(r"  fakelib/__init__\.py:\d+ in fit: tr_loss: ", str(caught.value))  # the installed file
    message = flat(str(caught.value))  # wrapped within 100 columns
    assert "fakelib 1.2.3 keeps it in a local of fit (its state, not your program's)" in message
    assert "it got there during your call at tests/heap/test_library_holders.py:" in message
    assert "in test_a_packages_frame_local_names_the_programs_call_that_led_there" in message


def test_torchs_own_modules_are_the_programs_whoever_defines_the_model() -> None:
    """An attribute a program sets on nn.Linear is the program's state: repaired."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradguard.watch(every=1, mode="detach") as scope:
        for _ in range(4):
            loss = model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            model.seen = [*getattr(model, "seen", []), loss]
            opt.step()
            opt.zero_grad()
    [entry] = [e for e in scope.watcher.history() if "seen" in e.holder]
    assert entry.outcome == "repaired"


def _dist_info(site: Path, name: str, version: str, module: str) -> None:
    """A distribution ``name`` installed in ``site`` with the package ``module`` (its file exists: newer
    Pythons list only the files of a RECORD that do)."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{module}/__init__.py,,\n")
    (site / module).mkdir()
    (site / module / "__init__.py").write_text("")


def test_a_packages_version_is_read_from_its_own_distribution_without_mapping_them_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site-packages"
    _dist_info(site, "ownlib", "1.2.3", "ownlib")
    _dist_info(site, "othername", "4.5.6", "renamed")
    monkeypatch.syspath_prepend(str(site))
    mapped: list[bool] = []

    def packages_distributions() -> dict[str, list[str]]:
        mapped.append(True)
        return {"renamed": ["othername"]}

    monkeypatch.setattr(importlib.metadata, "packages_distributions", packages_distributions)
    installed.package_version.cache_clear()
    try:
        assert installed.package_version("ownlib") == "1.2.3"
        assert not mapped  # its own distribution's RECORD lists it: one folder read
        assert installed.package_version("renamed") == "4.5.6"  # another distribution's module: mapped
        assert mapped
    finally:
        installed.package_version.cache_clear()
