"""The heap search on every Python the project declares: holders are named by their function's
qualified name (3.10 has no ``co_qualname``), the search never counts its own argument tuple as a
holder (3.13 returns it), never asks a module whose traversal CPython breaks for its referents
(``_asyncio`` on 3.12.0-3.12.5), and an audit keeps nothing alive once it returns."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from gradguard import _compat
from gradguard._heap import holders, paths


class Trainer:
    def step(self) -> str:
        return paths.frame_qualname(sys._getframe())

    @classmethod
    def build(cls) -> str:
        return paths.frame_qualname(sys._getframe())


def helper() -> str:
    return paths.frame_qualname(sys._getframe())


@pytest.mark.parametrize("has_qualname", [True, False], ids=["this Python", "as on 3.10"])
def test_holders_are_named_by_qualified_name(has_qualname: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compat, "PYTHON_HAS_QUALNAME", has_qualname and sys.version_info >= (3, 11))
    assert Trainer().step() == "Trainer.step"
    assert Trainer.build() == "Trainer.build"
    assert helper() == "helper"

    def nested() -> str:
        return paths.frame_qualname(sys._getframe())

    assert nested() == "test_holders_are_named_by_qualified_name.<locals>.nested"


def test_the_search_never_counts_its_own_arguments() -> None:
    target, other = object(), object()
    holder = [target]
    found = _compat.referrers([target, other])
    assert any(r is holder for r in found)
    assert not [r for r in found if type(r) is tuple and len(r) == 2 and r[0] is target and r[1] is other]


def test_modules_a_cpython_cannot_traverse_are_known() -> None:
    import _asyncio

    broken = (3, 12) <= sys.version_info[:3] < (3, 12, 6)
    assert (id(_asyncio) in _compat.untraversable()) == broken


def test_an_audit_leaves_no_frame_of_its_own_alive() -> None:
    t = torch.ones(3, requires_grad=True) * 2
    keep = [t]
    gc.collect()
    gc.disable()
    try:
        found = holders.find_paths([t])
        assert found[0] is not None
        del found
        left = [o for o in gc.get_objects() if type(o) is types.FrameType and o.f_code.co_filename == holders.__file__]
        assert left == []
    finally:
        gc.enable()
    keep.clear()


ASYNCIO_SCRIPT = textwrap.dedent(
    """
    import asyncio, gc
    import torch
    from gradguard._heap import holders

    loop = asyncio.new_event_loop()
    it = iter(loop.create_future())  # its memory goes back to _asyncio's free list
    del it
    gc.collect()
    kept = [torch.ones(2, requires_grad=True) * 2 for _ in range(300)]  # a frontier this wide is swept
    assert all(p is not None for p in holders.find_paths(kept))
    gc.get_referrers(kept[0])  # after a search that asked _asyncio for its referents, this never returns
    print("ok")
    """
)


def test_an_audit_after_asyncio_returns(tmp_path: Path) -> None:
    script = tmp_path / "asyncio_audit.py"
    script.write_text(ASYNCIO_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
