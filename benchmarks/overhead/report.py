"""The benchmark's outputs: one JSON document per run, and the text and Markdown tables read from it.

:func:`entry` turns one measured case into its JSON entry; :func:`document` assembles the run;
:func:`text` and :func:`markdown` read nothing but that document, so every figure a table shows is
in the JSON. Tables go through :mod:`gradguard._policy.table`, the machine line through
:mod:`gradguard._tools.bench.machine`, as for ``gradguard bench`` and ``stats()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradguard._policy import table as _table

from .cases import DECIDE, DELTA_US, INFO, RATIO, SHARE, Case, StepTime
from .timing import Paired, Side

__all__ = ["DOCUMENT_FIELDS", "ENTRY_FIELDS", "SCHEMA", "SHARE_FIELDS", "document", "entry", "markdown", "text"]

SCHEMA = 1
#: the keys of the document, of each case's entry, and of a share case's ``share``
DOCUMENT_FIELDS = ("schema", "machine", "machine_line", "settings", "cases", "skipped", "budgets_met")
ENTRY_FIELDS = (
    "name", "group", "kind", "target", "candidate", "baseline", "rounds", "candidate_us", "baseline_us", "paired",
    "medians", "best_rounds", "share", "decision", "value", "passed",
)  # fmt: skip
SHARE_FIELDS = (
    "scenario", "calls_per_microbatch", "publishes_per_microbatch", "micro_batches", "step_median_ms",
    "step_best_ms", "cost_per_microbatch_us", "share", "share_on_best_step",
)  # fmt: skip
BUDGETS = (RATIO, DELTA_US, SHARE)

METHOD = (
    "Each round times a batch of calls of each side back to back (order alternating, gc disabled while "
    "timing, torch on one thread; calls per batch calibrated so a batch lasts about {batch_ms:g} ms). "
    "*paired* (the verdict): the median over {rounds} rounds of the within-round ratio gradguard / baseline; "
    "a µs figure is that ratio's excess times the baseline's fastest round. *medians*: each side's own "
    "median over rounds; *best rounds*: each side's fastest round. The µs columns are each side's median."
)


def _side(side: Side) -> dict[str, Any]:
    return {"median": side.median, "best": side.best, "iqr_rel": side.iqr_rel, "calls_per_batch": side.calls_per_batch}


def entry(case: Case, paired: Paired, step: StepTime | None = None) -> dict[str, Any]:
    """One case's JSON entry: both sides, the three comparisons, and the verdict."""
    p25, p75 = paired.ratio_quartiles
    out: dict[str, Any] = {
        "name": case.name,
        "group": case.group,
        "kind": case.kind,
        "target": case.target,
        "candidate": case.candidate_label,
        "baseline": case.baseline_label,
        "rounds": paired.rounds,
        "candidate_us": _side(paired.candidate),
        "baseline_us": _side(paired.baseline),
        "paired": {"ratio": paired.ratio, "ratio_p25": p25, "ratio_p75": p75, "delta_us": paired.delta_us},
        "medians": {"ratio": paired.medians_ratio, "delta_us": paired.medians_delta_us},
        "best_rounds": {"ratio": paired.best_ratio, "delta_us": paired.best_delta_us},
        "share": None,
        "decision": None,
    }
    if case.kind == SHARE:
        if step is None or case.share is None:
            raise ValueError(f"share case {case.name!r} needs its scenario's step time")
        calls = case.share.calls_per_microbatch
        cost = calls * paired.delta_us
        out["share"] = {
            "scenario": step.scenario,
            "calls_per_microbatch": calls,
            "publishes_per_microbatch": step.publishes_per_microbatch,
            "micro_batches": step.micro_batches,
            "step_median_ms": step.median_s * 1e3,
            "step_best_ms": step.best_s * 1e3,
            "cost_per_microbatch_us": cost,
            "share": cost / (step.median_s * 1e6),
            "share_on_best_step": cost / (step.best_s * 1e6),
        }
        value = out["share"]["share"]
    elif case.kind == DELTA_US:
        value = paired.delta_us
    elif case.kind == DECIDE:
        value = 1.0 / paired.ratio - 1.0  # what the candidate saves: the baseline's excess over it
    else:
        value = paired.ratio
    out["value"] = value
    if case.kind in BUDGETS:
        assert case.target is not None
        out["passed"] = bool(value <= case.target)
    else:
        out["passed"] = None
    if case.kind == DECIDE:
        assert case.target is not None
        out["decision"] = "keep" if value > case.target else "drop"
    return out


