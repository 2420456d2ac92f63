"""Make the run page's pictures in the documentation from a real run (docs/guide/report.md).

Runs a two-rank ``torchrun`` job under ``gradguard run --mode warn`` in which only rank 1 keeps every
step's loss, writes the run's page and its ``--png`` plot, and takes a screenshot of the page in headless
Chromium. Run from the repository's root::

    python docs/assets/make_report_page.py

It rewrites ``docs/assets/report-page.png`` (the screenshot) and ``docs/assets/report-plot.png``.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

TRAIN = """\
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
losses = []
for step in range(40):
    for micro in range(4):
        loss = model(torch.randn(64, 256)).pow(2).mean()
        loss.backward()
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 1:
        losses.append(loss)  # the leak, on rank 1 only
dist.destroy_process_group()
"""

ASSETS = Path(__file__).resolve().parent


def main() -> int:
    chromium = next(
        (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None
    )
    if chromium is None:
        print("make_report_page: no chromium on PATH: apt-get install chromium", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        (work / "train.py").write_text(TRAIN)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "gradguard", "run", "--mode", "warn", "--html", "page.html", "--png",
                   str(ASSETS / "report-plot.png"), sys.executable, "-m", "torch.distributed.run",
                   "--nproc_per_node", "2", "--master_port", str(port), "train.py"]  # fmt: skip
        subprocess.run(command, cwd=work, check=True)
        subprocess.run(
            [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", "--window-size=1100,1100",
             f"--user-data-dir={work / 'profile'}", f"--screenshot={ASSETS / 'report-page.png'}",
             f"file://{work / 'page.html'}"],
            check=True, capture_output=True,
        )  # fmt: skip
    print(f"make_report_page: wrote {ASSETS / 'report-page.png'} and {ASSETS / 'report-plot.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
