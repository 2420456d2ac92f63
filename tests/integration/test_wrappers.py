"""The watch's warning names the program's own line when a framework wraps ``optimizer.step()``
(accelerate's ``AcceleratedOptimizer``): frames of installed packages are passed over, as gradguard's
and torch's are."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from _helpers import require_engine
from torch import nn

import gradguard

pytestmark = pytest.mark.integration

KEPT: list[Any] = []


def test_the_watch_warning_points_at_the_line_that_stepped_through_accelerate() -> None:
    accelerate = require_engine("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    layer = nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    assert type(optimizer).__module__.startswith("accelerate.")  # the wrapper whose frames sit in between
    line = 0
    try:
        with gradguard.watch(every=1, mode="warn", ignore=lambda r: "test_wrappers" not in r.path):
            with pytest.warns(gradguard.GraphRetentionWarning) as caught:
                for _ in range(3):
                    loss = model(torch.randn(2, 4)).sum()
                    accelerator.backward(loss)
                    KEPT.append(loss)
                    line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
                    optimizer.step()
    finally:
        KEPT.clear()
    warned = [w for w in caught if issubclass(w.category, gradguard.GraphRetentionWarning)]
    assert warned and (warned[0].filename, warned[0].lineno) == (__file__, line)
