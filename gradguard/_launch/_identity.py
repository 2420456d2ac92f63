"""Where a process is: its rank and world size, the host, the pid, the Ray actor it runs.

Read again at each use (cheap: a few environment lookups), because a process learns its rank late:
torch.distributed is initialised after torch's import, and a Ray worker (verl's) sets ``RANK`` in
its actor's ``__init__``. First that answers:

============================================  ==================================================
source                                         set by
============================================  ==================================================
``torch.distributed`` (initialised)            the program: ``get_rank()``, ``get_world_size()``
``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``      torchrun, accelerate, deepspeed, verl's Ray workers
``SLURM_PROCID`` / ``SLURM_NTASKS`` /           ``srun``
``SLURM_LOCALID``
``OMPI_COMM_WORLD_RANK`` / ``..._SIZE`` /       ``mpirun`` (deepspeed's MPI launcher)
``..._LOCAL_RANK``
============================================  ==================================================
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from collections.abc import Mapping

from .._policy.validate import read_count
from . import _actor

__all__ = ["HOST", "Identity", "identify", "started"]

_SOURCES = (
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
)

HOST = socket.gethostname() or "localhost"


@dataclasses.dataclass(frozen=True)
class Identity:
    """One process: ``pid``, ``host``; ``rank``, ``world_size``, ``local_rank`` where known (``None``
    otherwise), ``rank_from`` (what said so: ``torch.distributed`` or the variable's name) and
    ``actor`` (the class of the Ray actor it runs)."""

    pid: int
    host: str
    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    rank_from: str | None = None
    actor: str | None = None

    @property
    def label(self) -> str:
        """How a summary names it: ``rank 1/2``, ``actor Trainer``, ``rank 0/4, actor Worker``; the pid when
        neither is known."""
        parts = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}" + ("" if self.world_size is None else f"/{self.world_size}"))
        if self.actor is not None:
            parts.append(f"actor {self.actor}")
        return ", ".join(parts) or f"pid {self.pid}"

    @property
    def tag(self) -> str:
        """The label with the pid and the host: ``rank 1/2, pid 4242 on node-3``."""
        if self.rank is None and self.actor is None:
            return f"pid {self.pid} on {self.host}"
        return f"{self.label}, pid {self.pid} on {self.host}"


def _number(environ: Mapping[str, str], name: str) -> int | None:
    return read_count(environ.get(name))


def _distributed() -> tuple[int, int] | None:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - a half-torn-down process group answers nothing
        return None
    return None


def identify(environ: Mapping[str, str] | None = None) -> Identity:
    """This process, now.

    Args:
        environ: Where the launcher's variables are read (``os.environ`` by default); an initialised
            ``torch.distributed`` wins over them (the module documentation gives the order).

    Returns:
        Its identity.
    """
    environ = os.environ if environ is None else environ
    rank = world = local = None
    source = None
    for rank_var, world_var, local_var in _SOURCES:
        if _number(environ, rank_var) is not None:
            rank, world, local, source = (
                _number(environ, rank_var),
                _number(environ, world_var),
                _number(environ, local_var),
                rank_var,
            )
            break
    group = _distributed()
    if group is not None:
        rank, world, source = group[0], group[1], "torch.distributed"
    return Identity(os.getpid(), HOST, rank, world, local, source, _actor.current_class())


def started(pid: int | str = "self") -> int | None:
    """When a process started. ``exec`` keeps it, as it keeps the pid: together they name one process
    across the programs it runs, which a pid alone does not (pids are reused).

    Args:
        pid: The process (``"self"``: this one).

    Returns:
        Clock ticks since boot (Linux ``/proc/PID/stat``), or ``None`` where unknown.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19])  # field 22, counted after the command name's closing parenthesis
    except (OSError, IndexError, ValueError):
        return None
