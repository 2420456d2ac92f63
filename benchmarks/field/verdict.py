"""What a release's runs say (reported or silent, the holder, the step), and the Markdown page of a run."""

from __future__ import annotations

import re
from typing import Any

from .cases import Case

__all__ = ["markdown", "verdict"]

KiB = 1024
_REFUSED = re.compile(r"reached store (.+?) from ")
_SITE = re.compile(r"\S*/site-packages/")  # where the environment put a file: the same in every row


_INSTALLED = {
    "venv": "Each release in its own virtual environment (torch 2.13.0 CPU shared)",
    "site": "Each release unpacked with `pip install --no-deps --target` (with what it imports that the project's "
    "environment lacks) into its own folder of `$GRADGUARD_FIELD_SITE`, first on the driver's `PYTHONPATH` over the "
    "project's environment (torch 2.13.0 CPU)",
}


def verdict(case: Case, result: dict[str, Any], *, leaky: bool) -> dict[str, Any]:
    """The verdict on one release from its runs (see ``runner.run_release``).

    A leaky release is *reported* when the ``raise`` run exits non-zero with a
    ``GraphRetentionError`` or a holder in its reports; the holder is the first one the watch
    recorded (else the error's text: a guarded store that refused), and it is *the right one* when
    it contains the case's ``expect`` fragment. A fixed release is *silent* when the ``raise`` run
    exits 0 with no holder, no error and no warning, and the ``warn`` run warns of nothing.
    """
    runs = result["runs"]
    strict = runs["raise"]
    holders = strict["holders"]
    holder = holders[0]["holder"] if holders else None
    text = holder or strict["error"] or ""
    failed = strict["returncode"] not in (0, None)
    out: dict[str, Any] = {
        "exit": strict["returncode"],
        "audits": strict["audits"],
        "boundaries": strict["boundaries"],
        "holder": holder or (strict["error"] and f"(refused) {strict['error']}"),
        "found_at": holders[0]["found_at"] if holders else None,
        "steps_before_exit": strict["optimizer_steps"],
        "warn_weights_equal_plain": result["warn_weights_equal_plain"],
        "fix": holders[0].get("fix") if holders else None,
    }
    hunt = runs.get("every1")
    if hunt is not None:
        found = hunt["holders"]
        out["every1"] = {
            "exit": hunt["returncode"],
            "holder": found[0]["holder"] if found else (hunt["error"] and f"(refused) {hunt['error']}"),
            "found_at": found[0]["found_at"] if found else None,
            "steps_before_exit": hunt["optimizer_steps"],
        }
    if leaky:
        out["reported"] = bool(failed and (holders or strict["error"]))
        out["right_holder"] = bool(out["reported"] and case.expect in text)
    else:
        warned = runs.get("warn", {}).get("warnings") or []
        out["silent"] = strict["returncode"] == 0 and not holders and not strict["error"] and not strict["warnings"]
        out["silent"] = out["silent"] and not warned
    return out


def _bytes(n: float | None) -> str:
    if n is None:
        return "–"
    if abs(n) >= 1024 * KiB:
        return f"{n / (1024 * KiB):+.2f} MiB"
    return f"{n / KiB:+.1f} KiB"


def _size(n: float | None) -> str:
    return "–" if n is None else f"{n / (1024 * KiB):.1f} MiB"


def _verdict_cell(v: dict[str, Any], leaky: bool) -> str:
    checked = f"{v['audits']} of {v['boundaries']} boundaries audited" if v["audits"] is not None else "no report"
    if v["holder"] and v["holder"].startswith("(refused)") and not v["audits"]:
        checked = "a guarded store refused it"
    if leaky:
        if v["reported"]:
            mark = "✓" if v["right_holder"] else "✗ (another holder)"
            return f"reported {mark}, exit {v['exit']} ({checked})"
        return f"✗ not reported, exit {v['exit']} ({checked})"
    if v["silent"]:
        return f"silent ✓, exit 0 ({checked})" + (" — nothing was checked" if not v["audits"] else "")
    return f"✗ false alarm, exit {v['exit']} ({checked})"


