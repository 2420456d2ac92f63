"""The run's page in a real browser (headless Chromium): made from real ``gradguard run`` runs (a
one-process leak, the seed's within-step leak with no adapter, a clean run, a folder with a corrupt
report, two torchrun ranks of which rank 1 leaks) and a two-rank run folder, loaded from the file with
every request sent to a dead proxy: after its script ran, the DOM holds a curve per process that has a
timeline, the markers, the holder's path and its retainer chain; its screenshot is not blank; and the
browser made no request of the page's (its network log)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _helpers import once_per_run
from _pages import CLEAN, LEAKY, gradguard, two_ranks

# the browser's own traffic (updates, time, accounts), which no flag turns off entirely; a page's request
# would go to any other host
_BROWSER_HOSTS = re.compile(r"^https?://([a-z0-9-]+\.)*(google\.com|googleapis\.com|gvt1\.com|gstatic\.com)(:[0-9]+)?/")
_QUIET = [
    "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-default-apps", "--disable-domain-reliability",
    "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",  # any request goes nowhere
]  # fmt: skip


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("GRADGUARD_REQUIRE_ENGINES") == "1":
        pytest.fail("chromium is required (GRADGUARD_REQUIRE_ENGINES=1): apt-get install chromium")
    pytest.skip("no chromium on PATH (CI installs Debian's: apt-get install chromium)")


def _load(page: Path, tmp_path: Path, *extra: str) -> tuple[str, set[str]]:
    """The page's DOM after its scripts ran, and the URLs the browser requested while loading it."""
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    netlog = profile.with_suffix(".netlog.json")
    run = subprocess.run(
        [_chromium(), *_QUIET, f"--user-data-dir={profile}", f"--log-net-log={netlog}", *extra,
         f"file://{page.resolve()}"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    urls = set(re.findall(r'"url":"([^"]+)"', netlog.read_text(errors="replace"))) if netlog.exists() else set()
    return run.stdout, {u for u in urls if not u.startswith("file:") and not _BROWSER_HOSTS.match(u)}


def _dom(page: Path, tmp_path: Path) -> str:
    dom, requested = _load(page, tmp_path, "--dump-dom")
    assert requested == set(), f"the page made requests: {sorted(requested)}"
    assert 'data-ready="yes"' in dom, "the page's script did not run"
    return dom


def _attribute(dom: str, name: str) -> int:
    found = re.search(rf'<body[^>]* {name}="([0-9]+)"', dom)
    assert found, f"no {name} on <body>: the page's script did not run"
    return int(found.group(1))


def _not_blank(page: Path, tmp_path: Path) -> None:
    from PIL import Image

    shot = tmp_path / f"{page.stem}.png"
    _, requested = _load(page, tmp_path, f"--screenshot={shot}", "--window-size=1100,900")
    assert requested == set()
    with Image.open(shot) as image:
        pixels = list(image.convert("L").resize((110, 90)).tobytes())
    dark = sum(p < 200 for p in pixels) / len(pixels)
    assert len(set(pixels)) > 20 and 0.01 < dark < 0.9, (len(set(pixels)), dark)


def _timelines(folder: Path) -> int:
    """How many of a run folder's readable process reports carry a timeline: the curves its page draws."""
    import json

    count = 0
    for path in folder.glob("report-*.json"):
        try:
            count += json.loads(path.read_text()).get("timeline") is not None
        except ValueError:
            continue  # the corrupt one a test adds: left out of the page
    return count


# The seed's shape, with no adapter: an engine publishes each micro-batch's output, its graph still attached,
# into output_lst, reads it after the last backward and clears it before optimizer.step().
SEED = """\
import torch

model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)


class Engine:
    def __init__(self):
        self.output_lst = []

    def step(self, batches):
        for x in batches:
            logp = torch.log_softmax(model(x), -1)
            loss = -logp.mean()
            loss.backward()
            self.output_lst.append({"loss": loss.item(), "model_output": {"log_probs": logp}})
        mean = sum(r["loss"] for r in self.output_lst) / len(self.output_lst)
        self.output_lst.clear()
        opt.step()
        opt.zero_grad()
        return mean


engine = Engine()
for _ in range(4):
    engine.step([torch.randn(16, 64) for _ in range(8)])
"""
SEED_HOLDER = r"""[^"<]*output_lst\[\*\]\['model_output'\]\['log_probs'\]"""
"""The seed's holder as the page names it (from a global or a frame's ``self``, whichever the watch found)."""


def _real_runs(folder: Path) -> dict[str, Any]:
    """Pages of real runs: each one's page, its run folder, and the command's exit status."""
    made: dict[str, Any] = {}
    for name, script in (("leak", LEAKY), ("clean", CLEAN), ("seed", SEED)):
        (folder / name).mkdir()
        (folder / name / "train.py").write_text(script)
        run = gradguard("run", "--mode", "warn", "--report-dir", "reports", "--html", "page.html", "train.py",
                        cwd=folder / name)  # fmt: skip
        made[name] = {"code": run.returncode, "stderr": run.stderr[-3000:]}
    corrupt = folder / "leak" / "reports"
    (corrupt / next(corrupt.glob("report-*.json")).name.replace(".json", "-cut.json")).write_text('{"format": "gr')
    run = gradguard("report", "reports", "--html", "corrupt.html", cwd=folder / "leak")
    made["corrupt"] = {"code": run.returncode, "stderr": run.stderr[-3000:]}
    return made


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    _chromium()
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    return root / "page-browser-runs", once_per_run(tmp_path_factory, "page-browser-runs", _real_runs)


def test_a_two_rank_page_shows_both_curves_flags_rank_1_and_marks_its_leak(tmp_path: Path) -> None:
    folder = two_ranks(tmp_path / "run")
    page = tmp_path / "page.html"
    run = gradguard("report", str(folder), "--html", str(page), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    dom = _dom(page, tmp_path)
    assert _attribute(dom, "data-curves") == 2 and _attribute(dom, "data-markers") == 2
    assert re.findall(r'<tr class="process( grows)?" data-process="(rank [01]/2)"', dom) == [
        (" grows", "rank 1/2"), ("", "rank 0/2")
    ]  # fmt: skip
    assert '<code class="path">__main__:losses[*]</code>' in dom
    _not_blank(page, tmp_path)


def test_a_real_one_process_leak_renders_with_its_holder_and_marker(
    real: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, made = real
    assert made["leak"]["code"] == 0, made["leak"]["stderr"]
    page = root / "leak" / "page.html"
    dom = _dom(page, tmp_path)
    assert '<code class="path">__main__:losses[*]</code>' in dom and "losses = gradguard.guard([])" in dom
    assert _attribute(dom, "data-curves") == _timelines(root / "leak" / "reports")
    assert re.search(r'<g class="marker" data-kind="leak-start" data-holder="__main__:losses\[\*\]"', dom)
    _not_blank(page, tmp_path)


def test_the_seeds_within_step_leak_renders_with_its_micro_batches_markers_and_holder(
    real: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, made = real
    assert made["seed"]["code"] == 0, made["seed"]["stderr"]
    dom = _dom(root / "seed" / "page.html", tmp_path)
    assert _attribute(dom, "data-curves") == _timelines(root / "seed" / "reports") == 1
    inside = re.search(r'<polyline class="curve" data-process="[^"]+" data-inside="([0-9]+)"', dom)
    assert inside and int(inside[1]) > 0, "no micro-batch boundary drawn inside a step"
    for kind in ("leak-start", "report"):
        assert re.search(rf'<g class="marker" data-kind="{kind}" data-holder="{SEED_HOLDER}"', dom), kind
    holder = re.search(rf'<code class="path">({SEED_HOLDER})</code>', dom)
    assert holder, "the seed's holder is not in the holders' table"
    links = re.search(r'<details class="chain" data-links="([0-9]+)">(.*?)</details>', dom, re.DOTALL)
    assert links and int(links[1]) >= 4  # ... .output_lst, [*], ['model_output'], ['log_probs']
    said = re.findall(r"<li[^>]*><code>([^<]*)</code> keeps ([0-9]+) tensor", links[2])
    assert [link for link, _ in said[-4:]] == [".output_lst", "[*]", "['model_output']", "['log_probs']"], said
    assert all(int(tensors) > 0 for _, tensors in said)
    assert "detach before storing into" in dom and "across the micro-batches of a step" in dom
    _not_blank(root / "seed" / "page.html", tmp_path)


def test_a_real_clean_run_renders_with_no_holder(real: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    root, made = real
    assert made["clean"]["code"] == 0, made["clean"]["stderr"]
    dom = _dom(root / "clean" / "page.html", tmp_path)
    assert 'id="no-holders"' in dom and _attribute(dom, "data-markers") == 0
    assert _attribute(dom, "data-curves") == _timelines(root / "clean" / "reports")


def test_a_folder_with_a_corrupt_report_names_it_and_shows_the_rest(
    real: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, made = real
    assert made["corrupt"]["code"] == 1, made["corrupt"]["stderr"]  # a report left out may have held a leak
    dom = _dom(root / "leak" / "corrupt.html", tmp_path)
    assert re.search(r'<li class="bad">report-[^<]*-cut\.json: unreadable \(', dom)
    assert '<code class="path">__main__:losses[*]</code>' in dom


def test_two_torchrun_ranks_where_only_rank_1_leaks(tmp_path: Path) -> None:
    from _helpers import require_gloo

    require_gloo()
    script = LEAKY.replace("import torch\n", "import os\nimport torch\nimport torch.distributed as dist\n", 1)
    script = script.replace("losses.append(loss)", "if os.environ['RANK'] == '1':\n        losses.append(loss)")
    script = script.replace(
        "import torch.distributed as dist\n", "import torch.distributed as dist\n\ndist.init_process_group('gloo')\n", 1
    )
    script += "dist.destroy_process_group()\n"
    (tmp_path / "train.py").write_text(script)
    run = gradguard("run", "--mode", "warn", "--report-dir", "reports", "--html", "page.html",
                    sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                    str(_free_port()), "train.py", cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    dom = _dom(tmp_path / "page.html", tmp_path)
    ranks = re.findall(r'<tr class="process( grows)?" data-process="(rank [01]/2)"', dom)
    assert sorted(r for _, r in ranks) == ["rank 0/2", "rank 1/2"] and ranks[0] == (" grows", "rank 1/2")
    assert '<code class="path">__main__:losses[*]</code>' in dom and "in rank 1/2;" in dom


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_network_log_sees_a_page_that_does_fetch(tmp_path: Path) -> None:
    """The check above is not vacuous: a page with one remote image is caught."""
    page = tmp_path / "fetches.html"
    page.write_text('<html><body><img src="http://example.invalid/x.png"></body></html>')
    _, requested = _load(page, tmp_path, "--dump-dom")
    assert "http://example.invalid/x.png" in requested
