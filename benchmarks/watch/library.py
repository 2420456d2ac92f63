"""A leak in an installed library's state, which the watch cannot repair: its cost must not grow with
the run.

The benchmark writes a tiny package, ``benchleakmetric`` 0.1.0 (a folder holding the module and its
``*.dist-info``), into a temporary folder and runs the case in a child process that puts the folder on
``sys.path`` before gradguard is imported (gradguard reads the folders that hold installed packages once,
at their first use). The package's metric adds each step's squared error to its state with its graph
(no ``detach``: the bug). gradguard never writes a library's state, so ``detach`` leaves the holder as
it is ("not repairable") and the graphs accumulate on both sides of a pair.

``python -m benchmarks.watch.library FOLDER JSON DEVICE ROUNDS STEPS...`` is the child (this module's
top level imports neither torch nor gradguard).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

__all__ = ["NAME", "library_leak", "write_package"]

NAME = "benchleakmetric"
VERSION = "0.1.0"

_MODULE = '''"""A metric that keeps its state's graph (the bug: no detach)."""

import torch


class MeanSquaredError:
    def __init__(self):
        self.total = torch.zeros(())

    def update(self, preds, target):
        self.total = self.total + (preds - target).pow(2).sum()

    def compute(self):
        return self.total
'''


def write_package(folder: str) -> None:
    """Write the package and its ``*.dist-info`` (``METADATA`` with its name and version) into ``folder``."""
    os.makedirs(os.path.join(folder, NAME), exist_ok=True)
    with open(os.path.join(folder, NAME, "__init__.py"), "w", encoding="utf-8") as f:
        f.write(_MODULE)
    info = os.path.join(folder, f"{NAME}-{VERSION}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as f:
        f.write(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n")
    with open(os.path.join(info, "RECORD"), "w", encoding="utf-8") as f:
        f.write(f"{NAME}/__init__.py,,\n{NAME}-{VERSION}.dist-info/METADATA,,\n{NAME}-{VERSION}.dist-info/RECORD,,\n")


def library_leak(device: str, steps: Sequence[int], rounds: int) -> dict[int, dict[str, Any]]:
    """Run the case in a child process at each of ``steps``.

    Returns:
        Per step count, :func:`~.cost.side_by_side`'s figures of the fast step calling the metric.

    Raises:
        RuntimeError: the child failed (its output in the message).
    """
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="gradguard-watch-library-") as folder:
        site = os.path.join(folder, "site")
        write_package(site)
        out = os.path.join(folder, "out.json")
        env = dict(os.environ)
        # the parent's path first (a gradguard installed from a wheel stays the one imported), then this tree
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), root) if p)
        command = [
            sys.executable,
            *(["-P"] if getattr(sys.flags, "safe_path", False) else []),
            "-m",
            "benchmarks.watch.library",
        ]
        proc = subprocess.run(
            [*command, site, out, device, str(rounds), *map(str, steps)], env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the library-leak child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        with open(out, encoding="utf-8") as f:
            return {int(k): v for k, v in json.load(f).items()}


def _child(argv: Sequence[str]) -> int:
    site, out, device, rounds, *steps = argv
    sys.path.insert(0, site)  # before gradguard's first use: an installed package's folder

    import torch

    from gradguard._heap.installed import library_of_module

    from .cost import fast_cost, side_by_side
    from .loops import Fast

    metric_module = __import__(NAME)
    if library_of_module(NAME) != NAME:
        raise RuntimeError(f"{NAME} is not seen as an installed library: {library_of_module(NAME)!r}")
    torch.set_num_threads(1)
    dev = torch.device(device)

    def prepare(run: Fast) -> None:
        run.state.metric = metric_module.MeanSquaredError()
        run.state.target = torch.zeros(64, 1, device=dev)

    def update(run: Fast, step: int, loss: torch.Tensor, out: torch.Tensor) -> None:
        run.state.metric.update(out, run.state.target)

    figures = {
        n: side_by_side(functools.partial(fast_cost, dev, update, int(n), prepare=prepare), int(rounds)) for n in steps
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(figures, f)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
