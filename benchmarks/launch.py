"""What ``gradguard run`` costs a command: the launcher itself, and the bootstrap in every process.

``python -m benchmarks.launch [--json PATH] [--md PATH]`` (from the repository root). Two costs:

* ``gradguard run`` itself, a process that starts the command, waits for it and merges the reports:
  ``gradguard run noop.py`` against ``python noop.py``. The budget: ≤ 200 ms more. The launcher
  imports neither torch nor the watch, so this is an interpreter's start-up and the launcher's own
  modules.
* The bootstrap: ``gradguard run`` puts ``gradguard/_launch/bootstrap`` first on ``PYTHONPATH`` of
  every process a command starts, so every Python process pays for its ``sitecustomize.py`` at
  start-up, torch or not (Ray starts several helper processes, a launcher its agent, multiprocessing
  a resource tracker). The budget: ≤ 20 ms more than without, for a process that never imports torch
  (``python -c pass``). ``python -c "import torch"`` (fewer rounds; information) shows what arming
  gradguard adds to a process that does import torch (gradguard's import, ``enforce()``, the watch,
  the first report).

gradguard is byte-compiled first, as ``pip install`` leaves it. Each round starts both sides of a case
in a fresh interpreter, back to back, the order alternating between rounds: without gradguard (the
caller's environment), and with it (armed: the bootstrap first on ``PYTHONPATH`` and
``GRADGUARD_REPORT_DIR`` set; or the command under ``gradguard run``, the console script beside this
interpreter, with ``--report-dir`` a folder of the benchmark's own). The verdict is *paired*: the median
over rounds of the within-round difference (the machine changes speed within seconds, which
independent medians can mix).
"""

from __future__ import annotations

import os
import sys

if not __package__:  # `python benchmarks/launch.py`: import from the repository root instead
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import compileall  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from gradguard._launch._settings import BOOTSTRAP, REPORT_DIR, RUN_ID, python_path  # noqa: E402
from gradguard._policy import table as _table  # noqa: E402
from gradguard._tools.bench.machine import measuring  # noqa: E402
from gradguard._tools.bench.report import write_json  # noqa: E402

__all__ = ["main", "measure"]

BUDGET_MS = {"gradguard run": 200.0, "pass": 20.0}
CASES = {"gradguard run": ("noop.py",), "pass": ("-c", "pass"), "import torch": ("-c", "import torch")}


def _environments(report_dir: str) -> tuple[dict[str, str], dict[str, str]]:
    bare = {k: v for k, v in os.environ.items() if k not in (REPORT_DIR, RUN_ID)}
    armed = dict(bare, PYTHONPATH=python_path(bare.get("PYTHONPATH")), **{REPORT_DIR: report_dir})
    return bare, armed


def _launcher() -> list[str]:
    """``gradguard`` as a user runs it: the console script beside this interpreter (else ``-m gradguard``)."""
    script = shutil.which("gradguard", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "gradguard"]


def _started(argv: Sequence[str], environ: dict[str, str], cwd: str) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=environ, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _sides(case: str, folder: str) -> tuple[tuple[list[str], dict[str, str]], tuple[list[str], dict[str, str]]]:
    """``((argv, environment) without gradguard, (argv, environment) with it)`` for ``case``."""
    argv = [sys.executable, *CASES[case]]
    bare_env, armed_env = _environments(folder)
    if case == "gradguard run":
        return (argv, bare_env), ([*_launcher(), "run", "--report-dir", folder, *argv[1:]], bare_env)
    return (argv, bare_env), (argv, armed_env)


