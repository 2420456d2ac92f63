"""``benchmarks/device/run.sh``, the CUDA proof in one call, checked as far as a CPU allows.

No GPU here: the tests cover the argument parsing, the plan a ``--dry-run`` prints (the CUDA run's
exact commands), the list of CUDA-only tests it runs (against the tests that exist), the scenarios
and presets it names (against the bench's), the wheel checks, the offline install of the carried
wheels into a fresh Python 3.12 virtual environment (the device image's Python), and a whole
``--cpu`` run (every step on the CPU at a small size, the same files written).
"""

from __future__ import annotations

import ast
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from _helpers import require_engine

REPO = Path(__file__).resolve().parents[2]
RUN_SH = REPO / "benchmarks" / "device" / "run.sh"
sys.path.insert(0, str(REPO / "benchmarks" / "device"))
import check_wheels  # noqa: E402

TIMEOUT_S = 600  # the --cpu run takes minutes on a loaded machine (its own budget is 450 s)
# The benchmarks' verdicts that rest on the machine's speed: a share of the wall time, the watch's own
# microseconds, and what the watch's time budgets decide on short steps (which backwards' roots are
# stamped, how often a repaired holder is read again). A loaded machine can miss them; the benchmark
# measures them and says MISSED (exit 1), and the tests assert no timing.
BENCH_TIMED = ("the watch's share of the wall time", "reported within 5 boundaries of the leak's start")
TIMED_VERDICTS = (
    *BENCH_TIMED,  # gradguard bench --late-leak's (it exits 1 on a missed verdict)
    "share of the wall time after the start-up check",  # the watch benchmark's (it exits 0)
    "of the watch's own time per boundary",
    "of the watch's own time per backward for its root's stamp",
    "reported within 3 boundaries of its start",
    "memory stops growing within 5 boundaries of the report",
)


def run_sh(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "GRADGUARD"}
    full.update(env)
    return subprocess.run(
        ["bash", str(RUN_SH), *args], capture_output=True, text=True, env=full, timeout=TIMEOUT_S, cwd=REPO
    )


