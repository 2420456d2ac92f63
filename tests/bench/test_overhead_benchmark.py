"""The overhead benchmark package (``benchmarks/overhead``): selection, setup and teardown, the paired
statistic and the JSON schema. No timing is asserted: timings are measured by the benchmark itself."""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import require_engine

import gradguard
from benchmarks.overhead import cases, report, timing
from benchmarks.overhead.__main__ import main, run
from gradguard._policy import modes as _policy
from gradguard._scope import enforce as _enforce

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _side(samples: list[float], calls: int = 10) -> timing.Side:
    return timing.Side(tuple(samples), calls)


# --------------------------------------------------------------------------------------------------
# The paired statistic
# --------------------------------------------------------------------------------------------------


def test_paired_ratio_is_the_median_of_within_round_ratios_not_of_independent_medians():
    # The machine slows down 4x in rounds 3-5, and the candidate's batch of round 3 ran already slow:
    # within each undisturbed round the candidate takes 1.1x the baseline.
    baseline = [1.0, 1.0, 1.0, 4.0, 4.0]
    candidate = [1.1, 1.1, 4.4, 4.4, 4.4]
    paired = timing.Paired(_side(candidate), _side(baseline))
    assert paired.ratios == pytest.approx([1.1, 1.1, 4.4, 1.1, 1.1])
    assert paired.ratio == pytest.approx(1.1)
    assert paired.delta_us == pytest.approx(0.1 * 1.0)  # the excess at the baseline's fastest round
    assert paired.medians_ratio == pytest.approx(4.4)  # what independent medians make of it
    assert paired.medians_delta_us == pytest.approx(3.4)
    assert paired.best_ratio == pytest.approx(1.1)
    assert paired.best_delta_us == pytest.approx(0.1)
    assert paired.ratio_quartiles == pytest.approx((1.1, 1.1))
    assert paired.rounds == 5


def test_paired_figures_on_an_even_number_of_rounds():
    paired = timing.Paired(_side([3.0, 6.0, 4.0, 10.0]), _side([2.0, 4.0, 4.0, 5.0]))
    assert paired.ratios == pytest.approx([1.5, 1.5, 1.0, 2.0])
    assert paired.ratio == pytest.approx(1.5)  # median of 1.0, 1.5, 1.5, 2.0
    assert paired.delta_us == pytest.approx(0.5 * 2.0)
    assert paired.candidate.median == pytest.approx(5.0)
    assert paired.baseline.best == 2.0
    assert paired.baseline.iqr_rel == pytest.approx((4.25 - 3.5) / 4.0)


def test_paired_refuses_rounds_that_do_not_pair():
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        timing.Paired(_side([1.0, 2.0]), _side([1.0]))
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        timing.Paired(_side([]), _side([]))


def test_measure_pairs_rounds_resets_before_every_batch_and_restores_gc():
    calls: list[str] = []
    resets = 0

    def reset() -> None:
        nonlocal resets
        resets += 1

    gc.disable()
    try:
        paired = timing.measure(
            [(lambda a: calls.append("c"), None), (lambda a: calls.append("b"), None)], 7, 0.01, reset
        )
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()
    paired = timing.measure([(lambda a: calls.append("c"), None), (lambda a: calls.append("b"), None)], 7, 0.01, reset)
    assert gc.isenabled()
    assert paired.rounds == 7 and len(paired.baseline.samples) == 7
    assert paired.candidate.calls_per_batch >= 1 and paired.baseline.calls_per_batch >= 1
    assert resets >= 2 * (2 * 7 + 2)  # every timed and warm-up batch, twice over
    with pytest.raises(ValueError, match="rounds"):
        timing.measure([(len, ()), (len, ())], 0, 1.0)


# --------------------------------------------------------------------------------------------------
# Selection: --only filters before anything is built
# --------------------------------------------------------------------------------------------------


def _recording_group(title: str, names: tuple[str, ...], built: list[tuple[str, frozenset[str]]]) -> cases.Group:
    @contextlib.contextmanager
    def build(selected: frozenset[str]) -> Iterator[list[cases.Case]]:
        built.append((title, selected))
        yield [cases.Case(n, cases.INFO, len, len, "len", "len", (), group=title) for n in names if n in selected]

    return cases.Group(title, names, build)


def test_only_builds_the_selected_groups_with_the_selected_names():
    built: list[tuple[str, frozenset[str]]] = []
    groups = [
        _recording_group("alpha", ("alpha: one", "alpha: two"), built),
        _recording_group("beta", ("beta: one",), built),
    ]
    selection = cases.select(["TWO"], groups)
    assert [(g.title, names) for g, names in selection] == [("alpha", frozenset({"alpha: two"}))]
    entries, skipped = run(selection, rounds=1, batch_ms=0.01, micro_batches=1, say=lambda s: None)
    assert built == [("alpha", frozenset({"alpha: two"}))]
    assert [e["name"] for e in entries] == ["alpha: two"] and skipped == []
    assert [g.title for g, _ in cases.select(["beta"], groups)] == ["beta"]  # a group title selects its cases
    assert cases.select(["nothing like it"], groups) == []


