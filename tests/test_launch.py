"""The pieces ``gradguard run`` reaches every process with, in-process where they can be: the watch's
``on_audit`` listeners and the warnings' origin tag; a process's identity; its report file; the merged
summary; the bootstrap (in fresh interpreters: what it costs a process that never imports torch, that
it sets up once torch is imported, and that it chains to a user's own ``sitecustomize``)."""

from __future__ import annotations

import warnings

import pytest
import torch

import gradguard
from gradguard import _site


def _leaky_steps(watcher: gradguard.Watcher, steps: int) -> list[torch.Tensor]:
    kept = []
    model = torch.nn.Linear(2, 1)
    for _ in range(steps):
        kept.append(model(torch.randn(1, 2)).sum())
        watcher.boundary()
    return kept


# --------------------------------------------------------------------------- the watch's listeners, the origin


def test_on_audit_listeners_run_after_each_audit_and_see_the_error_before_it_leaves() -> None:
    seen: list[tuple[int, int, str | None]] = []

    def listener(watcher: gradguard.Watcher, error: BaseException | None) -> None:
        outcomes = [h.outcome for h in watcher.history()]
        seen.append((watcher.audits, len(outcomes), None if error is None else type(error).__name__))
        if error is not None:
            error.args = (f"[tagged] {error.args[0]}",)

    watcher = gradguard.Watcher(every=1, mode="raise")
    watcher.on_audit(listener)
    with pytest.raises(gradguard.GraphRetentionError, match=r"^\[tagged\] gradguard: 1 holder keeps"):
        _leaky_steps(watcher, 3)
    # a frame's list: a leak once it survived two boundaries (the watch's grace for frame variables)
    assert seen == [(1, 0, None), (2, 0, None), (3, 1, "GraphRetentionError")]


def test_the_origin_prefixes_the_watch_warnings() -> None:
    watcher = gradguard.Watcher(every=1, mode="warn")
    _site.set_origin(lambda: "rank 1/2, pid 7 on node-3")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kept = _leaky_steps(watcher, 3)
    finally:
        _site.set_origin(None)
    del kept
    assert [str(w.message)[:39] for w in caught] == ["[rank 1/2, pid 7 on node-3] gradguard: "]
