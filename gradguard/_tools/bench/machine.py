"""The machine a figure was measured on, read once: every benchmark result carries this line."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["machine", "machine_line", "measuring"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def machine(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Platform, CPU, cores, accelerator, versions, torch threads, the time and the load, as a dict."""
    from gradguard import __version__

    device = torch.device(device)
    facts: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model() or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "gradguard": __version__,
        "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_avg_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    return facts


def machine_line(facts: dict[str, Any]) -> str:
    """The facts of :func:`machine` in one line."""
    parts = [facts["platform"], facts["cpu"], f"{facts['cores']} cores"]
    if facts.get("accelerator"):
        parts.append(facts["accelerator"])
    parts += [
        f"python {facts['python']}",
        f"torch {facts['torch']} ({facts['torch_threads']} threads)",
        f"gradguard {facts['gradguard']}",
        facts["utc"],
    ]
    if facts.get("load_avg_1min") is not None:
        parts.append(f"load avg {facts['load_avg_1min']}")
    return ", ".join(parts)


@contextlib.contextmanager
def measuring(device: torch.device | str = "cpu") -> Iterator[tuple[dict[str, Any], str]]:
    """torch on one thread while the block measures (the thread count restored after it), and the
    machine's facts and line read inside, the line printed first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        facts = machine(device)
        line = machine_line(facts)
        print(f"machine: {line}", flush=True)
        yield facts, line
    finally:
        torch.set_num_threads(threads)