def _missing(what: str) -> None:
    if os.environ.get("GRADGUARD_REQUIRE_ENGINES") == "1":
        pytest.fail(f"{what} (GRADGUARD_REQUIRE_ENGINES=1); .ci/run fetches the wheels")
    pytest.skip(what)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The carried wheels: .whl/ when it checks out (.ci/run fetches it); else megatron-core's wheel
    from there and gradguard's built from this tree (from a copy: building in the tree leaves build/).
    Built again each time the module's tests start in a process: run.sh refuses a wheel that no longer
    matches the tree, and the tree may change during a long run."""
    carried = REPO / ".whl"
    if all(ok for ok, _ in check_wheels.check(carried)):
        return carried
    found = sorted(carried.glob("megatron_core-*.whl"))
    if not found:
        _missing("no megatron-core wheel in .whl/: run benchmarks/device/fetch_wheels.sh")
    return _build_wheels(found[-1], tmp_path_factory.mktemp("wheels"))


def _build_wheels(megatron: Path, folder: Path) -> Path:
    out, src = folder / "whl", folder / "src"
    out.mkdir()
    shutil.copy(megatron, out)
    for name in ("gradguard", "gradguard_pytest"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    proc = subprocess.run([*build, "--no-build-isolation"], capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:  # this environment's setuptools cannot build it: pip's isolated build
        proc = subprocess.run(build, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [f"{hashlib.sha256(w.read_bytes()).hexdigest()}  {w.name}" for w in sorted(out.glob("*.whl"))]
    (out / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return out


# --------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "run.sh: OUTDIR is missing"),
        (("--fast", "out"), "run.sh: unknown option --fast"),
        (("a", "b"), "run.sh: one OUTDIR, got 'a' and 'b'"),
    ],
)
def test_bad_arguments_exit_2_with_the_usage(args: tuple[str, ...], message: str) -> None:
    proc = run_sh(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[0] == message
    assert "usage: benchmarks/device/run.sh [--dry-run | --cpu] OUTDIR" in proc.stderr
    assert proc.stdout == ""


def test_help_exits_0() -> None:
    proc = run_sh("--help")
    assert proc.returncode == 0 and "usage: benchmarks/device/run.sh" in proc.stderr


def test_unusable_wheels_stop_before_anything_runs(tmp_path: Path) -> None:
    proc = run_sh("--dry-run", str(tmp_path / "out"), GRADGUARD_WHEELS=str(tmp_path / "none"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "run benchmarks/device/fetch_wheels.sh" in proc.stdout
    assert "=== install" not in proc.stdout


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


def test_dry_run_prints_the_cuda_run_and_runs_nothing(wheels: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_sh("--dry-run", str(out), GRADGUARD_WHEELS=str(wheels))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = dict(re.findall(r"^=== ([\w-]+): (.*)$", proc.stdout, re.M))
    assert list(steps) == [
        "install",
        "doctor",
        "cuda-tests",
        "bench-defaults",
        "bench-seed-pp4",
        "bench-megatron-gpt",
        "bench-no-adapter",
        "bench-late-leak",
        "bench-watch",
    ]
    assert re.search(
        r"--device cuda --preset seed-pp4 --scenario no-adapter --micro-batches 256 ", steps["bench-no-adapter"]
    )
    assert re.search(r"-P -m benchmarks.watch --device cuda --scenario pp-last-stage ", steps["bench-watch"])
    assert "--no-index --no-deps" in steps["install"] and f"{wheels}/" in steps["install"]
    assert "--python-version" not in steps["install"]  # the device's Python is the wheels' 3.12
    assert steps["doctor"].endswith("-P -m gradguard doctor")
    assert all(t in steps["cuda-tests"] for t in cuda_tests_in_run_sh())
    assert re.search(r"-m gradguard bench --no-progress --device cuda --json \S+$", steps["bench-defaults"])
    assert re.search(r"--device cuda --preset seed-pp4 --json \S+$", steps["bench-seed-pp4"])
    assert re.search(
        r"--device cuda --preset seed-pp4 --scenario megatron-gpt --micro-batches 64 ", steps["bench-megatron-gpt"]
    )
    assert re.search(
        r"--device cuda --late-leak --scenario pp-last-stage --scenario lora-checkpoint ", steps["bench-late-leak"]
    )
    assert "--te is added to the defaults run only if Transformer Engine imports there" in proc.stdout
    assert list(out.iterdir()) == []  # nothing written


def cuda_tests_in_run_sh() -> list[str]:
    text = RUN_SH.read_text()
    block = re.search(r"^CUDA_TESTS=\(\n(.*?)^\)", text, re.M | re.S)
    assert block, "run.sh has no CUDA_TESTS=( ... ) block"
    return block.group(1).split()


def _needs_cuda(decorator: ast.expr) -> bool:
    """``pytest.mark.skipif(not torch.cuda.is_available(), ...)``."""
    if not (isinstance(decorator, ast.Call) and ast.unparse(decorator.func) == "pytest.mark.skipif" and decorator.args):
        return False
    cond = decorator.args[0]
    return (
        isinstance(cond, ast.UnaryOp)
        and isinstance(cond.op, ast.Not)
        and ast.unparse(cond.operand) == "torch.cuda.is_available()"
    )


def test_run_sh_runs_every_cuda_only_test_there_is() -> None:
    found = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                if any(_needs_cuda(d) for d in node.decorator_list):
                    found.append(f"{path.relative_to(REPO).as_posix()}::{node.name}")
    assert found, "no CUDA-only test found: the scan is broken"
    assert sorted(cuda_tests_in_run_sh()) == sorted(found)


def test_run_sh_names_scenarios_and_presets_the_bench_has() -> None:
    from gradguard._tools.bench.scenarios import PRESETS, SCENARIOS

    text = RUN_SH.read_text()
    scenarios = set(re.findall(r"--scenario ([\w-]+)", text))
    presets = set(re.findall(r"--preset ([\w-]+)", text))
    assert scenarios == {"megatron-gpt", "pp-last-stage", "lora-checkpoint", "no-adapter"}
    assert scenarios <= {*SCENARIOS, "no-adapter"}
    assert presets == {"seed-pp4"} and presets <= set(PRESETS)


def test_the_megatron_gpt_run_grows_by_at_least_1_gib() -> None:
    from gradguard._tools.bench.megatron_gpt import pin_bytes, record_bytes
    from gradguard._tools.bench.scenarios import PRESETS

    size, _ = PRESETS["seed-pp4"]
    micro_batches = int(re.search(r"--scenario megatron-gpt \\\n\s+--micro-batches (\d+)", RUN_SH.read_text()).group(1))
    growth = micro_batches * (pin_bytes(size) + record_bytes(size))
    assert growth >= 2**30, growth
    assert abs(pin_bytes(size) / 2**20 - 45.4) < 0.05  # the seed-pp4 preset: 45.4 MiB pinned per micro-batch


# --------------------------------------------------------------------------------------------------
# The wheel checks (synthetic wheels: no network)
# --------------------------------------------------------------------------------------------------


def _fake_wheels(folder: Path, tree_edit: dict[str, bytes] | None = None) -> Path:
    folder.mkdir()
    with zipfile.ZipFile(folder / "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl", "w") as z:
        z.writestr("megatron/core/__init__.py", "")
    with zipfile.ZipFile(folder / "gradguard-0.1.0-py3-none-any.whl", "w") as z:
        for name, data in {**check_wheels.tree_files(), **(tree_edit or {})}.items():
            z.writestr(name, data)
        z.writestr("gradguard-0.1.0.dist-info/METADATA", "Name: gradguard\n")
    lines = [f"{hashlib.sha256(w.read_bytes()).hexdigest()}  {w.name}" for w in sorted(folder.glob("*.whl"))]
    (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return folder


def test_the_tree_holds_the_package_data_a_wheel_of_it_carries() -> None:
    # The run page's template is package data: the check compared .py files only and called every fresh
    # wheel stale, so CI's fetch of the wheels failed.
    files = check_wheels.tree_files()
    assert "gradguard/_tools/page/templates/page.html.j2" in files and "gradguard/py.typed" in files
    assert "gradguard/_launch/bootstrap/sitecustomize.py" in files


def test_check_wheels_accepts_a_fresh_set(tmp_path: Path) -> None:
    findings = check_wheels.check(_fake_wheels(tmp_path / "w"))
    assert all(ok for ok, _ in findings), findings
    assert any("gradguard wheel matches the working tree" in line for _, line in findings)


def test_check_wheels_refuses_a_stale_gradguard_wheel(tmp_path: Path) -> None:
    folder = _fake_wheels(tmp_path / "w", {"gradguard/_tools/cli.py": b"# an older version\n"})
    failed = [line for ok, line in check_wheels.check(folder) if not ok]
    stale = "gradguard wheel is stale: gradguard/_tools/cli.py differ from the working tree; rerun fetch_wheels.sh"
    assert failed == [stale]


def test_check_wheels_refuses_extra_wheels_bad_sums_and_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _fake_wheels(tmp_path / "w")
    (folder / "numpy-2.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"x")
    failed = [line for ok, line in check_wheels.check(folder) if not ok]
    assert "unexpected wheels (pip would install them too): numpy-2.0-cp312-cp312-manylinux_2_28_x86_64.whl" in failed
    assert any(line.startswith("SHA256SUMS: mismatch") for line in failed)
    monkeypatch.setattr(check_wheels, "LIMIT", 10)
    assert any(line.startswith("size: ") for ok, line in check_wheels.check(folder) if not ok)


def test_check_wheels_main_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert check_wheels.main([str(_fake_wheels(tmp_path / "w"))]) == 0
    assert check_wheels.main([str(tmp_path / "none")]) == 1
    assert check_wheels.main(["--x"]) == 2
    assert "no such folder; run benchmarks/device/fetch_wheels.sh" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# The carried wheels install offline into a fresh venv of the device's Python (3.12)
# --------------------------------------------------------------------------------------------------


def _python312() -> str | None:
    """A CPython 3.12 that runs (a pyenv shim may exist and refuse)."""
    candidates = [os.environ.get("GRADGUARD_PYTHON312"), shutil.which("python3.12")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))
    for c in candidates:
        if c and os.access(c, os.X_OK):
            proc = subprocess.run([c, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
            if proc.returncode == 0 and proc.stdout.strip() == "(3, 12)":
                return c
    return None


@pytest.mark.integration
def test_carried_wheels_install_offline_into_a_fresh_python312_venv(wheels: Path, tmp_path: Path) -> None:
    python = _python312()
    if python is None:
        pytest.skip("no Python 3.12 here (set GRADGUARD_PYTHON312): the device image's interpreter")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=TIMEOUT_S)
    vpy = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    proc = subprocess.run(
        [
            vpy,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-index",
            "--no-deps",
            "--no-compile",
            *map(str, sorted(wheels.glob("*.whl"))),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # no torch in this venv: nothing of either imports; read the installed files through the metadata
    probe = (
        "import importlib.metadata as m, json, sys\n"
        "def where(dist, tail):\n"
        "    return str(next(f for f in m.distribution(dist).files if str(f).endswith(tail)).locate())\n"
        "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], 'megatron': m.version('megatron-core'),"
        "'gradguard': m.version('gradguard'), 'schedules': where('megatron-core', 'pipeline_parallel/schedules.py'),"
        "'cli': where('gradguard', 'gradguard/_tools/cli.py')}))\n"
    )
    proc = subprocess.run([vpy, "-I", "-c", probe], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert (found["python"], found["megatron"], found["gradguard"]) == ("3.12", "0.19.2", "0.1.0")
    assert found["cli"].startswith(str(venv))
    # the carried megatron-core is the release the CPU harness knows: the same CUDA lines on its path
    from gradguard._tools.bench.megatron_gpt import KNOWN_CUDA_LINES, schedule_cuda_lines

    assert set(schedule_cuda_lines(Path(found["schedules"]).read_text())) == set(KNOWN_CUDA_LINES)


# --------------------------------------------------------------------------------------------------
# The whole script on the CPU
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_cpu_mode_runs_every_step_and_writes_the_eight_files(wheels: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    require_engine("megatron.core.pipeline_parallel.schedules")
    out = tmp_path / "out"
    proc = run_sh("--cpu", str(out), GRADGUARD_WHEELS=str(wheels), PYTHON=sys.executable)
    missed = [check.strip() for line in proc.stdout.splitlines() for check in re.findall(r"MISSED\s+([^;]+)", line)]
    timed = [check for check in missed if any(verdict in check for verdict in TIMED_VERDICTS)]
    assert missed == timed, proc.stdout[-6000:] + proc.stderr  # every verdict that is not a timing holds
    failed = [check for check in timed if any(verdict in check for verdict in BENCH_TIMED)]
    assert proc.returncode == (1 if failed else 0), proc.stdout[-6000:] + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "bench-cpu.json",
        "bench-cpu.md",
        "bench-cpu.png",
        "late-leak-cpu.png",
        "run.log",
        "watch-cpu.json",
        "watch-cpu.md",
        "watch-cpu.png",
    ]
    log = (out / "run.log").read_text()
    assert log == proc.stdout
    site = re.search(r"^gradguard from (\S+)/gradguard/__init__\.py$", log, re.M)
    assert site and not site.group(1).startswith(str(REPO)), "the run must use the carried wheel, not the tree"
    assert re.search(r"^megatron-core 0\.19\.2 from " + re.escape(site.group(1)), log, re.M)
    assert "--- CPU: --te not run (Transformer Engine runs on CUDA only; here: " in log
    summary = json.loads((out / "bench-cpu.json").read_text())
    assert [(s["name"], s["rc"]) for s in summary["steps"]] == [
        (name, "0")
        for name in (
            "install",
            "doctor",
            "cuda-tests",
            "bench-defaults",
            "bench-seed-pp4",
            "bench-megatron-gpt",
            "bench-no-adapter",
        )
    ] + [("bench-late-leak", "1" if failed else "0"), ("bench-watch", "0")]
    watch = json.loads((out / "watch-cpu.json").read_text())
    assert "late/lora-checkpoint" in {case["case"] for case in watch["cases"]}
    runs = summary["runs"]
    late = runs.pop("late-leak")
    assert {n: sorted(r["scenarios"]) for n, r in runs.items()} == {
        "defaults": ["lora-checkpoint", "pp-last-stage"],
        "seed-pp4": ["pp-last-stage"],
        "megatron-gpt": ["megatron-gpt"],
        "no-adapter": ["no-adapter"],
    }
    free = runs.pop("no-adapter")["scenarios"]["no-adapter"]
    pin, record = free["expected_pinned_bytes_per_microbatch"], free["record_bytes_per_microbatch"]
    assert free["unwatched"]["growth_bytes_per_microbatch"] == pin + record  # CPU: exact bytes
    assert all(free[m]["reported_at_microbatch"] <= 4 for m in ("detach", "raise", "warn"))
    assert free["detach"]["growth_after_report_bytes_per_microbatch"] == record
    assert free["grads_equal"] is True
    leak = late["late_leak"]["lora-checkpoint"]
    assert leak["leak_start"] == 20 and leak["watched"]["reported_at"] - 20 <= 5  # found within five boundaries
    for report in runs.values():
        for r in report["scenarios"].values():
            pin, record = r["expected_pinned_bytes_per_microbatch"], r["record_bytes_per_microbatch"]
            assert r["unguarded"]["growth_bytes_per_microbatch"] == pin + record  # CPU: exact bytes
            assert r["guarded"]["growth_bytes_per_microbatch"] == record
            assert r["grads_equal"] is True
    md = (out / "bench-cpu.md").read_text()
    assert "| megatron-gpt | megatron-gpt | unguarded | 4 | 526,336 B | 2,048 B | 524,288 B |" in md
    assert "- seed-pp4 / pp-last-stage: guarded slope ≤ 1% of the unguarded slope: " in md
    assert "- no-adapter / no-adapter: detach slope after the report ≤ 1% of the unwatched slope: " in md
    assert "| detach | 2,048 B after the report " in md
    assert (out / "bench-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "A leak that starts late (late-leak):" in md and "lora-checkpoint  20" in md


@pytest.mark.integration
def test_the_cuda_run_refuses_here_before_any_step(wheels: Path, tmp_path: Path) -> None:
    """Without the device's Python 3.12, or (with it) without a GPU, the CUDA run stops at once."""
    require_engine("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the CUDA run would start")
    proc = run_sh(str(tmp_path / "out"), GRADGUARD_WHEELS=str(wheels), PYTHON=sys.executable)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    if sys.version_info[:2] != (3, 12):
        assert f"the carried wheels are for CPython 3.12 (the device image); {sys.executable} is " in proc.stdout
    else:
        assert "torch sees no CUDA device here; use --cpu to check the script without one" in proc.stdout
    assert "=== doctor" not in proc.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["run.log"]
