"""The benchmark's verdicts, tables, markdown and plot.

Every case has its checks (:func:`verdicts`): ``(check, passed, detail)``, ``passed`` ``None`` where a
``--quick`` run is too short to judge a ratio (its figures are still shown). A miss is printed and
written as ``MISSED``, never dropped.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from gradguard._policy import table as _table
from gradguard._policy.message import human
from gradguard._watch.governor import SHARE

__all__ = ["COST_HEADER", "HEADER", "cost_rows", "floor_text", "markdown", "plot", "row", "row_text", "verdicts"]

MICRO_WITHIN = 4
"""The micro-batch by which a store filled from the first micro-batch is reported (the micro-batch clock's
first two searches, then a read of the holder by name one micro-batch later)."""

SAME_RATIO = 0.02
"""How far apart the library leak's ratios at its two run lengths may be: its cost does not grow with the run."""


def start_of(kind: str) -> int | None:
    """The step a leak case's leak starts at (``"leak from N"``), ``None`` for the other kinds."""
    return int(kind.rsplit(" ", 1)[1]) if kind.startswith("leak from") else None


def _slope(values: Sequence[int]) -> float:
    """Least-squares bytes per step."""
    n = len(values)
    if n < 2:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den


def _rate(n: float) -> str:
    """A signed byte rate: ``+1.5 MiB``, ``-384 B``."""
    return ("-" if n < 0 else "+") + human(int(abs(n)))


