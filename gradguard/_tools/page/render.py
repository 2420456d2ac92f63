"""The page and the PNG written from a run's process reports (see the package's docstring)."""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Sequence
from typing import Any

from ..._errors import GradGuardError
from ..._policy.message import human, nodes_text
from .chain import chains
from .plot import colour, curves, svg

__all__ = ["Process", "html_page", "png_plot", "require"]

_NEEDS = {
    "--html": ("jinja2", "pip install 'gradguard[report]' (Jinja2)"),
    "--png": ("matplotlib", "pip install 'gradguard[report]' matplotlib, or 'gradguard[bench]'"),
}


@dataclasses.dataclass(frozen=True)
class Process:
    """One process of the run, as the page shows it.

    Attributes:
        label: How the summary names it.
        report: Its report's record (a ``ProcessReport``: ``argv``, ``host``, ``pid``, ``rank``, ``top``,
            ``figures``, ``holders``, ``timeline``, ``platform``, ``mode``).
    """

    label: str
    report: Any


def require(flag: str) -> None:
    """Check that what ``flag`` needs is installed, before anything runs.

    Args:
        flag: ``"--html"`` or ``"--png"``.

    Raises:
        GradGuardError: it is missing: the message names the package and how to install it.
    """
    import importlib.util

    module, install = _NEEDS[flag]
    if importlib.util.find_spec(module) is None:
        raise GradGuardError(f"{flag} needs {module}, which is not installed: {install}")


def _processes(processes: Sequence[Process]) -> list[tuple[str, Any, Any]]:
    return [(p.label, p.report.timeline, p.report.holders) for p in processes]


def _holders(processes: Sequence[Process]) -> list[dict[str, Any]]:
    """One row per holder (merged over the processes that had it), the leaking ones first, each with its
    retainer chain (a link's figures: the most any one of those processes kept through it)."""
    rows: dict[str, dict[str, Any]] = {}
    for p in processes:
        linked = chains(p.report.holders)
        for h in p.report.holders:
            row = rows.get(h.holder)
            if row is None:
                row = rows[h.holder] = {**dataclasses.asdict(h), "processes": [], "pinned": 0, "chain": []}
            row["chain"] = _most(row["chain"], linked[h.holder])
            row["processes"].append(p.label)
            row["pinned"] = max(row["pinned"], h.pinned_bytes)
            row["nodes"] = max(row["nodes"], h.nodes)
            row["survived"] = max(row["survived"], h.survived)
            if h.outcome == "raised" or row["outcome"] == "bounded":
                row["outcome"] = h.outcome
    for row in rows.values():
        for link in row["chain"]:
            link["pinned_text"] = human(link["pinned_bytes"])
            link["nodes_text"] = nodes_text(link["nodes"], link["node_bytes"])
        row["pinned_text"] = human(row["pinned"])
        row["released_text"] = human(row["released_bytes"]) if row["released_bytes"] else ""
        row["leaking"] = row["outcome"] != "bounded"
    return sorted(rows.values(), key=lambda r: (not r["leaking"], -r["pinned"], r["holder"]))


def _most(chain: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two processes' chains of one holder as one: each link's figures the larger of the two."""
    if not chain:
        return [dict(link) for link in other]
    for mine, theirs in zip(chain, other):
        for key in ("holders", "tensors", "pinned_bytes", "nodes", "node_bytes"):
            mine[key] = max(mine[key], theirs[key])
    return chain


def _context(processes: Sequence[Process], problems: Sequence[str], summary: str, folder: str) -> dict[str, Any]:
    made = curves(_processes(processes))
    top = next((p.report for p in processes if p.report.top), processes[0].report if processes else None)
    platform: dict[str, str] = {}
    for p in processes:
        for key, value in (p.report.platform or {}).items():
            platform.setdefault(key, value)
    hosts = sorted({p.report.host for p in processes})
    return {
        "svg": svg(made),
        "curves": [
            {
                "label": c.label,
                "colour": colour(i),
                "slope": human(int(max(c.slope, 0))) if c.slope >= 0 else f"-{human(int(-c.slope))}",
                "growth": human(int(abs(c.growth))),
                "falling": c.growth < 0,
                "flagged": c.flagged,
                "why": c.why,
                "points": len(c.points),
                "markers": len(c.markers),
            }
            for i, c in enumerate(made)
        ],  # fmt: skip
        "without_timeline": [p.label for p in processes if p.report.timeline is None],
        "holders": _holders(processes),
        "problems": list(problems),
        "summary": summary,
        "command": " ".join(top.argv) if top is not None else "",
        "mode": top.mode if top is not None else "",
        "platform": sorted(platform.items()),
        "hosts": hosts,
        "folder": folder,
        "processes": len(processes),
        "made": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
    }


def html_page(path: str, processes: Sequence[Process], problems: Sequence[str], summary: str, folder: str) -> None:
    """Write the page.

    Args:
        path: The HTML file.
        processes: The run's processes that reported.
        problems: A line per report file left out, naming it and why.
        summary: The run's merged summary (the text ``gradguard report`` prints).
        folder: The run folder.

    Raises:
        GradGuardError: Jinja2 is not installed.
        OSError: the file cannot be written.
    """
    require("--html")
    import jinja2

    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    text = environment.get_template("page.html.j2").render(**_context(processes, problems, summary, folder))
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(temporary, path)


def png_plot(path: str, processes: Sequence[Process]) -> None:
    """Write the page's plot as a PNG (matplotlib, without a display).

    Args:
        path: The PNG file.
        processes: The run's processes that reported.

    Raises:
        GradGuardError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    require("--png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = curves(_processes(processes))
    figure, axes = plt.subplots(figsize=(10, 4), dpi=120)
    styles = {"leak-start": ("^", "#d62728"), "report": ("s", "#ff7f0e"), "repair": ("D", "#2ca02c")}
    for i, c in enumerate(made):
        if not c.points:
            continue
        xs = [x for x, _, _ in c.points for _ in (0, 1)]
        ys = [y for _, low, high in c.points for y in (low, high)]
        axes.plot(xs, [y / 2**20 for y in ys], color=colour(i), linewidth=2.0 if c.flagged else 1.2,
                  label=c.label + (f" ({c.why})" if c.why else ""))  # fmt: skip
        for m in c.markers:
            marker, fill = styles[m.kind]
            y = (m.memory if m.memory is not None else min(ys)) / 2**20
            axes.plot([m.x], [y], marker=marker, color=fill, markeredgecolor="black", markersize=8, linestyle="")
    for kind, (marker, fill) in styles.items():
        axes.plot([], [], marker=marker, color=fill, markeredgecolor="black", linestyle="", label=kind)
    axes.set_xlabel("step (micro-batches inside each step)")
    axes.set_ylabel("memory (MiB)")
    axes.set_title("gradguard: memory per process")
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    temporary = f"{path}.{os.getpid()}.tmp.png"
    figure.savefig(temporary)
    plt.close(figure)
    os.replace(temporary, path)
