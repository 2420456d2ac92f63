"""``python -m benchmarks.versus --base REV``: the watch's cost, this tree's and ``REV``'s, side by side in one run.

Each round runs ``python -m benchmarks.watch --only cost/ --only storm/ --rounds 1`` once with this tree's
gradguard and once with ``REV``'s (a worktree of this repository at that commit), each in a fresh process,
the order alternating from round to round; both use this tree's benchmark code, so the programs measured
are the same. Each run gives one pair (the program unwatched, then watched) per case; the table gives each
case's watched-over-unwatched ratios, CPU and wall, as the median of the rounds, for both trees, and the
watch's own share of the time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradguard._policy import table
from gradguard._tools.bench.machine import measuring
from gradguard._tools.bench.report import write_json

__all__ = ["main", "portable"]

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
_CASES = ("cost/", "storm/")


def _run(tree: Path, scratch: Path, out: Path, extra: Sequence[str]) -> dict[str, Any]:
    """One run of the cost cases with ``tree``'s gradguard (this tree's benchmark code); its document."""
    command = [sys.executable, "-m", "benchmarks.watch", "--rounds", "1", "--json", str(out), *extra]
    for prefix in _CASES:
        command += ["--only", prefix]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    probe = subprocess.run(
        [sys.executable, "-c", "import gradguard; print(gradguard.__file__)"], cwd=scratch, env=env,
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    where = Path(probe.stdout.strip()).resolve()
    if not where.is_relative_to(tree.resolve()):
        raise SystemExit(f"benchmarks.versus: {tree} would not run its own gradguard (it imports {where})")
    subprocess.run(command, cwd=scratch, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


def portable(command: str, scratch: Path | None = None) -> str:
    """``command`` as the committed results say it: ``scratch`` (a run's temporary folder) as ``<scratch>``, a
    path in this repository relative to it, and any other absolute path as ``<scratch>/`` and its name (the
    results name no folder of the machine that produced them)."""
    if scratch is not None:
        command = command.replace(str(scratch), "<scratch>")
    words = []
    for word in command.split(" "):
        if word.startswith("/"):
            path = Path(word)
            word = str(path.relative_to(_ROOT)) if path.is_relative_to(_ROOT) else f"<scratch>/{path.name}"
        words.append(word)
    return " ".join(words)


def _summary(docs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per case: the ratios of each round's pair, their medians, and the watched runs' own share."""
    cases: dict[str, dict[str, Any]] = {}
    for doc in docs:
        for entry in doc["cases"]:
            got = cases.setdefault(entry["case"], {"target": entry["target"], "cpu": [], "wall": [], "share": []})
            got["cpu"].append(entry["cpu"])
            got["wall"].append(entry["wall"])
            got["share"].append(entry["pairs"][0]["watched"]["own_share"])
    for got in cases.values():
        for key in ("cpu", "wall", "share"):
            got[f"{key}_median"] = statistics.median(got[key])
    return cases


def main(argv: Sequence[str] | None = None) -> int:
    """Run both trees' cost cases round by round; print and write the side-by-side table. Returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.versus", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit to compare with (any git revision)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--md", metavar="PATH")
    p.add_argument("extra", nargs="*", help="more arguments for benchmarks.watch (after --)")
    args = p.parse_args(argv)
    rev = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="gradguard-versus-"))
    base = work / "base"
    scratch = work / "scratch"
    scratch.mkdir()
    (scratch / "benchmarks").symlink_to(_HERE, target_is_directory=True)
    subprocess.run(["git", "worktree", "add", "--detach", str(base), rev], cwd=_ROOT, check=True, capture_output=True)
    docs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
    try:
        with measuring("cpu") as (facts, line):
            t0 = time.perf_counter()
            for r in range(args.rounds):
                order = ("base", "head") if r % 2 == 0 else ("head", "base")
                for which in order:
                    tree = base if which == "base" else _ROOT
                    doc = _run(tree, scratch, work / f"{which}-{r}.json", args.extra)
                    doc["settings"]["command"] = portable(doc["settings"]["command"], work)
                    docs[which].append(doc)
                    print(f"round {r + 1}: {which} done", flush=True)
            elapsed = time.perf_counter() - t0
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=_ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    summary = {which: _summary(runs) for which, runs in docs.items()}
    header = ("case", "target", f"cpu {rev}", f"cpu {head}", f"wall {rev}", f"wall {head}",
              f"own share {rev}", f"own share {head}")  # fmt: skip
    rows = []
    for case, now in summary["head"].items():
        then = summary["base"].get(case)
        if then is None:
            continue
        rows.append((
            case, f"≤ {now['target']}×",
            f"{then['cpu_median']:.4f}×", f"{now['cpu_median']:.4f}×",
            f"{then['wall_median']:.4f}×", f"{now['wall_median']:.4f}×",
            f"{then['share_median']:.3%}", f"{now['share_median']:.3%}",
        ))  # fmt: skip
    text = table.text(header, rows)
    print(line)
    print(text)
    doc = {
        "machine": facts,
        "machine_line": line,
        "settings": {
            "command": portable(" ".join(["python -m benchmarks.versus", *(sys.argv[1:] if argv is None else argv)])),
            "base": rev,
            "head": head,
            "rounds": args.rounds,
            "elapsed_s": round(elapsed, 1),
        },
        "cases": summary,
        "runs": docs,
    }
    if args.json:
        write_json(args.json, doc)
    if args.md:
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(f"# The watch's cost: {head} beside {rev}, in one run\n\n")
            f.write(__doc__.split("\n\n", 1)[1].strip().replace("``", "`") + "\n\n")
            f.write(f"Machine: {line}\n\nCommand: `{doc['settings']['command']}` ({args.rounds} rounds, ")
            f.write(f"{elapsed:.0f} s).\n\n")
            f.write("| " + " | ".join(header) + " |\n|" + "---|" * len(header) + "\n")
            for r in rows:
                f.write("| " + " | ".join(r) + " |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
