"""One virtual environment per release, sharing one torch: build them, find their interpreters.

Each release gets ``<root>/<release>`` (default root ``/work/field-envs``, or ``GRADGUARD_FIELD_ENVS``),
outside the repository. torch is installed once, in ``<root>/base`` (``torch==2.13.0``, the CPU wheel
pip finds on this machine's disk), and every release's environment sees it through a ``.pth`` line
placed after its own site-packages: a release that needs another numpy, tokenizers or transformers
gets its own copy, which comes first, while pip never touches the base (it only uninstalls what lies
inside the environment it installs into). Every install is constrained to ``torch==2.13.0`` so that
no requirement can pull another torch build. gradguard is installed from the repository
(``--no-deps -e``) with wrapt and packaging.

An environment is rebuilt when its recorded specification (the requirements, in order) differs from
the release's; otherwise it is reused as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from .cases import Release

__all__ = ["TORCH", "ensure", "python_of", "root"]

TORCH = "torch==2.13.0"
_SPEC = "field-spec.json"
REPO = Path(__file__).resolve().parents[2]


def root() -> Path:
    """Where the environments live."""
    return Path(os.environ.get("GRADGUARD_FIELD_ENVS", "/work/field-envs"))


def python_of(env: Path) -> Path:
    return env / "bin" / "python"


def _run(argv: list[str], log: Path) -> None:
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed with status {done.returncode}; see {log}")


def _pip(env: Path, args: list[str], constraints: Path, log: Path) -> None:
    _run(
        [str(python_of(env)), "-m", "pip", "install", "--disable-pip-version-check", "-c", str(constraints), *args], log
    )


def _site_packages(env: Path) -> Path:
    out = subprocess.run(
        [str(python_of(env)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return Path(out.stdout.strip())


def _base_python() -> str:
    """The interpreter the environments are made from: this one's base (not a virtual environment)."""
    exe = Path(sys._base_executable) if hasattr(sys, "_base_executable") else Path(sys.executable)
    version = sysconfig.get_python_version()
    return str(exe if exe.exists() else shutil.which(f"python{version}") or sys.executable)


def _fresh(env: Path, spec: dict[str, object]) -> bool:
    try:
        return json.loads((env / _SPEC).read_text()) == spec
    except (OSError, ValueError):
        return False


def _base(log: Path, constraints: Path) -> Path:
    env = root() / "base"
    spec = {"requirements": [TORCH]}
    if not _fresh(env, spec):
        shutil.rmtree(env, ignore_errors=True)
        _run([_base_python(), "-m", "venv", str(env)], log)
        _pip(env, [TORCH], constraints, log)
        (env / _SPEC).write_text(json.dumps(spec))
    return env


def ensure(release: Release, log_dir: Path | None = None) -> Path:
    """The interpreter of ``release``'s environment, building the environment first when it is missing
    or was built from another specification.

    Raises:
        RuntimeError: an install step failed (the message names the command and the log file).
    """
    env = root() / release.name
    spec = {"requirements": list(release.requirements), "no_deps": list(release.no_deps), "base": [TORCH]}
    if _fresh(env, spec):
        return python_of(env)
    root().mkdir(parents=True, exist_ok=True)
    log = (log_dir or root()) / f"{release.name}.install.log"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="gradguard-field-") as folder:
        constraints = Path(folder) / "constraints.txt"
        constraints.write_text(f"{TORCH}\n")
        base = _base(log, constraints)
        shutil.rmtree(env, ignore_errors=True)
        _run([_base_python(), "-m", "venv", str(env)], log)
        (_site_packages(env) / "zz_field_base_torch.pth").write_text(f"{_site_packages(base)}\n")
        if release.requirements:
            _pip(env, list(release.requirements), constraints, log)
        if release.no_deps:
            _pip(env, ["--no-deps", *release.no_deps], constraints, log)
        _pip(env, ["wrapt", "packaging"], constraints, log)
        _pip(env, ["--no-deps", "-e", str(REPO)], constraints, log)
    (env / _SPEC).write_text(json.dumps(spec))
    return python_of(env)