def document(
    entries: Sequence[dict[str, Any]],
    skipped: Sequence[tuple[str, str]],
    settings: dict[str, Any],
    machine: dict[str, Any],
    machine_line: str,
) -> dict[str, Any]:
    """The run as one JSON-serialisable dict."""
    return {
        "schema": SCHEMA,
        "machine": machine,
        "machine_line": machine_line,
        "settings": settings,
        "cases": list(entries),
        "skipped": [{"group": g, "reason": why} for g, why in skipped],
        "budgets_met": all(e["passed"] is not False for e in entries),
    }


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


def _us(x: float) -> str:
    return f"{x:.3g} µs" if abs(x) < 10 else f"{x:.1f} µs"


def _delta(x: float) -> str:
    return f"{x:+.2f} µs"


def _pct(x: float) -> str:
    return f"{100 * x:.3f}%"


def _target(e: dict[str, Any]) -> str:
    t = e["target"]
    if e["kind"] == RATIO:
        return f"≤ {t:g}×"
    if e["kind"] == DELTA_US:
        return f"≤ +{t:g} µs"
    if e["kind"] == SHARE:
        return f"≤ {100 * t:g}%"
    if e["kind"] == DECIDE:
        return f"keep if > {100 * t:g}%"
    return ""


def _mark(e: dict[str, Any]) -> str:
    return {True: "✓", False: "✗", None: ""}[e["passed"]]


def _paired(e: dict[str, Any]) -> str:
    if e["kind"] in (DELTA_US, SHARE):
        return f"{_delta(e['paired']['delta_us'])} ({e['paired']['ratio']:.2f}×)"
    return f"{e['paired']['ratio']:.3f}×"


def _other(e: dict[str, Any], which: str) -> str:
    if e["kind"] in (DELTA_US, SHARE):
        return _delta(e[which]["delta_us"])
    return f"{e[which]['ratio']:.3f}×"