def _where(v: dict[str, Any]) -> str:
    if v["found_at"] is not None:
        return f"boundary {v['found_at']}"
    if v["holder"] and v["holder"].startswith("(refused)"):
        steps = v["steps_before_exit"]
        return "at its store, before the first optimizer step" if steps == 0 else f"at its store, after {steps} steps"
    return "–"


def _hunt_cell(v: dict[str, Any]) -> str:
    hunt = v.get("every1")
    if hunt is None:
        return "–"
    if hunt["exit"] == 0 and not hunt["holder"]:
        return "exit 0, silent"
    return f"exit {hunt['exit']}, {_where(hunt)}" + ("" if hunt["holder"] else ", no holder")


def _holder_cell(v: dict[str, Any]) -> str:
    holder = v["holder"]
    if not holder:
        return "–"
    refused = _REFUSED.search(holder)
    if holder.startswith("(refused)") and refused:  # the store, and the paths of what reached it
        paths = [line.split()[0] for line in holder.splitlines()[1:] if line.strip().startswith("[")]
        holder = f"store {refused.group(1)}: {', '.join(paths)} (refused)"
    holder = _SITE.sub("", holder.splitlines()[0])
    holder = holder if len(holder) <= 160 else holder[:157] + "..."
    return "`" + holder.replace("`", "'").replace("|", "\\|") + "`"


def _remedy_cell(v: dict[str, Any]) -> str:
    fix = v.get("fix")
    if not fix:
        return "–"
    return "`" + fix.replace("`", "'").replace("|", "\\|") + "`"


def _applied_cell(remedy: dict[str, Any] | None) -> str:
    if remedy is None:
        return "–"
    passed = remedy["exit"] == 0 and not remedy["holders"] and not remedy["error"]
    verdict = f"raise exit {remedy['exit']}" + (" ✓" if passed else " ✗")
    if remedy["by"] == "upgrade":
        return f"upgrade: the fixed release's {verdict}"
    return f"applied: {verdict}; weights vs the fix's plain run: {_equal(remedy['weights_equal_fixed_plain'])}"


def _ratio(watched: float | None, plain: float | None) -> str:
    """Whole-process wall time of the default mode's run over the plain run's (one run each)."""
    if not watched or not plain:
        return "–"
    return f"{watched / plain:.2f}× ({watched:.1f} s / {plain:.1f} s)"


def _equal(value: bool | None) -> str:
    return {True: "bitwise equal", False: "✗ differ", None: "–"}[value]


