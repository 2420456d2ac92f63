"""The benchmark's outputs: the table on stdout, the verdict against the targets, the PNG plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..._policy import table as _table

__all__ = [
    "NO_ADAPTER_HEADER",
    "late_plot",
    "late_table",
    "late_verdicts",
    "no_adapter_rows",
    "no_adapter_verdicts",
    "plot",
    "table",
    "verdicts",
    "write_json",
]

MiB = 2**20


def write_json(path: str, doc: Any) -> None:
    """``doc`` as indented JSON at ``path``, ending with a newline (results are committed files)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def _figure(names: list[str], title: str, path: str, draw: Callable[[Any, str], None]) -> None:
    """One panel per scenario, side by side, drawn by ``draw(axes, name)``, saved as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        draw(ax, name)
        ax.set_title(name)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdicts(result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """``(check, passed, detail)`` per target of the bench, for one scenario's result.

    The targets: the unguarded growth, less the record, is the analytic pin (the instrument is right);
    the guarded growth is the record's (within 1% of the pin); the gradients are bitwise equal; the
    step time ratio is shown, never judged (it is the machine's).
    """
    if result.get("kind") == "no-adapter":
        return no_adapter_verdicts(result)
    pin = result["expected_pinned_bytes_per_microbatch"]
    record = result["record_bytes_per_microbatch"]
    u, g = result["unguarded"], result["guarded"]
    leak = u["growth_bytes_per_microbatch"] - record
    extra = g["growth_bytes_per_microbatch"] - record
    ratio = g["step_time_median_s"] / u["step_time_median_s"] if u["step_time_median_s"] else float("nan")
    return [
        (
            "instrument: unguarded growth - record ≈ pin (±5%)",
            abs(leak - pin) <= 0.05 * pin,
            f"{leak / MiB:.3f} MiB vs {pin / MiB:.3f} MiB",
        ),
        ("guarded growth ≤ record + 1% of pin", extra <= 0.01 * pin, f"extra {extra:.1f} B/micro-batch"),
        (
            "grads bitwise equal",
            result["grads_equal"] is True,
            "not compared: a run stopped at the memory cap"
            if result["grads_equal"] is None
            else str(result["grads_equal"]),
        ),
        ("step time guarded/unguarded", True, f"{ratio:.3f}"),
    ]


def no_adapter_verdicts(result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """``(check, passed, detail)`` per target of the no-adapter scenario: the instrument (as the others'),
    the store reported by micro-batch :data:`~.no_adapter.REPORT_WITHIN` in each watched mode, ``detach``'s
    growth after the report the records' own bytes (within 1% of the pin), the gradients of the unwatched
    and ``detach`` runs bitwise equal; the step time ratio shown, never judged."""
    from .no_adapter import REPORT_WITHIN

    pin = result["expected_pinned_bytes_per_microbatch"]
    record = result["record_bytes_per_microbatch"]
    u, d = result["unwatched"], result["detach"]
    leak = u["growth_bytes_per_microbatch"] - record
    checks = [
        (
            "instrument: unwatched growth - record ≈ pin (±5%)",
            abs(leak - pin) <= 0.05 * pin,
            f"{leak / MiB:.3f} MiB vs {pin / MiB:.3f} MiB",
        )
    ]
    for mode in ("raise", "warn", "detach"):
        at = result[mode]["reported_at_microbatch"]
        checks.append(
            (
                f"{mode}: the store reported by micro-batch {REPORT_WITHIN}, with no adapter",
                at is not None and at <= REPORT_WITHIN,
                f"reported at micro-batch {at}" if at is not None else "not reported",
            )
        )
    after = d["growth_after_report_bytes_per_microbatch"]
    checks.append(
        (
            "detach: growth after the report ≤ record + 1% of pin",
            after is not None and after - record <= 0.01 * pin,
            "no report" if after is None else f"{after:,.0f} B/micro-batch (record {record:,} B)",
        )
    )
    checks.append(
        (
            "grads bitwise equal (unwatched vs detach)",
            result["grads_equal"] is True,
            "not compared: a run stopped at the memory cap"
            if result["grads_equal"] is None
            else str(result["grads_equal"]),
        )
    )
    ratio = d["step_time_median_s"] / u["step_time_median_s"] if u["step_time_median_s"] else float("nan")
    checks.append(("step time detach/unwatched", True, f"{ratio:.3f}"))
    return checks


def no_adapter_rows(result: dict[str, Any]) -> list[tuple[str, ...]]:
    """The no-adapter scenario's rows: ``(run, growth / micro-batch, reported at, outcome, peak, step)``;
    ``detach``'s growth is after the report (over the whole run in brackets)."""
    from .no_adapter import MODES

    rows: list[tuple[str, ...]] = []
    for mode in MODES:
        x = result[mode]
        growth = f"{x['growth_bytes_per_microbatch']:,.0f} B"
        if mode == "detach" and x.get("growth_after_report_bytes_per_microbatch") is not None:
            growth = f"{x['growth_after_report_bytes_per_microbatch']:,.0f} B after the report ({growth} in all)"
        elif mode == "raise":
            growth = "— (stopped by the raise)" if x["reported_at_microbatch"] is not None else growth
        at = x.get("reported_at_microbatch")
        outcomes = ", ".join(sorted({h[1] for h in x.get("holders", [])})) or "—"
        rows.append(
            (
                mode,
                growth,
                "—" if mode == "unwatched" else (f"micro-batch {at}" if at is not None else "not reported"),
                outcomes,
                f"{x['peak_bytes'] / MiB:.1f} MiB",
                f"{x['step_time_median_s'] * 1e3:.2f} ms",
            )
        )
    return rows


NO_ADAPTER_HEADER = ("run", "growth/mb", "reported at", "outcome", "peak", "step (median)")


def table(report: dict[str, Any]) -> str:
    """A readable table of every scenario's figures (the no-adapter scenario's in a table of its own)."""
    header = ("scenario", "run", "growth/mb", "record/mb", "pin/mb (analytic)", "peak", "step (median)")
    rows = []
    no_adapter = {n: r for n, r in report["scenarios"].items() if r.get("kind") == "no-adapter"}
    for name, r in report["scenarios"].items():
        if name in no_adapter:
            continue
        for run in ("unguarded", "guarded"):
            x = r[run]
            rows.append(
                (
                    name,
                    run,
                    f"{x['growth_bytes_per_microbatch'] / MiB:.3f} MiB",
                    f"{r['record_bytes_per_microbatch'] / MiB:.3f} MiB",
                    f"{r['expected_pinned_bytes_per_microbatch'] / MiB:.3f} MiB",
                    f"{x['peak_bytes'] / MiB:.1f} MiB",
                    f"{x['step_time_median_s'] * 1e3:.2f} ms",
                )
            )
    lines = _table.text(header, rows).splitlines() if rows else []
    for name, r in no_adapter.items():
        holders = sorted({h[0] for m in ("raise", "warn", "detach") for h in r[m].get("holders", [])})
        lines += [
            "",
            f"{name}: {r['engine']}'s engine with no adapter, only the watch (enforce() and watch(), as gradguard run "
            f"sets them up); record {r['record_bytes_per_microbatch']:,} B/mb, pin "
            f"{r['expected_pinned_bytes_per_microbatch']:,} B/mb (analytic)",
            *_table.text(NO_ADAPTER_HEADER, no_adapter_rows(r)).splitlines(),
            f"{name}: holders named: {', '.join(holders) or 'none'}",
        ]
    for name, r in report["scenarios"].items():
        runs = ("unwatched", "detach", "raise", "warn") if name in no_adapter else ("unguarded", "guarded")
        for run in runs:
            x = r[run]
            if "stopped_at_microbatch" in x:
                lines.append(
                    f"{name}: {run} run stopped after micro-batch {x['stopped_at_microbatch']}: allocated "
                    f"{x['allocated_bytes'][-1] / 2**30:.2f} GiB > memory cap {x['memory_cap_bytes'] / 2**30:.2f} GiB"
                )
        for check, ok, detail in verdicts(r):
            lines.append(
                f"{name}: {check}: {detail}" + ("" if check.startswith("step") else (" ok" if ok else " FAIL"))
            )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Allocated bytes after each micro-batch, per scenario, unguarded vs guarded, as a PNG."""

    def draw(ax: Any, name: str) -> None:
        r = report["scenarios"][name]
        runs: tuple[tuple[str, str], ...]
        if r.get("kind") == "no-adapter":
            runs = (("unwatched", "-"), ("detach", "--"), ("warn", ":"), ("raise", "-."))
        else:
            runs = (("unguarded", "-"), ("guarded", "--"))
        for run, style in runs:
            values = r[run]["allocated_bytes"]
            label = run if r.get("kind") != "no-adapter" or run == "unwatched" else f"watch(mode={run!r})"
            ax.plot(range(1, len(values) + 1), [v / MiB for v in values], style, label=label)
        if r.get("kind") == "no-adapter" and r["detach"]["reported_at_microbatch"] is not None:
            ax.axvline(r["detach"]["reported_at_microbatch"], color="red", linestyle=":", label="reported")
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("allocated (MiB)")
        ax.legend()

    _figure(list(report["scenarios"]), f"gradguard bench — {report['device']}, torch {report['torch']}", path, draw)


# --------------------------------------------------------------------------------------------------
# --late-leak
# --------------------------------------------------------------------------------------------------

REPORT_WITHIN = 5  # boundaries from a leak's first step to the audit that finds it
CLEAN_SHARE = 0.002  # the watch's share of a clean run's wall time, trigger on
TRIGGER_EXTRA = 2  # audits the trigger may add to a clean run


def late_verdicts(result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """``(check, passed, detail)`` per target of the late-leak measurement, for one scenario."""
    start, watched, clean = result["leak_start"], result["watched"], result["clean"]["watched"]
    reported = watched["reported_at"]
    memory = {run: result[run]["memory"] for run in ("unwatched", "watched")}
    grown = {run: values[-1] - values[start - 1] for run, values in memory.items()}
    after = memory["watched"][reported:] if reported is not None else []
    fell = min(after) - memory["watched"][start - 1] if after else None
    per_step = result["bytes_per_step"]
    return [
        (
            f"reported within {REPORT_WITHIN} boundaries of the leak's start",
            reported is not None and reported - start <= REPORT_WITHIN,
            f"started at step {start}, reported at {reported}",
        ),
        (
            "repaired in detach mode: memory falls back to within 4 steps' leak of where it started",
            watched["outcome"] == "repaired" and fell is not None and fell <= 4 * per_step,
            f"{watched['outcome']}; lowest after the report {0 if fell is None else fell / MiB:+.2f} MiB; at the end "
            f"{grown['watched'] / MiB:+.1f} MiB vs {grown['unwatched'] / MiB:+.1f} MiB unwatched",
        ),
        (
            f"clean run: the watch's share of the wall time ≤ {CLEAN_SHARE:.1%}",
            clean["share"] <= CLEAN_SHARE,
            f"{clean['share']:.3%} ({clean['audits']} audits, {clean['read_s'] * 1e3:.1f} ms of readings)",
        ),
        (
            f"clean run: the trigger adds ≤ {TRIGGER_EXTRA} audits to the backstop's",
            clean["memory_audits"] <= TRIGGER_EXTRA,
            f"{clean['memory_audits']} by the trigger, {clean['backstop_audits']} by the backstop",
        ),
    ]


def late_table(report: dict[str, Any]) -> str:
    """The late-leak figures of every scenario, and the verdicts."""
    header = ("scenario", "leak from", "reported at", "outcome", "clean step", "clean share", "audits (trigger)")
    rows = []
    for name, r in report["late_leak"].items():
        clean = r["clean"]["watched"]
        rows.append(
            (
                name,
                str(r["leak_start"]),
                str(r["watched"]["reported_at"]),
                str(r["watched"]["outcome"]),
                f"{r['clean']['unwatched']['step_s'] * 1e3:.2f} ms",
                f"{clean['share']:.3%}",
                f"{clean['audits']} ({clean['memory_audits']})",
            )
        )
    lines = _table.text(header, rows).splitlines()
    for name, r in report["late_leak"].items():
        for check, ok, detail in late_verdicts(r):
            lines.append(f"  {name}: {'ok' if ok else 'MISSED'}  {check}: {detail}")
    return "\n".join(lines)


def late_plot(report: dict[str, Any], path: str) -> None:
    """Memory after each step, unwatched vs watched (detach), with the leak's start and its report."""

    def draw(ax: Any, name: str) -> None:
        r = report["late_leak"][name]
        for run, style in (("unwatched", "-"), ("watched", "--")):
            values = r[run]["memory"]
            base = values[0] if values else 0
            ax.plot(range(1, len(values) + 1), [(v - base) / MiB for v in values], style, label=run)
        ax.axvline(r["leak_start"], color="grey", linestyle=":", label="leak starts")
        if r["watched"]["reported_at"] is not None:
            ax.axvline(r["watched"]["reported_at"], color="red", linestyle=":", label="reported and repaired")
        ax.set_xlabel("step")
        ax.set_ylabel("in use since step 1 (MiB)")
        ax.legend(fontsize=8)

    title = f"gradguard bench --late-leak — {report['device']}, torch {report['torch']}"
    _figure(list(report["late_leak"]), title, path, draw)
