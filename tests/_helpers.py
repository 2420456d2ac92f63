"""Helpers the test files share: records that carry a graph, the caller's line, a child's environment,
``require_engine``: it imports an engine for an integration test; a missing engine skips the test
locally and fails it when ``GRADGUARD_REQUIRE_ENGINES=1`` (CI), so CI cannot go green by skipping;
and ``once_per_run``: an expensive result (a subprocess's, a spawned world's) that the tests of a
module share, computed once per run even when pytest-xdist spreads those tests over its workers."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from filelock import FileLock

__all__ = [
    "assert_detached_from",
    "clean",
    "env",
    "grad_tensor",
    "graph",
    "lineno",
    "once_per_run",
    "plain_tensor",
    "previous_test",
    "record",
    "require_engine",
    "script_module",
    "storage_ptr",
    "watch_clock",
]


def graph(value: float = 1.0, n: int = 4) -> torch.Tensor:
    """A fresh tensor carrying a graph (``MulBackward0``) over a leaf of ``n`` float32 that requires grad."""
    return torch.full((n,), value, requires_grad=True) * 2


def record(value: float = 1.0, n: int = 4, *, entropy: bool = True) -> dict[str, Any]:
    """A verl-style record over one fresh leaf of ``n`` float32 (it pins ``4 n`` bytes).

    ``log_probs`` carries ``AddBackward0``; ``entropy`` carries ``SubBackward0``, or is a plain tensor
    with ``entropy=False``.
    """
    leaf = torch.full((n,), value, requires_grad=True)
    return {
        "loss": value,
        "model_output": {"log_probs": leaf + 1, "entropy": leaf - 1 if entropy else torch.zeros(2)},
    }


def clean(value: float = 1.0) -> dict[str, Any]:
    """A record with nothing to detach."""
    return {"loss": value, "model_output": {"log_probs": torch.zeros(3)}}


def lineno() -> int:
    """The caller's current line number."""
    return sys._getframe(1).f_lineno


def watch_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The watch's clocks (its boundaries' times, and what its work costs) replaced by one the test advances:
    ``clock[0]`` seconds. Work then costs nothing unless the test moves the clock while it runs."""
    from gradguard._watch import auditing, threads, watcher

    clock = [0.0]
    for module in (watcher, threads):
        monkeypatch.setattr(module, "_clock", lambda: clock[0])
    for module in (watcher, auditing):
        monkeypatch.setattr(module, "work_clock", lambda: clock[0])
    return clock


def env(**changes: str | None) -> dict[str, str]:
    """``os.environ`` for a child process, without ``GRADGUARD``, with ``changes`` (``None`` removes a name)."""
    result = {k: v for k, v in os.environ.items() if k != "GRADGUARD"}
    for key, value in changes.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = value
    return result


def grad_tensor(n: int = 3) -> torch.Tensor:
    """A non-leaf tensor carrying grad_fn."""
    return torch.arange(float(n), requires_grad=True) * 2


def plain_tensor(n: int = 3) -> torch.Tensor:
    return torch.arange(float(n)) + 10


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def assert_detached_from(new: Any, old: torch.Tensor) -> None:
    assert isinstance(new, torch.Tensor)
    assert new is not old
    assert not new.requires_grad
    assert new.grad_fn is None
    assert storage_ptr(new) == storage_ptr(old)
    assert new.data_ptr() == old.data_ptr()
    assert torch.equal(new, old.detach())


def require_engine(module: str) -> ModuleType:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # engines warn about optional CUDA extras on import
            return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means the engine is unusable here
        if os.environ.get("GRADGUARD_REQUIRE_ENGINES") == "1":
            pytest.fail(f"{module} is required (GRADGUARD_REQUIRE_ENGINES=1) but failed to import: {exc!r}")
        pytest.skip(f"{module} not importable: {exc!r}")


def require_gloo() -> Any:
    """``torch.distributed`` with its gloo backend, or the skip (a failure under
    ``GRADGUARD_REQUIRE_ENGINES=1``) :func:`require_engine` gives a missing engine."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        if os.environ.get("GRADGUARD_REQUIRE_ENGINES") == "1":
            pytest.fail("torch.distributed with gloo is required (GRADGUARD_REQUIRE_ENGINES=1)")
        pytest.skip("torch.distributed gloo backend not available")
    return dist


def run_ranks(worker: Any, nprocs: int, outdir: str, timeout_s: float) -> None:
    """``worker(rank, init_method, outdir)`` in ``nprocs`` spawned processes, joined within ``timeout_s`` (a
    rank's exception is re-raised with its traceback; past the time the ranks are terminated and the
    test fails).

    ``init_method`` is a ``file://`` URL for ``torch.distributed.init_process_group``: the ranks meet
    through a file in ``outdir``, not on a port that another test (or another xdist worker) might take
    between being found free and being bound.
    """
    import time

    import torch.multiprocessing as mp

    store = Path(outdir) / "rendezvous"
    assert not store.exists(), f"{store} is left from an earlier run: a file store must start empty"
    ctx = mp.spawn(worker, args=(store.as_uri(), outdir), nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):  # raises ProcessRaisedException with the rank's traceback
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"the {nprocs}-rank run did not finish in {timeout_s} s")


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[Path], Any]) -> Any:
    """``compute(folder)``'s result, computed once per test run and read back by every process that asks.

    For the module-scoped fixtures whose result is data: under pytest-xdist each worker that runs one
    of the module's tests sets the fixture up, and the first one computes while the others wait on a
    file lock, then read the result. ``folder`` is a fresh folder that every worker of the run can read
    (for files the result names); the result must be JSON. If ``compute`` raises, nothing is kept and
    the next process to ask computes again (and fails the same way).

    Args:
        tmp_path_factory: pytest's factory, whose base folder is per worker under a folder per run.
        name: the result's name, unique in the suite (a file name).
        compute: makes the result; called at most once per run unless it raises.

    Returns:
        What ``compute`` returned, as JSON gives it back (tuples become lists).
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above the workers' own
    result = root / f"{name}.json"
    with FileLock(root / f"{name}.lock"):
        if not result.is_file():
            folder = root / name
            if folder.exists():  # what an attempt that raised left
                shutil.rmtree(folder)
            folder.mkdir()
            result.write_text(json.dumps(compute(folder)), encoding="utf-8")
        return json.loads(result.read_text(encoding="utf-8"))


_started: list[str] = []  # the node ids of the tests this process started, in order (tests/conftest.py adds them)


def previous_test() -> str | None:
    """The node id of the test this process ran before the current one, if any.

    Under pytest-xdist that is not the test collected before it: a worker runs a share of the tests,
    and takes more from another worker's queue when it runs out.
    """
    return _started[-2] if len(_started) >= 2 else None


@contextlib.contextmanager
def script_module(name: str) -> Iterator[ModuleType]:
    """A module registered under ``name`` while the block runs: its globals are a module's, as a script's
    are (roots of the heap search). Emptied and unregistered afterwards."""
    program = ModuleType(name)
    sys.modules[name] = program
    try:
        yield program
    finally:
        del sys.modules[name]
        vars(program).clear()