def markdown(doc: dict[str, Any]) -> str:
    """The results as a Markdown page: the machine line, the method, the table, the checks."""
    lines: list[str] = [
        "# Field benchmark — released leaks and their fixes under gradguard's defaults, CPU",
        "",
        f"Machine: {doc['machine_line']}",
        "",
        f"`{doc['settings']['command']}` ({doc['settings']['elapsed_s']} s), gradguard at "
        f"{doc['settings']['gradguard_commit']}",
        "",
        f"{_INSTALLED[doc['settings'].get('installed', 'venv')]}, its driver (a tiny random model, "
        "random data, the library's documented API) run five ways: plain; `gradguard run --mode raise driver.py` with "
        "no other flag (the verdict, the holder, the boundary); `--mode detach` (memory); `--mode warn` (final "
        "weights compared bitwise with plain's); and, as a diagnostic beside the verdict, `--mode raise "
        "--audit-every 1` (what the detector finds when it audits every boundary). *Growth per step*: the "
        "least-squares slope of glibc's in-use bytes (`mallinfo2` `uordblks + hblkhd`) read right after each "
        "optimizer step, the first two steps left out; *in use*: the median of those readings (compare plain "
        "with detach within a row, not across releases). *Wall detach / plain*: the whole process's wall time "
        "under `gradguard run --mode detach` (the default mode) over the plain run's, imports and start included, "
        "one run each on a shared machine. *Remedy*: the fix `--mode raise` printed for the holder "
        "(the summary's `fix`), applied by the benchmark: the driver makes the change on the user's side "
        "(`GRADGUARD_FIELD_REMEDY=1`) and runs under `gradguard run --mode raise` on the leaky release, its final "
        "weights compared bitwise with the fixed release's plain run; where the fix is upgrading, the fixed "
        "release's own `raise` run is the check.",
        "",
        "| library | release | `--mode raise` (defaults) | holder gradguard named | found at | with `--audit-every 1` "
        "| growth / step plain | growth / step detach | in use plain → detach | wall detach / plain "
        "| warn vs plain weights | remedy | remedy applied |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    checks = {
        "leaks reported": 0, "right holder": 0, "fixes silent": 0, "fixes audited": 0, "weights equal": 0,
        "remedies pass raise": 0, "remedy weights equal the fix's": 0,
    }  # fmt: skip
    applied_by_driver = 0
    n_cases = len(doc["cases"])
    for result in doc["cases"]:
        for side in ("leaky", "fixed"):
            r, leaky = result[side], side == "leaky"
            v = r["verdict"]
            plain, detach = r["runs"]["plain"], r["runs"]["detach"]
            lines.append(
                f"| {result['library'] if leaky else ''} | {r['release']}{' (leak)' if leaky else ' (fix)'} "
                f"| {_verdict_cell(v, leaky)} | {_holder_cell(v)} | {_where(v)} | {_hunt_cell(v)} "
                f"| {_bytes(plain['growth_bytes_per_step'])} | {_bytes(detach['growth_bytes_per_step'])} "
                f"| {_size(plain['in_use_median_bytes'])} → {_size(detach['in_use_median_bytes'])} "
                f"| {_ratio(detach.get('seconds'), plain.get('seconds'))} "
                f"| {_equal(r['warn_weights_equal_plain'])} "
                f"| {_remedy_cell(v) if leaky else '–'} | {_applied_cell(result.get('remedy')) if leaky else '–'} |"
            )
            if leaky:
                checks["leaks reported"] += bool(v["reported"])
                checks["right holder"] += bool(v["right_holder"])
                remedy = result.get("remedy")
                if remedy is not None:
                    checks["remedies pass raise"] += (
                        remedy["exit"] == 0 and not remedy["holders"] and not remedy["error"]
                    )
                    applied_by_driver += remedy["by"] == "driver"
                    checks["remedy weights equal the fix's"] += remedy["weights_equal_fixed_plain"] is True
            else:
                checks["fixes silent"] += bool(v["silent"])
                checks["fixes audited"] += bool(v["audits"])
            checks["weights equal"] += v["warn_weights_equal_plain"] is True
    lines += ["", "Checks:", ""]
    for name, count in checks.items():
        total = {"weights equal": 2 * n_cases, "remedy weights equal the fix's": applied_by_driver}.get(name, n_cases)
        lines.append(f"- {name}: {count} of {total} {'✓' if count == total else '✗'}")
    lines += [
        "",
        "What each leak is, and what `--mode raise` printed (its `gradguard watch:` line, or the refusal):",
        "",
    ]
    for result in doc["cases"]:
        lines.append(f"- **{result['leaky']['release']}**: {result['holder_words']}. Fixed in "
                     f"{result['fixed']['release']}: {result['fixed_by']}.")  # fmt: skip
        for side in ("leaky", "fixed"):
            strict = result[side]["runs"]["raise"]
            said = strict["error"] or strict["watch_line"] or "(no summary line)"
            said = " / ".join(line.strip() for line in _SITE.sub("", said).splitlines())
            said = said if len(said) <= 600 else said[:597] + "..."
            lines.append(f"  - {result[side]['release']}: {said}")
            hunt = result[side]["verdict"].get("every1")
            if hunt and hunt["holder"]:
                lines.append(
                    f"    (with `--audit-every 1`: {_holder_cell({'holder': hunt['holder']})}, {_where(hunt)})"
                )
    return "\n".join(lines) + "\n"