def verdicts(entry: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """``(check, passed, detail)`` per target this benchmark proves for ``entry``; ``passed`` is ``None``
    for a ratio a quick run does not judge."""
    if entry["kind"] in ("cost", "library leak"):
        return _cost_verdicts(entry)
    w, plain = entry["watched"], entry["unwatched"]
    start = start_of(entry["kind"])
    checks: list[tuple[str, bool | None, str]] = []
    if start is not None and entry.get("unit") == "micro-batch":
        reported = w["reported_at"]
        a_step = w.get("micro_batches_a_step")
        checks.append(
            (
                f"reported in its first step, by micro-batch {MICRO_WITHIN}",
                reported is not None and reported <= MICRO_WITHIN and (a_step is None or reported <= a_step),
                f"started at micro-batch {start}, reported at micro-batch {reported}",
            )
        )
    elif start is not None:
        reported = w["reported_at"]
        checks.append(
            (
                "reported within 3 boundaries of its start",
                reported is not None and reported - start <= 3 - (1 if start == 1 else 0),
                f"started at {start}, reported at {reported}",
            )
        )
    if start is not None:
        if reported is not None and w["steps"] >= reported + 20 and any(o == "repaired" for _, o in w["holders"]):
            tail = w["memory"][reported + 5 :]
            checks.append(
                (
                    "detach: memory stops growing within 5 boundaries of the report",
                    _slope(tail) < 0.1 * max(1.0, _slope(plain["memory"][start:])),
                    f"{_rate(_slope(tail))}/step after {reported + 5} vs {_rate(_slope(plain['memory'][start:]))}"
                    "/step unwatched",
                )
            )
        return checks
    checks.append(("clean: nothing reported", not w["holders"], str(w["holders"] or "none")))
    checks.append(
        (
            f"clean: share of the wall time after the start-up check <= {SHARE:.0%}",
            w["share_after_start"] <= SHARE,
            f"{w['share_after_start']:.3%}",
        )
    )
    checks.append(
        (
            "clean: <= 5 us of the watch's own time per boundary (its signals, memory readings aside)",
            w["boundary_us"] <= 5.0,
            f"{w['boundary_us']:.2f} us",
        )
    )
    checks.append(
        (
            "clean: <= 4 us of the watch's own time per backward for its root's stamp",
            w["stamp_us"] <= 4.0,
            f"{w['stamp_us']:.2f} us per backward",
        )
    )
    return checks


def _cost_verdicts(entry: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    target, n = entry["target"], len(entry["pairs"])
    judged = not entry.get("quick")
    each = ", ".join(f"{p['cpu']:.3f}" for p in entry["pairs"])
    each_wall = ", ".join(f"{p['wall']:.3f}" for p in entry["pairs"])
    checks: list[tuple[str, bool | None, str]] = [
        (
            f"CPU time watched / unwatched <= {target}x (median of {n} pairs)",
            entry["cpu"] <= target if judged else None,
            f"{entry['cpu']:.4f}x (each: {each})",
        ),
        (
            f"wall time watched / unwatched <= {target}x (median of {n} pairs)",
            entry["wall"] <= target if judged else None,
            f"{entry['wall']:.4f}x (each: {each_wall})",
        ),
    ]
    if "min_step_ms" in entry:
        checks.append(
            (
                f"a step of {entry['min_step_ms']:g} ms or more, unwatched",
                entry["step_ms"] >= entry["min_step_ms"],
                f"{entry['step_ms']:.2f} ms",
            )
        )
    if "micro_ms_range" in entry:
        low, high = entry["micro_ms_range"]
        checks.append(
            (
                f"a micro-batch of {low:g} to {high:g} ms, unwatched ({entry['micro_batches_a_step']} a step)",
                low <= entry["micro_ms"] <= high,
                f"{entry['micro_ms']:.2f} ms",
            )
        )
    if entry["kind"] == "library leak":
        holders = sorted({(h, o) for p in entry["pairs"] for h, o in p["watched"]["holders"]})
        reported = [p["watched"]["reported_at"] for p in entry["pairs"]]
        checks.append(
            (
                "library leak reported, left as it is",
                bool(holders) and all(r is not None for r in reported),
                f"reported at {reported}: {holders or 'nothing'}",
            )
        )
        shorter = entry.get("shorter")
        if shorter is not None:
            for clock in ("cpu", "wall"):
                gap = entry[clock] - shorter[clock]
                checks.append(
                    (
                        f"{clock} ratio at {entry['steps']} steps within {SAME_RATIO} of {shorter['steps']} steps'",
                        abs(gap) <= SAME_RATIO if judged else None,
                        f"{entry[clock]:.4f}x vs {shorter[clock]:.4f}x",
                    )
                )
    return checks


def _mark(passed: bool | None) -> str:
    return "ok" if passed else "not judged (quick run)" if passed is None else "MISSED"


def row_text(entry: dict[str, Any]) -> str:
    """One line per case: its checks."""
    checks = "; ".join(f"{_mark(ok)} {c}: {d}" for c, ok, d in verdicts(entry))
    return f"  {entry['case']}: {checks}"


HEADER = (
    "case",
    "step",
    "leak from",
    "reported at",
    "outcome",
    "memory/step unwatched",
    "memory/step detach, 5 after the report",
    "share after start-up",
    "us per root stamp",
    "us per boundary",
    "us of memory reading per boundary",
    "heap searches per 1000 steps",
    "wall vs unwatched",
)


def row(entry: dict[str, Any]) -> tuple[str, ...]:
    """A leak or clean case's row of :data:`HEADER`."""
    w, plain = entry["watched"], entry["unwatched"]
    start = start_of(entry["kind"])
    step_ms = 1e3 * plain["wall_s"] / plain["steps"]
    if start is not None:
        after = (w["reported_at"] or w["steps"]) + 5
        return (
            entry["case"],
            f"{step_ms:.2f} ms",
            str(start),
            str(w["reported_at"]) if w["reported_at"] is not None else "—",
            ", ".join(sorted({o for _, o in w["holders"]})) or "—",
            f"{_rate(_slope(plain['memory'][start - 1 :]))}",
            f"{_rate(_slope(w['memory'][after:]))}" if w["steps"] > after + 2 else "—",
            *("",) * 6,
        )
    return (
        entry["case"],
        f"{step_ms:.2f} ms",
        "clean",
        "—",
        "—",
        "—",
        "—",
        f"{w['share_after_start']:.3%}",
        f"{w['stamp_us']:.2f}",
        f"{w['boundary_us']:.2f}",
        f"{w['read_us']:.2f}",
        f"{1000 * max(0, w['searches']) / w['steps']:.1f}",
        f"{w['wall_s'] / plain['wall_s']:.3f}×",
    )


COST_HEADER = (
    "case",
    "steps",
    "step",
    "CPU ratio",
    "wall ratio",
    "target",
    "reported at",
    "outcomes",
    "audits",
    "searches",
    "own share",
    "extra CPU per step",
    "the same, start-up aside",
    "us per root stamp",
    "us per boundary",
    "us of memory reading per boundary",
)


def cost_rows(entries: Sequence[dict[str, Any]], floor: dict[str, float] | None) -> list[tuple[str, ...]]:
    """The cost cases' rows of :data:`COST_HEADER` (the watched runs' figures: their medians; the
    reports of the first), then the floor's."""
    rows: list[tuple[str, ...]] = []
    for e in entries:
        if e["kind"] not in ("cost", "library leak"):
            continue
        ws = [p["watched"] for p in e["pairs"]]
        med = statistics.median
        w = ws[0]
        rows.append(
            (
                e["case"],
                str(e["steps"]),
                f"{e['step_ms']:.2f} ms",
                f"{e['cpu']:.4f}×",
                f"{e['wall']:.4f}×",
                f"≤ {e['target']}×",
                str(w["reported_at"]) if w["reported_at"] is not None else "—",
                ", ".join(sorted({o for x in ws for _, o in x["holders"]})) or "—",
                "/".join(str(x["audits"]) for x in ws),
                "/".join(str(x["searches"]) for x in ws),
                f"{med([x['own_share'] for x in ws]):.3%}",
                f"{e['extra_us']:.1f} us",
                f"{e['extra_us_after_start']:.1f} us",
                f"{med([x['stamp_us'] for x in ws]):.2f}",
                f"{med([x['boundary_us'] for x in ws]):.2f}",
                f"{med([x['read_us'] for x in ws]):.2f}",
            )
        )
    if floor is not None:
        rows.append(
            ("floor (unwatched)", str(floor["steps"]), "", "", "", "", "", "", "", "", "", "", "",
             f"{floor['stamp_us']:.2f} (+{floor['token_us']:.2f} a step for its stamp)",
             f"{floor['signals_us']:.2f}", "")
        )  # fmt: skip
    return rows


def floor_text(figures: dict[str, float]) -> str:
    """The floor in words."""
    return (
        f"The floor (the fast step, unwatched, {figures['steps']} steps): one root's stamp (a fresh loss's "
        f"grad_fn read, one shared token put in its metadata) {figures['stamp_us']:.2f} us, and making each "
        f"step's token (a weakly referenced object, appended to the books) {figures['token_us']:.2f} us a step; "
        f"the boundary's "
        f"barest signals (torch's node counter, 4 parameters' use counts, one weak reference) "
        f"{figures['signals_us']:.2f} us."
        + (
            f" One point of the watch's timeline (a boundary of either clock, its folding amortized): "
            f"{figures['timeline_us']:.2f} us."
            if "timeline_us" in figures
            else ""
        )
        + (
            f" One search of the heap for a holder ({figures['objects']} objects tracked by the collector: one pass "
            f"keeping the tensors, one gc.get_referrers pass), at least: {figures['search_ms']:.1f} ms."
            if "search_ms" in figures
            else ""
        )
    )


def _summaries(entries: Sequence[dict[str, Any]]) -> str:
    lines = []
    for e in entries:
        w = e["pairs"][0]["watched"] if "pairs" in e else e["watched"]
        lines.append(f"- {e['case']}: `{w['summary'].splitlines()[0]}`")
    return "\n".join(lines)


def markdown(doc: dict[str, Any], intro: str) -> str:
    """The results as markdown: the machine line, the command, ``intro``, the tables, every check, the
    floor and each watched run's summary line."""
    leaks = [e for e in doc["cases"] if e["kind"] not in ("cost", "library leak")]
    table = _table.markdown(HEADER, [row(e) for e in leaks])
    cost = _table.markdown(COST_HEADER, cost_rows(doc["cases"], doc.get("floor")))
    checks = "\n".join(
        f"- {e['case']}: {'**MISSED**' if ok is False else _mark(ok)} {c} ({d})"
        for e in doc["cases"]
        for c, ok, d in verdicts(e)
    )
    return (
        f"# The watch under its defaults — {doc['device']}\n\n"
        f"Machine: {doc['machine_line']}\n\n"
        f"`{doc['settings']['command']}` ({doc['settings']['elapsed_s']} s)\n\n"
        f"{intro}\n{table}\n\n"
        f"What the watch costs, side by side ({doc['settings']['rounds']} rounds of an unwatched and a watched "
        f"run, alternating; ratios: the median pair's, watched over unwatched; the watched runs' figures by "
        f"the watch's own account, audits and searches per run; the extra CPU time per step, the median pair's, "
        f"and the same with the start-up check's seconds taken off: what a longer run pays a step):\n\n{cost}\n\n"
        f"{checks}\n"
        + (f"\n{floor_text(doc['floor'])}\n" if "floor" in doc else "")
        + f"\nThe watch's summary line of each case (its first watched run):\n\n{_summaries(doc['cases'])}\n"
    )


def plot(doc: dict[str, Any], path: str) -> None:
    """Memory after each step, unwatched and under ``detach``, for each leak; the leak's start and report."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    leaks = [e for e in doc["cases"] if start_of(e["kind"]) is not None]
    fig, axes = plt.subplots(len(leaks), 1, figsize=(9, 2.6 * len(leaks)), squeeze=False)
    for ax, e in zip(axes[:, 0], leaks):
        for side, label in (("unwatched", "unwatched"), ("watched", "watch(mode='detach')")):
            values = e[side]["memory"]
            ax.plot(range(1, len(values) + 1), [(v - values[0]) / 2**20 for v in values], label=label)
        ax.axvline(start_of(e["kind"]), color="grey", linestyle=":", label="the leak starts")
        reported = e["watched"]["reported_at"]
        if reported is not None:
            ax.axvline(reported, color="red", linestyle="--", label="reported")
        ax.set_title(e["case"], fontsize=9)
        ax.set_ylabel("MiB since step 1")
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
