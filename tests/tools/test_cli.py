"""The ``gradguard`` command: ``doctor`` and ``bench`` (the CPU paths, exact bytes).

One small ``gradguard bench`` runs in-process for the whole module (JSON, PNG, table, exit status);
the measurement itself is checked against the analytic expectation on a tiny config. The refusals
(CUDA preset on CPU, no CUDA, unknown scenario, too few micro-batches, no matplotlib) are one line
on stderr and exit status 2, before anything runs. Subprocesses cover ``python -m gradguard`` and
the console script.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _helpers import env

import gradguard
from gradguard import engines
from gradguard._tools.bench.no_adapter import MODES, REPORT_WITHIN, run_no_adapter
from gradguard._tools.bench.report import no_adapter_verdicts, table
from gradguard._tools.bench.runner import run_scenario
from gradguard._tools.bench.scenarios import PRESETS, SCENARIOS, Size, build
from gradguard._tools.cli import main

CPU = torch.device("cpu")
TINY = Size(seq=8, batch=1, hidden=16, vocab=32)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
RUN_KEYS = {"micro_batches", "growth_bytes_per_microbatch", "peak_bytes", "allocated_bytes", "step_time_median_s"}
SCENARIO_KEYS = {
    "expected_pinned_bytes_per_microbatch",
    "record_bytes_per_microbatch",
    "grads_equal",
    "unguarded",
    "guarded",
}


@pytest.fixture(autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    """``gradguard bench`` sets torch's thread count for steady timings; give it back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(*argv: str, **changes: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, env=env(**changes), timeout=120)