def test_the_registry_selects_by_name_without_building():
    selection = {g.title: names for g, names in cases.select(["guarded append: clean"])}
    assert selection == {"guarded append": frozenset({"guarded append: clean record"})}
    megatron = {g.title for g, _ in cases.select(["megatron"])}
    assert megatron == {"megatron adapter", "share: megatron-gpt"}
    names = [n for g in cases.GROUPS for n in g.names]
    assert len(names) == len(set(names)), "case names are unique"


def test_a_group_must_build_exactly_the_selected_cases():
    built: list[tuple[str, frozenset[str]]] = []
    group = _recording_group("alpha", ("alpha: one",), built)
    with pytest.raises(ValueError, match="has no case"):
        run([(group, frozenset({"alpha: zero"}))], 1, 0.01, 1, say=lambda s: None)


def _subprocess(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GRADGUARD", None)
    return subprocess.run(
        [sys.executable, *args, *(["-c", code] if code else [])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_only_does_not_import_megatron_when_its_cases_are_not_selected(tmp_path):
    out = tmp_path / "run.json"
    code = f"""
import sys
from benchmarks.overhead.__main__ import main
rc = main(["--only", "guarded append: clean", "--rounds", "1", "--batch-ms", "0.05", "--json", {str(out)!r}])
imported = sorted({{m.split(".")[0] for m in sys.modules}} & {{"megatron", "lightning_utilities", "verl"}})
print("IMPORTED", imported)
sys.exit(rc or (1 if imported else 0))
"""
    result = _subprocess(code)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "IMPORTED []" in result.stdout
    doc = json.loads(out.read_text())
    assert [e["name"] for e in doc["cases"]] == ["guarded append: clean record"]
    assert doc["settings"]["only"] == ["guarded append: clean"]


def test_runs_as_a_directory_too():
    result = _subprocess("", "benchmarks/overhead", "--list")
    assert result.returncode == 0, result.stderr
    assert "share: pp-last-stage" in result.stdout and "megatron adapter" in result.stdout


def test_an_unmatched_only_is_an_error(capsys):
    with pytest.raises(SystemExit):
        main(["--only", "no such case anywhere"])
    assert "matches no case" in capsys.readouterr().err


def test_a_case_check_fails_when_the_sides_disagree():
    leaf = torch.randn(2, 2, requires_grad=True)
    rec = cases.verl_record(leaf)
    clean = cases.narrow_detach(rec)
    cases._agrees(rec, gradguard.detach_tree, cases.narrow_detach)()  # agree
    with pytest.raises(AssertionError, match="still carries a graph"):
        cases._agrees(rec, lambda r: r, gradguard.detach_tree)()
    with pytest.raises(AssertionError, match="was rebuilt"):
        cases._agrees(clean, cases.narrow_detach, gradguard.detach_tree)()
    with pytest.raises(AssertionError, match="different structures"):
        cases._agrees(rec, gradguard.detach_tree, lambda r: cases.narrow_detach(r)["model_output"])()


# --------------------------------------------------------------------------------------------------
# Every group's teardown leaves nothing behind
# --------------------------------------------------------------------------------------------------


def _process_state() -> dict[str, Any]:
    import torch.distributed as dist

    state: dict[str, Any] = {
        "installs": _enforce.installed(),
        "mode": gradguard.get_mode(),
        "enforced": _policy._enforced.get(),
        "set_mode": _policy._chosen.get(),
        "gc_enabled": gc.isenabled(),
        "gc_frozen": gc.get_freeze_count(),
        "atexit": atexit._ncallbacks(),  # type: ignore[attr-defined]
        "stats": dict(gradguard.stats()),
        "process_group": dist.is_available() and dist.is_initialized(),
        "threads": torch.get_num_threads(),
    }
    schedules = sys.modules.get("megatron.core.pipeline_parallel.schedules")
    if schedules is not None:
        state["forward_step_calc_loss"] = schedules.forward_step_calc_loss
    return state


MEGATRON_GROUPS = {"megatron adapter", "share: megatron-gpt"}


def _run_group(title: str) -> list[dict[str, Any]]:
    (group,) = [g for g in cases.GROUPS if g.title == title]
    selection = [(group, frozenset(group.names))]
    first = _process_state()
    run(selection, 1, 0.02, 2, say=lambda s: None)
    after_first = _process_state()
    # The first run imports what the cases use, and torch._dynamo (imported by torch.utils.checkpoint)
    # registers atexit hooks on import: the atexit count is compared over a second run.
    first.pop("atexit"), after_first.pop("atexit")
    assert after_first == first
    before = _process_state()
    entries, skipped = run(selection, 1, 0.02, 2, say=lambda s: None)
    assert skipped == []
    assert _process_state() == before
    assert sorted(e["name"] for e in entries) == sorted(group.names)
    return entries


@pytest.mark.parametrize("title", [g.title for g in cases.GROUPS if g.title not in MEGATRON_GROUPS])
def test_each_group_tears_down_what_it_set_up(title):
    entries = _run_group(title)
    for e in entries:
        if e["kind"] == cases.SHARE:
            assert e["share"]["publishes_per_microbatch"] == e["share"]["calls_per_microbatch"]


@pytest.mark.integration
@pytest.mark.parametrize("title", sorted(MEGATRON_GROUPS))
def test_megatron_groups_tear_down_what_they_set_up(title):
    require_engine("megatron.core.pipeline_parallel.schedules")
    _run_group(title)


def test_a_group_that_fails_midway_still_tears_down():
    (group,) = [g for g in cases.GROUPS if g.title == "guarded append"]
    before = _process_state()
    with pytest.raises(RuntimeError, match="boom"):
        with group.setup(frozenset(group.names)) as built:
            assert _policy._enforced.get() == "detach"
            assert built
            raise RuntimeError("boom")
    assert _process_state() == before


# --------------------------------------------------------------------------------------------------
# The JSON document carries every field the tables read
# --------------------------------------------------------------------------------------------------


def _synthetic_entries() -> list[dict[str, Any]]:
    paired = timing.Paired(_side([2.0, 2.2, 2.1]), _side([1.0, 1.1, 1.0]))
    step = cases.StepTime("pp-last-stage", 4, 0.016, 0.015, 1.0)
    share = cases.Share("pp-last-stage", 1, lambda n: step)
    built = [
        cases.Case("ratio-case", cases.RATIO, len, len, "a", "b", target=0.9),
        cases.Case("delta-case", cases.DELTA_US, len, len, "a", "b", target=2.0),
        cases.Case("share-case", cases.SHARE, len, len, "a", "b", target=0.001, share=share),
        cases.Case("decide-case", cases.DECIDE, len, len, "a", "b", target=0.1),
        cases.Case("info-case", cases.INFO, len, len, "a", "b"),
    ]
    return [report.entry(c, paired, step if c.kind == cases.SHARE else None) for c in built]


def test_entries_verdicts_follow_their_kind():
    by = {e["name"]: e for e in _synthetic_entries()}
    ratio, delta, share, decide, info = (by[f"{k}-case"] for k in ("ratio", "delta", "share", "decide", "info"))
    assert ratio["value"] == pytest.approx(2.0) and ratio["passed"] is False
    assert delta["value"] == pytest.approx(1.0) and delta["passed"] is True  # (2.0 - 1) x 1.0 µs
    assert share["share"]["cost_per_microbatch_us"] == pytest.approx(1.0)
    assert share["value"] == pytest.approx(1.0 / 16_000) and share["passed"] is True
    assert share["share"]["share_on_best_step"] == pytest.approx(1.0 / 15_000)
    assert decide["value"] == pytest.approx(-0.5) and decide["decision"] == "drop" and decide["passed"] is None
    assert info["passed"] is None and info["value"] == pytest.approx(2.0)


def test_the_document_has_the_fields_the_tables_read():
    settings = {
        "command": "python -m benchmarks.overhead",
        "rounds": 3,
        "batch_ms": 1.0,
        "micro_batches": 4,
        "only": None,
        "torch_threads": 1,
        "elapsed_s": 1.0,
        "load_avg_1min_end": 0.5,
    }
    doc = report.document(_synthetic_entries(), [("megatron adapter", "not here")], settings, {"cpu": "x"}, "line")
    doc = json.loads(json.dumps(doc))  # what a reader of the file gets
    assert tuple(doc) == report.DOCUMENT_FIELDS
    for e in doc["cases"]:
        assert tuple(e) == report.ENTRY_FIELDS
    assert tuple(doc["cases"][2]["share"]) == report.SHARE_FIELDS
    assert doc["budgets_met"] is False
    for rendered in (report.text(doc), report.markdown(doc)):
        for name in ("ratio-case", "delta-case", "decide-case", "info-case", "pp-last-stage", "0.006%"):
            assert name in rendered
        assert "✓" in rendered and "✗" in rendered
        assert "Not measured: megatron adapter: not here" in rendered


def test_the_committed_run_follows_the_schema():
    path = RESULTS / "overhead-cpu.json"
    doc = json.loads(path.read_text())
    assert tuple(doc) == report.DOCUMENT_FIELDS and doc["schema"] == report.SCHEMA
    assert all(tuple(e) == report.ENTRY_FIELDS for e in doc["cases"])
    assert doc["machine_line"] and doc["settings"]["command"].startswith("python -m benchmarks.overhead")
    assert report.markdown(doc) == (RESULTS / "overhead-cpu.md").read_text(encoding="utf-8"), (
        "overhead-cpu.md is not what report.markdown makes of overhead-cpu.json; after changing the tables, "
        "re-render it: python -m benchmarks.overhead --from-json benchmarks/results/overhead-cpu.json "
        "--md benchmarks/results/overhead-cpu.md"
    )
