"""``gradguard run`` reaches every process that trains, through real launchers: torchrun (gloo, 2 ranks),
``accelerate launch`` (2 CPU processes), deepspeed's launcher (2 CPU ranks), multiprocessing fork and
spawn children, a Ray actor in a local cluster the driver starts (and through ``runtime_env``). Each
leaking run must give a finding from the training process, tagged with its rank (or actor, or pid), in
one merged summary, and exit non-zero under ``--mode raise``; a clean run exits 0 and says what it
checked.

Each test is one ``gradguard run`` of a line of docs/guide/launchers.md's table (with a free port and a run folder
of the test's own); the launchers' start-up dominates, so the programs train three tiny steps.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from _helpers import env, require_engine, require_gloo
from _tables import table_rows

pytestmark = pytest.mark.integration

BIN = os.path.dirname(sys.executable)  # torchrun, accelerate: the console scripts of this environment

DDP = """
import sys
import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
KEPT = []
for _ in range(3):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if "--leak" in sys.argv:
        KEPT.append(loss)
print(f"rank {dist.get_rank()} done", flush=True)
dist.destroy_process_group()
"""

ACCELERATE = """
import sys
import torch
from accelerate import Accelerator

torch.set_num_threads(1)
accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(4, 1)
model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
losses = []
for _ in range(3):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    if "--leak" in sys.argv:
        losses.append(loss)
print(f"process {accelerator.process_index}/{accelerator.num_processes} done", flush=True)
"""

CHILDREN = """
import multiprocessing
import sys

import torch

KEPT = []


def train(leak):
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if leak:
            KEPT.append(loss)


if __name__ == "__main__":
    for method in ("fork", "spawn"):
        child = multiprocessing.get_context(method).Process(target=train, args=("--leak" in sys.argv,))
        child.start()
        child.join()
        print(method, "child exit code", child.exitcode, flush=True)  # the parent itself exits 0
"""

RAY = """
import json
import os
import sys

import ray

# An existing cluster would take the variables as runtime_env={"env_vars": ...} (docs/guide/launchers.md).
runtime_env = {"env_vars": json.loads(os.environ["GRADGUARD_ENV_JSON"])} if "GRADGUARD_ENV_JSON" in os.environ else None
ray.init(
    num_cpus=2,
    include_dashboard=False,
    object_store_memory=80 * 2**20,
    _temp_dir=os.environ["RAY_TMP"],
    runtime_env=runtime_env,
)