def _one_line_refusal(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gradguard bench: ")
    return lines[0]


# --------------------------------------------------------------------------- doctor


def _check_doctor_report(out: str) -> None:
    lines = out.strip().splitlines()
    assert lines[0] == f"gradguard {gradguard.__version__}, python {sys.version.split()[0]}"
    assert lines[1].startswith(f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}, debug: ")
    assert re.fullmatch(r"CUDA: (not available|\d+ device\(s\), 0: .+)", lines[2])
    assert re.fullmatch(
        r"Transformer Engine: (not installed \(.+\)|installed but does not import: .+|importable, version .+)", lines[3]
    )
    engine_lines = [line for line in lines if line.startswith("engine ")]
    assert [line.split(":")[0] for line in engine_lines] == [f"engine {name}" for name in engines.KNOWN]
    for line in engine_lines:
        assert re.fullmatch(
            r"engine \w+: (\S+ \S+ found, (supported|OUTSIDE the supported range|version not readable) \(.+\); "
            r"the adapter installs on import of .+|not installed; the adapter waits for .+ \(supports .+\))",
            line,
        ), line


def test_doctor_module_entry_point() -> None:
    proc = _run(sys.executable, "-m", "gradguard", "doctor")
    assert proc.returncode == 0, proc.stderr
    _check_doctor_report(proc.stdout)
    assert proc.stdout.strip().splitlines()[-1] == "mode: detach (from default)"
    assert "Traceback" not in proc.stderr


def test_doctor_console_script_refuses_an_invalid_gradguard() -> None:
    script = shutil.which("gradguard") or shutil.which("gradguard", path=str(Path(sys.executable).parent))
    argv = [script, "doctor"] if script else [sys.executable, "-m", "gradguard", "doctor"]
    proc = _run(*argv, GRADGUARD="bogus")
    assert proc.returncode != 0
    _check_doctor_report(proc.stdout)  # the rest of the report is still printed
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("mode: INVALID GRADGUARD: GRADGUARD='bogus' is not a gradguard mode; accepted: ")
    assert "Traceback" not in proc.stderr


def test_doctor_names_where_the_mode_comes_from(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GRADGUARD", raising=False)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    _check_doctor_report(out)
    assert out.strip().splitlines()[-1] == "mode: detach (from default)"

    monkeypatch.setenv("GRADGUARD", "strict")  # doctor re-reads the variable
    assert main(["doctor"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "mode: raise (from GRADGUARD)"

    gradguard.set_mode("off")
    assert main(["doctor"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "mode: off (from set_mode)"

    with gradguard.enforce(mode="warn", engines="none"):
        assert main(["doctor"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "mode: warn (from enforce)"

    gradguard.set_mode(None)
    monkeypatch.setenv("GRADGUARD", "sometimes")
    assert main(["doctor"]) == 1
    assert "GRADGUARD='sometimes' is not a gradguard mode" in capsys.readouterr().out


# --------------------------------------------------------------------------- bench: the run


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``gradguard bench --device cpu --micro-batches 4`` with JSON, PNG (with matplotlib) and ``--te``."""
    threads = torch.get_num_threads()
    folder = tmp_path_factory.mktemp("bench")
    out, err = io.StringIO(), io.StringIO()
    argv = ["bench", "--device", "cpu", "--micro-batches", "4", "--no-progress", "--te"]
    argv += ["--json", str(folder / "bench.json")]
    if HAS_MATPLOTLIB:  # the bench extra; the README's test install has only the test extra
        argv += ["--plot", str(folder / "bench.png")]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        threads_during = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    return {
        "code": code,
        "stdout": out.getvalue(),
        "stderr": err.getvalue(),
        "report": json.loads((folder / "bench.json").read_text()),
        "png": (folder / "bench.png").read_bytes() if HAS_MATPLOTLIB else None,
        "threads": threads_during,
    }


def test_bench_exit_status_and_table(bench: dict[str, Any]) -> None:
    assert bench["code"] == 0, bench["stdout"] + bench["stderr"]
    assert bench["threads"] == 1  # --threads defaults to 1 on CPU
    out = bench["stdout"]
    assert out.startswith("machine: ")
    assert re.search(
        r"^scenario\s+run\s+growth/mb\s+record/mb\s+pin/mb \(analytic\)\s+peak\s+step \(median\)", out, re.M
    )
    for name in ("pp-last-stage", "lora-checkpoint"):
        for run in ("unguarded", "guarded"):
            assert re.search(rf"^{name}\s+{run}\s+\d+\.\d+ MiB", out, re.M)
        assert f"{name}: instrument: unguarded growth - record ≈ pin (±5%): " in out
        assert f"{name}: guarded growth ≤ record + 1% of pin: extra 0.0 B/micro-batch ok" in out
        assert f"{name}: grads bitwise equal: True ok" in out
    assert "FAIL" not in out


def test_bench_te_on_cpu_is_skipped_in_one_line(bench: dict[str, Any]) -> None:
    assert "Traceback" not in bench["stderr"]
    assert bench["stderr"].strip().splitlines() == [
        "gradguard bench: skipping no-adapter: it needs --micro-batches >= 8",  # 4 here
        "gradguard bench: skipping --te: Transformer Engine runs on CUDA only",
    ]
    assert list(bench["report"]["scenarios"]) == ["pp-last-stage", "lora-checkpoint"]


def test_bench_json_has_exactly_the_schema(bench: dict[str, Any]) -> None:
    report = bench["report"]
    assert set(report) == {"device", "torch", "machine", "scenarios"}
    assert report["device"] == "cpu"
    assert report["torch"] == torch.__version__
    assert isinstance(report["machine"], str) and f"torch {torch.__version__}" in report["machine"]
    assert set(report["scenarios"]) == {"pp-last-stage", "lora-checkpoint"}
    for result in report["scenarios"].values():
        assert set(result) == SCENARIO_KEYS
        assert type(result["expected_pinned_bytes_per_microbatch"]) is int
        assert type(result["record_bytes_per_microbatch"]) is int
        assert type(result["grads_equal"]) is bool
        for run in ("unguarded", "guarded"):
            r = result[run]
            assert set(r) == RUN_KEYS
            assert type(r["micro_batches"]) is int and r["micro_batches"] == 4
            assert type(r["growth_bytes_per_microbatch"]) is float
            assert type(r["peak_bytes"]) is int
            assert isinstance(r["allocated_bytes"], list) and len(r["allocated_bytes"]) == r["micro_batches"]
            assert all(type(b) is int for b in r["allocated_bytes"])
            assert type(r["step_time_median_s"]) is float and r["step_time_median_s"] > 0
            assert r["peak_bytes"] >= max(r["allocated_bytes"])  # CPU: the largest reading


def test_bench_meets_the_targets_on_cpu(bench: dict[str, Any]) -> None:
    size = Size()  # the defaults the bench ran with
    for name, result in bench["report"]["scenarios"].items():
        pin = result["expected_pinned_bytes_per_microbatch"]
        record = result["record_bytes_per_microbatch"]
        assert pin == 2 * size.seq * size.batch * size.hidden * 4, name
        assert record == 2 * size.seq * size.batch * 4, name
        leak = result["unguarded"]["growth_bytes_per_microbatch"] - record
        assert abs(leak - pin) <= 0.05 * pin, (name, leak, pin)
        assert abs(result["guarded"]["growth_bytes_per_microbatch"] - record) < 1, name  # CPU: 0 extra bytes
        assert result["grads_equal"] is True, name
        assert result["guarded"]["peak_bytes"] < result["unguarded"]["peak_bytes"], name


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="--plot needs matplotlib (the bench extra)")
def test_bench_plot_is_a_png(bench: dict[str, Any]) -> None:
    assert bench["png"][:8] == PNG_SIGNATURE
    assert len(bench["png"]) > 1000


# --------------------------------------------------------------------------- bench: the measurement


@pytest.mark.parametrize("name", ["pp-last-stage", "lora-checkpoint"])
def test_analytic_expectation_on_a_tiny_config(name: str) -> None:
    scenario = build(name, CPU, TINY)
    assert scenario.name == name
    assert scenario.expected_pinned_bytes_per_microbatch == 2 * 8 * 1 * 16 * 4  # leaf + its grad, float32
    assert scenario.record_bytes_per_microbatch == 2 * 8 * 1 * 4  # log_probs + entropy, float32

    bf16 = build(name, CPU, Size(seq=8, batch=1, hidden=16, vocab=32, dtype=torch.bfloat16))
    assert bf16.expected_pinned_bytes_per_microbatch == 2 * 8 * 1 * 16 * 2
    assert bf16.record_bytes_per_microbatch == 2 * 8 * 1 * 4  # the record is computed in float32


@pytest.mark.parametrize("name", ["pp-last-stage", "lora-checkpoint"])
def test_measured_growth_matches_the_analytic_pin(name: str) -> None:
    ticks: list[int] = []
    result = run_scenario(name, CPU, TINY, 4, lambda: ticks.append(1))
    assert len(ticks) == 2 * 4
    assert set(result) == SCENARIO_KEYS
    pin, record = result["expected_pinned_bytes_per_microbatch"], result["record_bytes_per_microbatch"]
    assert (pin, record) == (1024, 64)
    unguarded, guarded = result["unguarded"], result["guarded"]
    assert set(unguarded) == set(guarded) == RUN_KEYS
    assert unguarded["micro_batches"] == guarded["micro_batches"] == len(unguarded["allocated_bytes"]) == 4
    assert abs(unguarded["growth_bytes_per_microbatch"] - record - pin) <= 0.05 * pin
    assert abs(unguarded["growth_bytes_per_microbatch"] - (pin + record)) < 1  # CPU: exact bytes
    steps = [b - a for a, b in zip(unguarded["allocated_bytes"], unguarded["allocated_bytes"][1:])]
    assert steps == [pin + record] * 3
    assert abs(guarded["growth_bytes_per_microbatch"] - record) < 1
    steps = [b - a for a, b in zip(guarded["allocated_bytes"], guarded["allocated_bytes"][1:])]
    assert steps == [record] * 3
    assert result["grads_equal"] is True


def test_no_adapter_the_watch_alone_reports_the_store_and_bounds_it() -> None:
    """The seed's engine with no adapter: only the watch; exact bytes on CPU."""
    ticks: list[int] = []
    result = run_no_adapter(CPU, TINY, 10, lambda: ticks.append(1))
    pin, record = result["expected_pinned_bytes_per_microbatch"], result["record_bytes_per_microbatch"]
    assert (result["kind"], result["engine"], pin, record) == ("no-adapter", "pp-last-stage", 1024, 64)
    unwatched, detach, raised, warned = (result[m] for m in MODES)
    assert abs(unwatched["growth_bytes_per_microbatch"] - (pin + record)) < 1  # CPU: exact bytes
    assert abs(warned["growth_bytes_per_microbatch"] - (pin + record)) < 1  # warn leaves it as it is
    for run in (detach, raised, warned):
        assert run["reported_at_microbatch"] is not None and run["reported_at_microbatch"] <= REPORT_WITHIN
        assert {h[2] for h in run["holders"]} == {"micro"}
        assert any("forward_data_store[*]['model_output']['log_probs']" in h[0] for h in run["holders"])
    assert {h[1] for h in detach["holders"]} == {"repaired"}
    assert detach["growth_after_report_bytes_per_microbatch"] == record  # the records' own bytes, no graph
    assert len(raised["allocated_bytes"]) == raised["reported_at_microbatch"]  # stopped by the raise
    assert "across the micro-batches of one step" in raised["error"]
    assert warned["warnings"] >= 1 and "forward_data_store" in warned["warning"]
    assert result["grads_equal"] is True
    assert len(ticks) == 10 * 3 + raised["reported_at_microbatch"]
    assert all(ok for _, ok, _ in no_adapter_verdicts(result))
    text = table({"scenarios": {"no-adapter": result}})
    assert re.search(r"^detach\s+64 B after the report .*micro-batch \d\s+repaired", text, re.M)
    assert "FAIL" not in text


def test_build_refuses_an_unknown_scenario() -> None:
    with pytest.raises(ValueError, match=r"unknown scenario 'nope'; known: pp-last-stage, lora-checkpoint"):
        build("nope", CPU, TINY)
    assert {"pp-last-stage", "lora-checkpoint"} <= set(SCENARIOS)


def test_seed_preset_pins_the_prs_figure() -> None:
    size, micro_batches = PRESETS["seed-pp4"]
    per_micro_batch = 2 * size.seq * size.batch * size.hidden * size.dtype.itemsize
    assert abs(per_micro_batch / 2**20 - 45.4) < 0.05
    assert micro_batches == 1024


# --------------------------------------------------------------------------- bench: refusals


def test_seed_preset_on_cpu_refuses_with_the_memory_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--preset", "seed-pp4", "--device", "cpu", "--no-progress"]) == 2
    captured = capsys.readouterr()
    line = _one_line_refusal(captured.err)
    size, micro_batches = PRESETS["seed-pp4"]
    need = micro_batches * 2 * size.seq * size.batch * size.hidden * size.dtype.itemsize
    assert f"~{need / 2**30:.1f} GiB" in line
    assert "~45.4 GiB" in line and "1024 micro-batches × 45.4 MiB" in line
    assert captured.out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "cuda", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "torch sees no CUDA device" in _one_line_refusal(captured.err)
    assert captured.out == ""


def test_unknown_scenario_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "cpu", "--scenario", "nope", "--no-progress"]) == 2
    line = _one_line_refusal(capsys.readouterr().err)
    assert line == (
        "gradguard bench: --scenario='nope' is not accepted; accepted: pp-last-stage, lora-checkpoint, "
        "pp-last-stage-te, megatron-gpt, no-adapter"
    )


def test_no_adapter_refuses_too_few_micro_batches_and_the_late_leak(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "--device", "cpu", "--scenario", "no-adapter", "--no-progress"]
    assert main([*argv, "--micro-batches", "7"]) == 2
    assert _one_line_refusal(capsys.readouterr().err) == (
        "gradguard bench: --scenario no-adapter needs --micro-batches >= 8 (the report comes by micro-batch 4, "
        "the growth after it needs 4 more); got 7"
    )
    assert main([*argv, "--late-leak"]) == 2
    assert "not no-adapter" in _one_line_refusal(capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_te_scenario_named_directly_without_te_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["bench", "--device", "cpu", "--scenario", "pp-last-stage-te", "--micro-batches", "2", "--no-progress"])
        == 2
    )
    line = _one_line_refusal(capsys.readouterr().err)
    assert (
        line
        == "gradguard bench: --scenario pp-last-stage-te needs Transformer Engine: Transformer Engine runs on CUDA only"
    )


@pytest.mark.parametrize("n", ["1", "0", "-3"])
def test_too_few_micro_batches_refuse(capsys: pytest.CaptureFixture[str], n: str) -> None:
    assert main(["bench", "--device", "cpu", "--micro-batches", n, "--no-progress"]) == 2
    assert _one_line_refusal(capsys.readouterr().err) == (
        f"gradguard bench: --micro-batches={n!r} is not accepted; accepted: a whole number >= 2 (a slope needs two "
        "points)"
    )


def test_plot_without_matplotlib_refuses(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = tmp_path / "plot.png"
    assert main(["bench", "--device", "cpu", "--micro-batches", "4", "--plot", str(path), "--no-progress"]) == 2
    captured = capsys.readouterr()
    line = _one_line_refusal(captured.err)
    assert "--plot needs matplotlib" in line and "pip install 'gradguard[bench]'" in line
    assert captured.out == "" and not path.exists()


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--device", "tpu"]) == 2
    assert "--device='tpu' is not accepted; accepted: auto, cpu, cuda" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([])  # no sub-command: argparse's own usage error
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["bench", "--no-such-option"])
    assert info.value.code == 2


def test_bench_help_through_the_module() -> None:
    proc = _run(sys.executable, "-m", "gradguard", "bench", "--help")
    assert proc.returncode == 0, proc.stderr
    for option in (
        "--device",
        "--scenario",
        "--micro-batches",
        "--preset",
        "--json",
        "--plot",
        "--te",
        "--no-progress",
    ):
        assert option in proc.stdout
    assert proc.stdout.startswith("usage: gradguard bench")


# --------------------------------------------------------------------------- bad input, refused before the run

SMALL = ["bench", "--scenario", "lora-checkpoint", "--micro-batches", "3", "--no-progress"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--threads", "-3"], "--threads='-3' is not accepted; accepted: 0 (torch's default) or a positive whole"),
        (["--threads", "two"], "--threads='two' is not accepted; accepted: 0 (torch's default) or a positive whole"),
        (
            ["--json", "/nonexistent/dir/out.json"],
            "--json='/nonexistent/dir/out.json' is not accepted (the folder '/nonexistent/dir' does not exist)",
        ),
        (
            ["--plot", "/nonexistent/dir/out.png"],
            "--plot='/nonexistent/dir/out.png' is not accepted (the folder '/nonexistent/dir' does not exist)",
        ),
        (["--json", ""], "--json='' (an empty value) is not accepted; accepted: a file path in an existing, writable"),
        (["--plot", " "], "--plot=' ' (an empty value) is not accepted; accepted: a file path in an existing"),
        (["--memory-cap", "lots"], "--memory-cap='lots' is not accepted; accepted: a positive number of GiB"),
        (["--micro-batches", "many"], "--micro-batches='many' is not accepted; accepted: a whole number >= 2"),
        (["--leak-start", "0"], "--leak-start='0' is not accepted; accepted: a whole number >= 1"),
        (["--device", ""], "--device='' (an empty value) is not accepted; accepted: auto, cpu, cuda"),
        (["--preset", "x"], "--preset='x' is not accepted; accepted: seed-pp4"),
    ],
    ids=[
        "negative-threads",
        "word-threads",
        "json-folder",
        "plot-folder",
        "json-empty",
        "plot-blank",
        "cap-word",
        "micro-batches-word",
        "leak-start-zero",
        "device-empty",
        "preset-unknown",
    ],
)
def test_bad_bench_options_are_refused_before_running(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, *extra]) == 2
    captured = capsys.readouterr()
    assert _one_line_refusal(captured.err).startswith(f"gradguard bench: {message}")
    assert captured.out == "" and "Traceback" not in captured.err


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_cap_that_is_not_a_finite_number_refuses(capsys: pytest.CaptureFixture[str], value: str) -> None:
    assert main(["bench", "--device", "cpu", "--memory-cap", value, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.strip() == (
        f"gradguard bench: --memory-cap={value!r} is not accepted; accepted: a positive number of GiB"
    )


def test_a_bad_gradguard_variable_is_a_one_line_refusal_of_bench() -> None:
    proc = _run(sys.executable, "-m", "gradguard", *SMALL, GRADGUARD="bogus")
    assert proc.returncode == 2
    line = _one_line_refusal(proc.stderr)
    assert "GRADGUARD='bogus' is not a gradguard mode; accepted:" in line
    assert proc.stdout == ""  # nothing ran


def test_gradguard_off_does_not_fail_the_guarded_run(tmp_path: Any) -> None:
    """The guarded run pins its mode: GRADGUARD=off must not turn it off and report FAIL."""
    out = tmp_path / "r.json"
    proc = _run(sys.executable, "-m", "gradguard", *SMALL, "--json", str(out), GRADGUARD="off")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout
    report = json.loads(out.read_text())
    result = report["scenarios"]["lora-checkpoint"]
    assert abs(result["guarded"]["growth_bytes_per_microbatch"] - result["record_bytes_per_microbatch"]) < 1
