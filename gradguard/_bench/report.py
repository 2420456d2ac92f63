"""The benchmark's outputs: the table on stdout, the verdict against the targets, the PNG plot."""

from __future__ import annotations

from typing import Any

from .. import _table

__all__ = ["plot", "table", "verdicts"]

MiB = 2**20


def verdicts(result: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """``(check, passed, detail)`` per target of issue #5, for one scenario's result."""
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


def table(report: dict[str, Any]) -> str:
    """A readable table of every scenario's figures."""
    header = ("scenario", "run", "growth/mb", "record/mb", "pin/mb (analytic)", "peak", "step (median)")
    rows = []
    for name, r in report["scenarios"].items():
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
    lines = _table.text(header, rows).splitlines()
    for name, r in report["scenarios"].items():
        for run in ("unguarded", "guarded"):
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["scenarios"])
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for run, style in (("unguarded", "-"), ("guarded", "--")):
            values = report["scenarios"][name][run]["allocated_bytes"]
            ax.plot(range(1, len(values) + 1), [v / MiB for v in values], style, label=run)
        ax.set_title(name)
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("allocated (MiB)")
        ax.legend()
    fig.suptitle(f"gradguard bench — {report['device']}, torch {report['torch']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
