"""Helpers the test files share: records that carry a graph, the caller's line, a child's environment,
and ``require_engine``: it imports an engine for an integration test; a missing engine skips the test
locally and fails it when ``GRADGUARD_REQUIRE_ENGINES=1`` (CI), so CI cannot go green by skipping."""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from types import ModuleType
from typing import Any

import pytest
import torch

__all__ = [
    "assert_detached_from",
    "require_engine",
    "clean",
    "env",
    "grad_tensor",
    "graph",
    "lineno",
    "plain_tensor",
    "record",
    "storage_ptr",
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
    """``worker(rank, port, outdir)`` in ``nprocs`` spawned processes on a free loopback port, joined
    within ``timeout_s`` (a rank's exception is re-raised with its traceback; past the time the ranks
    are terminated and the test fails)."""
    import socket
    import time

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.spawn(worker, args=(port, outdir), nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):  # raises ProcessRaisedException with the rank's traceback
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"the {nprocs}-rank run did not finish in {timeout_s} s")
