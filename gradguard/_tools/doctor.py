"""``gradguard doctor``: what gradguard sees on this machine (the installed packages with a known leak
among them), and whether ``GRADGUARD`` is valid."""

from __future__ import annotations

import importlib.util
import platform

import torch

from .. import __version__, engines
from .._errors import GradGuardError
from .._heap.installed import installed_known_leaks
from .._heap.known_leaks import KNOWN_LEAKS
from .._policy.modes import ENV_VAR, mode_source, reload_env

__all__ = ["doctor", "known_leak_lines", "te_import_error"]


def te_import_error() -> str | None:
    """Why ``transformer_engine.pytorch`` does not import here, in one line; ``None`` when it does."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - TE fails in many ways without its CUDA libraries
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {first}"
    return None


def _te_status() -> str:
    if importlib.util.find_spec("transformer_engine") is None:
        return "not installed (pip install 'gradguard[te]' on a CUDA machine)"
    error = te_import_error()
    if error is not None:
        return f"installed but does not import: {error}"
    import transformer_engine

    return f"importable, version {getattr(transformer_engine, '__version__', '?')}"


def _engine_status(adapter: engines.Adapter) -> str:
    version = adapter.version()
    waits = ", ".join(adapter.modules)
    if version is None or not any(importlib.util.find_spec(m.split(".")[0]) for m in adapter.modules):
        return f"not installed; the adapter waits for {waits} (supports {adapter.package} {adapter.supported})"
    supported = adapter.supports(version)
    fit = {True: "supported", False: "OUTSIDE the supported range", None: "version not readable"}[supported]
    return f"{adapter.package} {version} found, {fit} ({adapter.supported}); the adapter installs on import of {waits}"


def known_leak_lines() -> list[str]:
    """The installed packages that have a leak of gradguard's known-leak table, one line each, found
    by package metadata (nothing is imported).

    Returns:
        ``known leak: torchmetrics 0.7.2 installed: <what keeps the graph>; fixed in 0.7.3: upgrade
        (<reference>)`` per match, or one line saying that none of the table's packages has one.
    """
    found = installed_known_leaks()
    if not found:
        return [f"known leaks: none installed (gradguard's table lists {len(KNOWN_LEAKS)})"]
    return [
        f"known leak: {entry.distribution} {version} installed: {entry.what}; fixed in {entry.fixed}: upgrade "
        f"({entry.reference})"
        for entry, version in found
    ]


def doctor() -> int:
    """Print the report; return 1 when ``GRADGUARD`` holds an invalid value, else 0."""
    lines = [
        f"gradguard {__version__}, python {platform.python_version()}",
        f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}, debug: {torch.version.debug})",
    ]
    if torch.cuda.is_available():
        lines.append(f"CUDA: {torch.cuda.device_count()} device(s), 0: {torch.cuda.get_device_name(0)}")
    else:
        lines.append("CUDA: not available")
    lines.append(f"Transformer Engine: {_te_status()}")
    lines.extend(known_leak_lines())
    for name in engines.KNOWN:
        lines.append(f"engine {name}: {_engine_status(engines.load(name))}")
    status = 0
    reload_env()
    try:
        mode, source = mode_source()
        lines.append(f"mode: {mode} (from {source})")
    except GradGuardError as exc:
        lines.append(f"mode: INVALID {ENV_VAR}: {exc}")
        status = 1
    print("\n".join(lines))
    return status
