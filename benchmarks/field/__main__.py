"""The field benchmark: leaks that shipped in real libraries, and their fixed releases, under gradguard's defaults.

``python -m benchmarks.field [--cases KEY,...] [--steps N] [--json PATH] [--md PATH]`` (from the
repository root, with the project's environment active). Each release is installed in its own
virtual environment (``benchmarks/field/envs.py``; built on first use, under ``/work/field-envs`` or
``GRADGUARD_FIELD_ENVS``), and its driver (``benchmarks/field/drivers/``) runs five ways
(``benchmarks/field/runner.py``): plain, ``gradguard run --mode raise`` with no other flag,
``--mode detach``, ``--mode warn``, and ``--mode raise --audit-every 1`` as a diagnostic. The table
says, per release: what ``raise`` did (the exit status, the holder gradguard named, the step
boundary it was found at, or the store that refused), the memory a step adds (glibc in-use bytes
read after each optimizer step, least-squares slope) plain and under ``detach``, and whether
``warn``'s final weights are bitwise those of the plain run. A fixed
release must be silent; how many boundaries were audited is said beside it (silence without an audit
checks nothing).

gradguard is measured as committed: the runner exports ``gradguard/`` at ``--at`` (default ``HEAD``)
into a scratch folder that every run imports first, so edits in the working tree do not change a run
half-way; the commit goes into the results. ``--at WORKTREE`` imports the working tree as it is.

Each leak's *remedy* is the fix gradguard printed under the defaults, applied by the benchmark: the
driver's change on the user's side (``runner``'s ``remedy`` way) must make ``--mode raise`` pass, with
final weights bitwise those of the fixed release's plain run; where nothing on the user's side can fix
it, the remedy is upgrading, checked by the fixed release's own ``raise`` run. ``--site FOLDER`` runs
every release with this interpreter from ``FOLDER/<release>`` (``pip install --no-deps --target``, as
``.ci/run`` makes them) instead of a virtual environment of its own. Results name no path of this machine.
"""

from __future__ import annotations

import os
import sys

if not __package__:  # `python benchmarks/field/__main__.py`: import from the repository root instead
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from . import envs  # noqa: E402
from .cases import CASES, Case, by_key  # noqa: E402
from .runner import FIXED_WAYS, LEAKY_WAYS, portable, run_release, same_weights  # noqa: E402
from .verdict import markdown, verdict  # noqa: E402

__all__ = ["main", "measure"]


def snapshot(at: str, folder: Path) -> tuple[Path | None, str]:
    """``gradguard/`` as committed at ``at``, unpacked under ``folder`` (``None`` for the working tree),
    and what was measured: the commit, and the last commit that changed ``gradguard/`` before it
    (``+worktree`` for the working tree).

    Raises:
        RuntimeError: ``at`` names no commit of the repository.
    """

    def git(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(["git", "-C", str(envs.REPO), *args], capture_output=True)

    if at == "WORKTREE":
        return None, git("rev-parse", "--short=12", "HEAD").stdout.decode().strip() + "+worktree"
    found = git("rev-parse", "--verify", f"{at}^{{commit}}")
    if found.returncode:
        raise RuntimeError(f"--at {at!r} names no commit here ({found.stderr.decode().strip()}); give one or WORKTREE")
    commit = found.stdout.decode().strip()
    archive = git("archive", commit, "gradguard")
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    changed = git("log", "-1", "--format=%h", commit, "--", "gradguard").stdout.decode().strip()
    return folder, f"{commit[:12]} (gradguard/ last changed in {changed})"


def measure(
    case: Case, steps: int | None, timeout: float, source: Path | None = None, site: Path | None = None
) -> dict[str, Any]:
    """Both releases of ``case``, every way, with the verdicts and the remedy's.

    ``site``: a folder holding each release unpacked (``<site>/<release>``), run with this interpreter;
    ``None``: each release in its own virtual environment (:func:`envs.ensure`).
    """
    print(f"{case.key}: building or reusing the environments", flush=True)
    result: dict[str, Any] = {
        "case": case.key, "library": case.library, "holder_words": case.holder, "fixed_by": case.fixed_by,
        "expect": case.expect, "remedy_by": case.remedy,
    }  # fmt: skip
    weights = {}
    for side, release in (("leaky", case.leaky), ("fixed", case.fixed)):
        path = [source] if source is not None else []
        if site is not None:
            python, path = Path(sys.executable), [*path, site / release.name]
        else:
            python = envs.ensure(release)
        ways = LEAKY_WAYS if side == "leaky" and case.remedy == "driver" else FIXED_WAYS
        result[side] = run_release(python, case, release, steps=steps, timeout=timeout, pythonpath=path, ways=ways)
        weights[side] = result[side].pop("weights")
        result[side]["verdict"] = verdict(case, result[side], leaky=side == "leaky")
    if case.remedy == "driver":
        applied = result["leaky"]["runs"]["remedy"]
        same = same_weights(weights["leaky"].get("remedy"), weights["fixed"].get("plain"))
    else:
        applied, same = result["fixed"]["runs"]["raise"], None
    result["remedy"] = {
        "by": case.remedy, "exit": applied["returncode"], "holders": len(applied["holders"]),
        "error": applied["error"], "weights_equal_fixed_plain": same,
    }  # fmt: skip
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.field", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(c.key for c in CASES), help="comma-separated case keys")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: each driver's)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--md", default=None, help="write the table as Markdown here")
    parser.add_argument("--at", default="HEAD", help="the gradguard commit to measure (default HEAD), or WORKTREE")
    parser.add_argument("--site", default=None, help="a folder of releases unpacked with pip --target (see .ci/run)")
    args = parser.parse_args(argv)
    try:
        cases = [by_key(k.strip()) for k in args.cases.split(",") if k.strip()]
    except KeyError as exc:
        parser.error(str(exc.args[0]))
    given = list(argv if argv is not None else sys.argv[1:])
    if args.site:  # the folder as the CI names it, not as this machine does
        given = [
            "$GRADGUARD_FIELD_SITE" if a == args.site else a.replace(args.site, "$GRADGUARD_FIELD_SITE") for a in given
        ]
    command = "python -m benchmarks.field " + " ".join(a if a.startswith("$") else shlex.quote(a) for a in given)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gradguard-field-src-") as folder:
        try:
            source, commit = snapshot(args.at, Path(folder))
        except RuntimeError as exc:
            parser.error(str(exc))
        if source is not None:
            sys.path.insert(0, str(source))  # the machine line's gradguard version: the measured one
        from gradguard._tools.bench.machine import measuring
        from gradguard._tools.bench.report import write_json

        with measuring() as (facts, line):
            site = Path(args.site).resolve() if args.site else None
            results = [measure(case, args.steps, args.timeout, source, site) for case in cases]
    elapsed = round(time.perf_counter() - start, 1)
    installed = "site" if args.site else "venv"  # where the releases came from: folders of one interpreter, or venvs
    settings = {
        "command": command.strip(), "steps": args.steps, "gradguard_commit": commit, "elapsed_s": elapsed,
        "installed": installed,
    }  # fmt: skip
    site = Path(args.site).resolve() if args.site else None
    releases = [site / r.name for c in cases for r in (c.leaky, c.fixed)] if site is not None else []
    roots = [Path(folder), Path(folder).resolve(), *releases]
    doc = portable({"machine": facts, "machine_line": line, "settings": settings, "cases": results}, roots)
    text = markdown(doc)
    print(text)
    if args.json:
        write_json(args.json, doc)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