@ray.remote(num_cpus=1)
class Trainer:
    def __init__(self):
        self.losses = []

    def train(self, leak):
        import torch

        torch.set_num_threads(1)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(torch.randn(2, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if leak:
                self.losses.append(loss)  # actor state, as a verl worker keeps it
        return len(self.losses)


try:
    trainer = Trainer.remote()
    print("kept", ray.get(trainer.train.remote("--leak" in sys.argv)), flush=True)
finally:
    ray.shutdown()
"""


ONE = """
import torch

model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
kept = []
for _ in range(3):
    loss = model(torch.randn(2, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    kept.append(loss)
print("trained", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp_path: Path, script: str, source: str, *command: str, **extra: str | None) -> dict[str, Any]:
    """``gradguard run --mode raise --audit-every 1 --report-dir RUN *command``, the script written first."""
    (tmp_path / script).write_text(source)
    folder = tmp_path / "run"
    environ = env(GRADGUARD_AUDIT=None, OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra)
    argv = [sys.executable, "-m", "gradguard", "run", "--mode", "raise", "--audit-every", "1"]
    run = subprocess.run(
        [*argv, "--report-dir", str(folder), *command],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=environ,
        timeout=540,
    )
    reports = [json.loads(p.read_text()) for p in sorted(folder.glob("report-*.json"))]
    err = run.stderr
    summary = err[err.rindex("gradguard stats:") :] if "gradguard stats:" in err else ""
    return {"code": run.returncode, "out": run.stdout, "err": err, "summary": summary, "reports": reports}


def _rows(summary: str, first: str) -> list[list[str]]:
    """The rows of the table whose header starts with ``first``, a holder's fix its last cell."""
    return table_rows(summary, first)


def _trainers(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in reports if r["kind"] == "process" and r["figures"]["boundaries"] > 0]


def test_torchrun_two_gloo_ranks(tmp_path: Path) -> None:
    require_gloo()
    run = _run(tmp_path, "train.py", DDP, "torchrun", "--nproc_per_node", "2", f"--master_port={_free_port()}",
               "train.py", "--leak")  # fmt: skip
    assert run["code"] != 0, run["err"]
    assert "[rank 0/2, pid " in run["err"] and "[rank 1/2, pid " in run["err"]  # each rank's own error, tagged
    assert _rows(run["summary"], "holder")[0][:2] == ["__main__:KEPT[*]", "ranks 0-1 of 2"]
    assert "raised" in _rows(run["summary"], "holder")[0]
    assert sorted(r["label"] for r in _trainers(run["reports"])) == ["rank 0/2", "rank 1/2"]
    assert all(r["rank_from"] == "torch.distributed" for r in _trainers(run["reports"]))


def test_accelerate_launch_two_cpu_processes(tmp_path: Path) -> None:
    require_engine("accelerate")
    require_gloo()
    port = f"--main_process_port={_free_port()}"
    # On a machine without a GPU, accelerate's multi-process launcher is the one named --multi_gpu (torchrun
    # underneath); --cpu alone starts one process. Accelerator(cpu=True) in the script keeps it on the CPU.
    command = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", port, "train.py", "--leak"]
    run = _run(tmp_path, "train.py", ACCELERATE, *command)
    assert run["code"] != 0, run["err"]
    assert _rows(run["summary"], "holder")[0][:2] == ["__main__:losses[*]", "ranks 0-1 of 2"]
    assert sorted(r["label"] for r in _trainers(run["reports"])) == ["rank 0/2", "rank 1/2"]


def test_deepspeed_launcher_two_cpu_ranks(tmp_path: Path) -> None:
    require_engine("deepspeed")  # optional: CI installs it; the launcher runs on CPU with DeepSpeed's CPU accelerator
    require_gloo()
    command = ["deepspeed", "--num_gpus", "2", "--master_port", str(_free_port()), "train.py", "--leak"]
    run = _run(tmp_path, "train.py", DDP, *command)
    assert run["code"] != 0, run["err"]
    assert "[rank 0/2, pid " in run["err"] or "[rank 1/2, pid " in run["err"]
    assert _rows(run["summary"], "holder")[0][:2] == ["__main__:KEPT[*]", "ranks 0-1 of 2"]
    assert sorted(r["label"] for r in _trainers(run["reports"])) == ["rank 0/2", "rank 1/2"]


def test_multiprocessing_fork_and_spawn_children(tmp_path: Path) -> None:
    run = _run(tmp_path, "train.py", CHILDREN, "train.py", "--leak")
    assert run["code"] == 1, run["err"]  # the parent exited 0: its children's findings fail the run
    assert "fork child exit code 1" in run["out"] and "spawn child exit code 1" in run["out"]
    fork, spawn = _trainers(run["reports"])[0], _trainers(run["reports"])[1]
    if fork["holders"][0]["holder"].startswith("__mp_main__"):
        fork, spawn = spawn, fork
    # a fork child ends with os._exit: its report is written at its end through multiprocessing's finalizers
    assert fork["holders"][0]["holder"] == "__main__:KEPT[*]" and fork["at_exit"]
    assert spawn["holders"][0]["holder"] == "__mp_main__:KEPT[*]" and spawn["at_exit"]
    assert {(r[0], r[1], r[-2]) for r in _rows(run["summary"], "holder")} == {
        ("__main__:KEPT[*]", f"pid {fork['pid']}", "raised"),
        ("__mp_main__:KEPT[*]", f"pid {spawn['pid']}", "raised"),
    }
    assert f"[pid {fork['pid']} on " in run["err"] and f"[pid {spawn['pid']} on " in run["err"]


def test_a_clean_run_exits_0_and_says_what_it_checked(tmp_path: Path) -> None:
    run = _run(tmp_path, "train.py", CHILDREN, "train.py")
    assert run["code"] == 0, run["err"]
    summary = run["summary"].splitlines()
    head = summary[1]
    assert head.startswith("gradguard watch: 6 step boundaries (") and ", in 3 processes" in head
    finding = "  no graph the watch followed outlived two step boundaries"
    assert any(line.startswith(finding) for line in summary), summary  # the finding, on a line of its own
    assert [row[1] for row in _rows(run["summary"], "process")] == ["3", "3"]
    assert "that imported torch but ran no optimizer step: pid " in run["summary"]  # the parent: said, not "clean"


def _ray_recipe(tmp_path: Path, ray_tmp: str) -> dict[str, Any]:
    """The existing-cluster recipe: the driver is not under gradguard run; its runtime_env carries
    ``gradguard env --json``'s variables to the actor's worker; ``gradguard report`` merges afterwards."""
    (tmp_path / "driver.py").write_text(RAY)
    folder = tmp_path / "run"
    gradguard = [sys.executable, "-m", "gradguard"]
    settings = ["--mode", "raise", "--audit-every", "1", "--report-dir", str(folder)]
    exported = subprocess.run([*gradguard, "env", "--json", *settings], capture_output=True, text=True, check=True)
    environ = env(GRADGUARD_AUDIT=None, OMP_NUM_THREADS="1", RAY_TMP=ray_tmp, GRADGUARD_ENV_JSON=exported.stdout)
    driver = subprocess.run(
        [sys.executable, "driver.py", "--leak"], capture_output=True, text=True, cwd=tmp_path, env=environ, timeout=400
    )
    assert driver.returncode != 0 and "RayTaskError(GraphRetentionError)" in driver.stderr, driver.stderr
    merged = subprocess.run([*gradguard, "report", str(folder)], capture_output=True, text=True, timeout=120)
    reports = [json.loads(p.read_text()) for p in sorted(folder.glob("report-*.json"))]
    return {"code": merged.returncode, "err": driver.stderr, "summary": merged.stdout, "reports": reports}


@pytest.mark.parametrize("how", ["gradguard run", "runtime_env"])
def test_a_ray_actor_in_a_local_cluster(tmp_path: Path, how: str) -> None:
    require_engine("ray")
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay short
    try:
        if how == "gradguard run":  # the driver starts the cluster: its workers inherit the environment
            run = _run(tmp_path, "driver.py", RAY, "python", "driver.py", "--leak", RAY_TMP=ray_tmp)
        else:
            run = _ray_recipe(tmp_path, ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert run["code"] != 0, run["err"]
    assert "[actor Trainer, pid " in run["err"] and "not set up in process" not in run["err"]
    (row,) = _rows(run["summary"], "holder")
    assert row[0].startswith("actor Trainer: self.losses[") and row[1] == "actor Trainer"
    assert row[-2:] == [
        "raised",
        "detach before storing into self.losses[0] (in actor Trainer): t.detach() or t.item(); "
        "or self.losses = gradguard.guard([]), which detaches what is stored, or refuses it in raise mode",
    ]
    assert "ray._private" not in run["summary"]
    (actor,) = _trainers(run["reports"])
    assert actor["actor"] == "Trainer" and actor["label"] == "actor Trainer"


def test_a_second_virtualenv_with_torch_but_not_gradguard_is_said_not_checked(tmp_path: Path) -> None:
    """``gradguard run`` installed in a tools environment, training in a project's: the project's interpreter
    imports torch (here through a ``.pth`` file naming this environment's packages) but not gradguard."""
    import sysconfig
    import venv

    project = tmp_path / "venv2"
    venv.create(project, with_pip=False)
    (site,) = project.glob("lib/python3*/site-packages")
    (site / "torch_from_elsewhere.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    python = str(project / "bin" / "python")
    probe = subprocess.run(
        [python, "-c", "import gradguard"], capture_output=True, text=True, cwd=tmp_path, env=env(PYTHONPATH=None)
    )
    if probe.returncode == 0:
        pytest.skip("gradguard is importable from a fresh virtualenv here (installed outside the environment)")
    run = _run(tmp_path, "train.py", ONE, python, "train.py", PYTHONPATH=None)
    assert run["code"] == 0 and "trained" in run["out"], run["err"]
    assert "(the command) imported torch, but gradguard could not be set up in it: ModuleNotFoundError" in run["err"]
    assert f"(its Python: {python};" in run["err"]
    assert run["err"].splitlines()[-1] == (
        "gradguard run: nothing was checked: no report of a process gradguard was set up in could be used"
    )
