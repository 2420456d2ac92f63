"""``offload="cpu"``: published tensors also leave the accelerator (verl #6984: even detached
``model_output`` kept for a whole mini-batch ran a rollout_n=32 job out of device memory)."""

from __future__ import annotations

from typing import Any

import torch

from .._tree.walk import map_tensors

__all__ = ["OFFLOAD_TARGETS", "check_offload", "to_host"]

OFFLOAD_TARGETS = ("cpu",)


def check_offload(offload: object) -> str | None:
    """Validate a user's ``offload=`` value; returns it, or raises ``ValueError`` naming the accepted ones."""
    if offload is None or offload in OFFLOAD_TARGETS:
        return offload  # type: ignore[return-value]
    raise ValueError(f"offload={offload!r} is not supported; accepted: None, 'cpu'")


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


def _copy_to_host(t: torch.Tensor) -> torch.Tensor:
    # non_blocking device-to-host copies land in pinned memory; the caller synchronizes once.
    return t.to("cpu", non_blocking=True)


def to_host(obj: Any) -> Any:
    """Return ``obj`` with every tensor not on the CPU copied there (containers rebuilt lazily).

    Copies of one record are issued asynchronously and awaited together before returning, so a
    reader never sees a half-copied tensor.
    """
    devices: set[torch.device] = set()

    def move(t: torch.Tensor) -> torch.Tensor:
        if not _on_device(t):
            return t
        devices.add(t.device)
        return _copy_to_host(t)

    moved = map_tensors(obj, move)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return moved