def _sections(doc: dict[str, Any]) -> list[tuple[str, Sequence[str], list[list[str]]]]:
    """``(title, header, rows)`` of each table, in the order shown."""
    cases = doc["cases"]
    sections: list[tuple[str, Sequence[str], list[list[str]]]] = []
    shares = [e for e in cases if e["kind"] == SHARE]
    if shares:
        sections.append(
            (
                "gradguard's share of a micro-batch step (gradguard bench scenarios, CPU, default size)",
                (
                    "scenario",
                    "calls / micro-batch",
                    "cost per call over unguarded (paired)",
                    "median step",
                    "share",
                    "target",
                    "",
                    "share of the fastest step",
                ),
                [
                    [
                        e["share"]["scenario"],
                        f"{e['share']['calls_per_microbatch']} × {e['candidate']}",
                        _delta(e["paired"]["delta_us"]),
                        f"{e['share']['step_median_ms']:.2f} ms",
                        _pct(e["share"]["share"]),
                        _target(e),
                        _mark(e),
                        _pct(e["share"]["share_on_best_step"]),
                    ]
                    for e in shares
                ],
            )
        )
    budgets = [e for e in cases if e["kind"] in (RATIO, DELTA_US)]
    if budgets:
        sections.append(
            (
                "Budgets: per call, against the same work done by hand",
                ("case", "gradguard", "µs", "baseline", "µs", "paired", "target", "", "medians", "best rounds"),
                [
                    [
                        e["name"],
                        e["candidate"],
                        _us(e["candidate_us"]["median"]),
                        e["baseline"],
                        _us(e["baseline_us"]["median"]),
                        _paired(e),
                        _target(e),
                        _mark(e),
                        _other(e, "medians"),
                        _other(e, "best_rounds"),
                    ]
                    for e in budgets
                ],
            )
        )
    decisions = [e for e in cases if e["kind"] == DECIDE]
    if decisions:
        sections.append(
            (
                "The walk's inline scan of exact dict/list/tuple children against the general spec path",
                (
                    "case",
                    "fast path µs",
                    "spec path",
                    "µs",
                    "fast / spec (paired)",
                    "spec path costs more by",
                    "rule",
                    "verdict",
                    "medians",
                    "best rounds",
                ),
                [
                    [
                        e["name"],
                        _us(e["candidate_us"]["median"]),
                        e["baseline"],
                        _us(e["baseline_us"]["median"]),
                        _paired(e),
                        f"{100 * e['value']:+.1f}%",
                        _target(e),
                        e["decision"],
                        _other(e, "medians"),
                        _other(e, "best_rounds"),
                    ]
                    for e in decisions
                ],
            )
        )
    info = [e for e in cases if e["kind"] == INFO]
    if info:
        sections.append(
            (
                "Informational",
                ("case", "candidate", "µs", "baseline", "µs", "paired", "medians", "best rounds"),
                [
                    [
                        e["name"],
                        e["candidate"],
                        _us(e["candidate_us"]["median"]),
                        e["baseline"],
                        _us(e["baseline_us"]["median"]),
                        _paired(e),
                        _other(e, "medians"),
                        _other(e, "best_rounds"),
                    ]
                    for e in info
                ],
            )
        )
    return sections


def _summary(doc: dict[str, Any]) -> list[str]:
    lines = []
    missed = [e["name"] for e in doc["cases"] if e["passed"] is False]
    budgets = [e for e in doc["cases"] if e["passed"] is not None]
    lines.append(
        f"Budgets: {len(budgets) - len(missed)} of {len(budgets)} met"
        + (f"; missed: {'; '.join(missed)}" if missed else "")
    )
    for s in doc["skipped"]:
        lines.append(f"Not measured: {s['group']}: {s['reason']}")
    return lines


def text(doc: dict[str, Any]) -> str:
    """The run as plain-text tables, for the terminal."""
    out = [f"machine: {doc['machine_line']}"]
    for title, header, rows in _sections(doc):
        out += ["", title, _table.text(header, rows)]
    out += ["", *_summary(doc)]
    return "\n".join(out)


def markdown(doc: dict[str, Any]) -> str:
    """The run as Markdown: machine line, command, method, the tables, what was not measured."""
    settings = doc["settings"]
    out = [
        "# gradguard per-call overhead — CPU",
        "",
        f"Machine: {doc['machine_line']}"
        + (f"; load avg at the end {settings['load_avg_1min_end']}" if settings.get("load_avg_1min_end") else ""),
        "",
        f"`{settings['command']}` ({settings['elapsed_s']:.0f} s)",
        "",
        METHOD.format(batch_ms=settings["batch_ms"], rounds=settings["rounds"]),
        "",
        "*share*: gradguard's calls per micro-batch (checked against what `gradguard.stats()` counted in the "
        f"scenario's guarded run) × the paired cost of one call over the same call unguarded, over the median of "
        f"{settings['micro_batches']} guarded micro-batch steps of the `gradguard bench` scenario (CPU, default "
        "size, one thread, no memory meter).",
    ]
    for title, header, rows in _sections(doc):
        out += ["", f"## {title}", "", _table.markdown(header, rows)]
    out += ["", *(f"{line}  " for line in _summary(doc))]
    return "\n".join(out).rstrip() + "\n"