def measure(case: str, rounds: int) -> dict[str, Any]:
    """The paired figures of one case (see the module documentation)."""
    with tempfile.TemporaryDirectory(prefix="gradguard-bench-launch-") as folder:
        work = os.path.join(folder, "work")
        os.mkdir(work)
        with open(os.path.join(work, "noop.py"), "w") as f:
            f.write("pass\n")
        reports_dir = os.path.join(folder, "reports")
        (bare_argv, bare_env), (armed_argv, armed_env) = _sides(case, reports_dir)
        _started(bare_argv, bare_env, work), _started(armed_argv, armed_env, work)  # warm the file cache
        bare: list[float] = []
        armed: list[float] = []
        for r in range(rounds):
            sides = ((bare, bare_argv, bare_env), (armed, armed_argv, armed_env))
            for times, argv, environ in sides if r % 2 == 0 else sides[::-1]:
                times.append(_started(argv, environ, work))
        reports = len(os.listdir(reports_dir)) if os.path.isdir(reports_dir) else 0
    diffs = [a - b for a, b in zip(armed, bare)]
    shown = ["gradguard", "run", *CASES[case]] if case == "gradguard run" else ["python", *CASES[case]]
    return {
        "case": case,
        "command": shlex.join(shown),
        "rounds": rounds,
        "bare_median_ms": statistics.median(bare) * 1e3,
        "bare_best_ms": min(bare) * 1e3,
        "armed_median_ms": statistics.median(armed) * 1e3,
        "armed_best_ms": min(armed) * 1e3,
        "paired_median_ms": statistics.median(diffs) * 1e3,
        "paired_quartiles_ms": [q * 1e3 for q in statistics.quantiles(diffs, n=4)] if rounds >= 4 else None,
        "reports_written": reports,
        "budget_ms": BUDGET_MS.get(case),
    }


def _rows(doc: dict[str, Any]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    header = ("command", "rounds", "without (median)", "with gradguard (median)", "paired difference", "budget")
    rows = []
    for e in doc["cases"]:
        budget = "(info)"
        if e["budget_ms"] is not None:
            ok = e["paired_median_ms"] <= e["budget_ms"]
            budget = f"≤ {e['budget_ms']:.0f} ms {'✓' if ok else '✗'}"
        rows.append(
            (
                f"`{e['command']}`",
                str(e["rounds"]),
                f"{e['bare_median_ms']:.1f} ms",
                f"{e['armed_median_ms']:.1f} ms",
                f"{e['paired_median_ms']:+.1f} ms",
                budget,
            )
        )
    return header, rows


def text(doc: dict[str, Any]) -> str:
    header, rows = _rows(doc)
    return _table.text(header, rows)


def markdown(doc: dict[str, Any]) -> str:
    header, rows = _rows(doc)
    return (
        "# gradguard run — what the launcher and the bootstrap add, CPU\n\n"
        f"Machine: {doc['machine_line']}\n\n"
        f"`{doc['settings']['command']}` ({doc['settings']['elapsed_s']} s)\n\n"
        f"{_METHOD}\n\n{_table.markdown(header, rows)}\n"
    )


_METHOD = (
    "gradguard byte-compiled, as `pip install` leaves it. Each round starts both sides of a case in fresh "
    "interpreters, back to back (the order alternating): without gradguard, and with it. `gradguard run noop.py` "
    "(the console script, `--report-dir` a folder of the benchmark's own) against `python noop.py` (a file "
    "holding `pass`): what the launcher adds to every command. `python -c ...` with `gradguard/_launch/bootstrap` "
    "first on `PYTHONPATH` and `GRADGUARD_REPORT_DIR` set, as `gradguard run` starts every process, against "
    "without: what the bootstrap adds to each process. *Paired difference*: the median over rounds of the "
    "within-round difference of wall time (start to exit). `import torch` shows what arming adds to a process "
    "that imports torch: gradguard's import, `enforce()`, the watch and the first report."
)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.launch", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--rounds", type=int, default=41, help="paired rounds of `gradguard run` and `python -c pass` (default 41)"
    )
    p.add_argument("--torch-rounds", type=int, default=7, help="paired rounds of `import torch` (default 7)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 5 and 1 rounds")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--md", metavar="PATH")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.torch_rounds = 5, 1
    # as pip installs it: byte-compiled (under PYTHONDONTWRITEBYTECODE every start would compile it again)
    compileall.compile_dir(os.path.dirname(os.path.dirname(BOOTSTRAP)), quiet=1)  # the package, the bootstrap in it
    with measuring("cpu") as (facts, line):
        t0 = time.perf_counter()
        cases = [measure("gradguard run", args.rounds), measure("pass", args.rounds)]
        if args.torch_rounds:
            cases.append(measure("import torch", args.torch_rounds))
        settings = {
            "command": shlex.join(["python", "-m", "benchmarks.launch", *(sys.argv[1:] if argv is None else argv)]),
            "rounds": args.rounds,
            "torch_rounds": args.torch_rounds,
            "elapsed_s": round(time.perf_counter() - t0, 1),
        }
    doc = {"machine": facts, "machine_line": line, "settings": settings, "cases": cases}
    print()
    print(text(doc))
    if args.json:
        write_json(args.json, doc)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
