"""Check the wheels carried to the device machine: ``python benchmarks/device/check_wheels.py [WHEELS_DIR]``.

The device image (Python 3.12, torch, triton, numpy, packaging, wrapt, ...) lacks megatron-core and
gradguard itself; ``benchmarks/device/fetch_wheels.sh`` puts both into ``.whl/`` (git-ignored). This
checks, with the standard library only (it runs before anything is installed):

* exactly one ``megatron_core-*.whl`` and one ``gradguard-*.whl``, nothing else that installs;
* ``SHA256SUMS`` (written by the fetch script) matches every wheel;
* the wheels and the folder stay under the device tool's 64 MiB for everything that travels;
* the gradguard wheel holds exactly the working tree's ``gradguard`` and ``gradguard_pytest`` files
  (a wheel built before the last edit would benchmark old code).

Prints one line per finding and exits 0 when all hold, 1 otherwise (2: usage).
"""

from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIMIT = 64 * 2**20
PACKAGES = ("gradguard", "gradguard_pytest")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_files(repo: Path = REPO) -> dict[str, bytes]:
    """The working tree's package files that a wheel of it holds: ``.py`` files, and the package data
    ``pyproject.toml`` names (``[tool.setuptools.package-data]``: ``py.typed``, the page's templates)."""
    data = {path for pattern in _package_data(repo) for path in repo.glob(pattern)}
    files = {}
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*")):
            if path.is_file() and (path.suffix == ".py" or path in data) and "__pycache__" not in path.parts:
                files[path.relative_to(repo).as_posix()] = path.read_bytes()
    return files


def _package_data(repo: Path) -> list[str]:
    """The package data's patterns, relative to the repository."""
    import tomllib  # Python 3.11: this script runs on the device image's 3.12 and in CI's 3.11

    config = tomllib.loads((repo / "pyproject.toml").read_text())
    data = config.get("tool", {}).get("setuptools", {}).get("package-data", {})
    return [f"{package.replace('.', '/')}/{pattern}" for package, patterns in data.items() for pattern in patterns]


def wheel_files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as z:
        return {
            name: z.read(name)
            for name in z.namelist()
            if name.split("/", 1)[0] in PACKAGES and not name.endswith("/") and ".dist-info/" not in name
        }


def check(wheels: Path, repo: Path = REPO) -> list[tuple[bool, str]]:
    """``(ok, line)`` per finding."""
    if not wheels.is_dir():
        return [(False, f"{wheels}: no such folder; run benchmarks/device/fetch_wheels.sh")]
    found = sorted(wheels.glob("*.whl"))
    out: list[tuple[bool, str]] = []
    by_kind = {kind: [w for w in found if w.name.startswith(f"{kind}-")] for kind in ("megatron_core", "gradguard")}
    for kind, ws in by_kind.items():
        names = ", ".join(w.name for w in ws) or "none"
        out.append((len(ws) == 1, f"{kind} wheels: {names}" + ("" if len(ws) == 1 else " (need exactly one)")))
    others = [w.name for w in found if not any(w in ws for ws in by_kind.values())]
    if others:
        out.append((False, f"unexpected wheels (pip would install them too): {', '.join(others)}"))
    total = sum(p.stat().st_size for p in wheels.rglob("*") if p.is_file())
    out.append((total <= LIMIT, f"size: {total / 2**20:.1f} MiB in {wheels} (limit {LIMIT // 2**20} MiB)"))
    sums = wheels / "SHA256SUMS"
    if sums.is_file():
        listed = dict(reversed(line.split(maxsplit=1)) for line in sums.read_text().splitlines() if line.strip())
        bad = [w.name for w in found if listed.get(w.name) != _sha256(w)]
        missing = sorted(set(listed) - {w.name for w in found})
        ok = not bad and not missing
        detail = "match" if ok else f"mismatch: {', '.join(bad + missing)}"
        out.append((ok, f"SHA256SUMS: {detail}"))
    else:
        out.append((False, "SHA256SUMS: missing; run benchmarks/device/fetch_wheels.sh"))
    if len(by_kind["gradguard"]) == 1:
        carried, tree = wheel_files(by_kind["gradguard"][0]), tree_files(repo)
        differ = sorted(name for name in set(carried) | set(tree) if carried.get(name) != tree.get(name))
        if differ:
            shown = ", ".join(differ[:5]) + (f" (+{len(differ) - 5} more)" if len(differ) > 5 else "")
            out.append(
                (False, f"gradguard wheel is stale: {shown} differ from the working tree; rerun fetch_wheels.sh")
            )
        else:
            out.append((True, f"gradguard wheel matches the working tree ({len(tree)} files)"))
    return out


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: check_wheels.py [WHEELS_DIR]  (default: .whl in the repository)", file=sys.stderr)
        return 2
    wheels = Path(argv[0]) if argv else REPO / ".whl"
    findings = check(wheels)
    for ok, line in findings:
        print(f"{'ok  ' if ok else 'FAIL'} {line}")
    return 0 if all(ok for ok, _ in findings) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
