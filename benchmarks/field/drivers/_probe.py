"""What a driver records about its own run, for the runner: optimizer steps, memory, final weights.

Nothing here changes the training: a global optimizer-step post-hook (``torch.optim.optimizer.
register_optimizer_step_post_hook``, which every ``torch.optim`` optimizer calls, also when a library
wraps it) counts the steps and, when ``GRADGUARD_FIELD_MEMORY=1``, reads glibc's in-use bytes right
after each step: ``mallinfo2()``'s ``uordblks + hblkhd`` (the bytes of the chunks malloc handed out
and not yet freed, mmapped ones included; CPU tensor storage comes from malloc). No garbage
collection is forced: what is read is what the program holds. ``finish(model)`` saves the model's
final ``state_dict``. Everything goes to ``GRADGUARD_FIELD_OUT`` (a folder) when it is set; without it
the driver runs as a plain script. ``REMEDY`` (``GRADGUARD_FIELD_REMEDY=1``): the driver applies the
change gradguard's fix names on the user's side (the benchmark's ``remedy`` run), else it runs as written.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import json
import os
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["REMEDY", "finish", "in_use_bytes", "install"]

OUT = os.environ.get("GRADGUARD_FIELD_OUT")
MEMORY = os.environ.get("GRADGUARD_FIELD_MEMORY") == "1"
REMEDY = os.environ.get("GRADGUARD_FIELD_REMEDY") == "1"


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2
_state: dict[str, Any] = {"steps": 0, "memory": [], "installed": False}


def in_use_bytes() -> int:
    """glibc's bytes in use: small chunks plus mmapped ones."""
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _state["steps"] += 1
    if MEMORY:
        _state["memory"].append(in_use_bytes())


def _write() -> None:
    if OUT:
        with open(os.path.join(OUT, "probe.json"), "w", encoding="utf-8") as f:
            json.dump({"steps": _state["steps"], "memory": _state["memory"]}, f)


def install() -> None:
    """Count (and measure) every optimizer step from now on; the record is written at exit."""
    if not _state["installed"]:
        register_optimizer_step_post_hook(_after_step)
        atexit.register(_write)
        _state["installed"] = True


def finish(model: torch.nn.Module) -> None:
    """Save ``model``'s final weights (a copy of its ``state_dict``) for the bitwise comparison."""
    if OUT:
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save(weights, os.path.join(OUT, "weights.pt"))
