"""The run's page and plot (``--html``, ``--png``) without a browser: what the page holds, files left
out, bad paths refused before anything runs, what is missing named with what to install."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest
from _pages import LEAKY, gradguard, two_ranks

from gradguard._errors import GradGuardError
from gradguard._launch import commands


def _page(tmp_path: Path, corrupt: bool = False) -> str:
    folder = two_ranks(tmp_path / "run", corrupt=corrupt)
    page = tmp_path / "page.html"
    code = commands.report(str(folder), None, html=str(page), png=str(tmp_path / "plot.png"))
    assert code == (1 if corrupt else 0)
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return page.read_text(encoding="utf-8")


def test_the_page_holds_a_curve_per_rank_the_growing_one_first_its_markers_and_the_holder(tmp_path: Path) -> None:
    text = _page(tmp_path)
    curves = re.findall(r'<polyline class="curve" data-process="([^"]+)"', text)
    assert curves == ["rank 1/2", "rank 0/2"]  # the one that grows first
    assert re.search(r'<tr class="process grows" data-process="rank 1/2">', text)
    assert 'data-process="rank 0/2">' in text and '<tr class="process grows" data-process="rank 0/2">' not in text
    kinds = re.findall(r'<g class="marker" data-kind="([a-z-]+)" data-holder="__main__:losses\[\*\]"', text)
    assert sorted(kinds) == ["leak-start", "report"]
    assert '<code class="path">__main__:losses[*]</code>' in text and "KEPT = gradguard.guard([])" in text
    assert "<th>torch</th><td>2.13.0</td>" in text and "Every report file of this run could be read." in text


def test_the_page_fetches_nothing(tmp_path: Path) -> None:
    text = _page(tmp_path)
    assert not re.search(r"""(src|href|xmlns|url)\s*[=(]\s*["']?\s*(https?:)?//""", text, re.IGNORECASE)
    assert "http://" not in text and "https://" not in text
    assert "<link" not in text and "<script src" not in text and "@import" not in text
    assert "default-src 'none'" in text  # and the browser is told to refuse any request


def test_a_report_left_out_is_named_on_the_page_and_the_rest_shown(tmp_path: Path) -> None:
    text = _page(tmp_path, corrupt=True)
    assert '<ul id="left-out"><li class="bad">report-r1-node-1-999-00.json: unreadable (' in text
    assert len(re.findall(r'<polyline class="curve"', text)) == 2


def test_a_report_without_a_timeline_still_marks_where_its_leak_was_found(tmp_path: Path) -> None:
    from _reports import holder, process

    from gradguard._launch import _names, _report

    folder = tmp_path / "run"
    folder.mkdir()
    report = process(top=True, boundaries=4, audits=4, holders=[holder(8, outcome="warned", path="__main__:kept[*]")])
    _report.write(str(folder / _names.file_name("r1", "node-1", 100)), report)
    assert commands.report(str(folder), None, html=str(tmp_path / "page.html")) == 0
    text = (tmp_path / "page.html").read_text()
    assert '<p class="bad" id="no-timeline">No memory timeline in the report of: pid 100 (the command)' in text
    assert re.search(r'<g class="marker" data-kind="leak-start" data-holder="__main__:KEPT\[\*\]"', text)


def test_an_unwritable_page_path_is_refused_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("open('ran', 'w').close()\n")
    for flag in ("--html", "--png"):
        bad = str(tmp_path / "missing" / "page.out")
        run = gradguard("run", flag, bad, "train.py", cwd=tmp_path)
        assert run.returncode == 2, run.stderr
        assert (
            f"gradguard run: {flag}={bad!r} is not accepted (the folder " in run.stderr
            and "does not exist" in run.stderr
        )
        assert not (tmp_path / "ran").exists()
    run = gradguard("report", str(tmp_path), "--html", str(tmp_path), cwd=tmp_path)
    assert run.returncode == 2 and "is not accepted (it is a folder)" in run.stderr


def test_what_the_page_needs_is_named_with_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from gradguard._tools.page import require

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("jinja2", "matplotlib") else found(name, *a)
    )
    with pytest.raises(
        GradGuardError, match=r"--html needs jinja2, which is not installed: pip install 'gradguard\[report\]'"
    ):
        require("--html")
    with pytest.raises(GradGuardError, match=r"--png needs matplotlib, which is not installed: pip install"):
        require("--png")


def test_gradguard_run_writes_the_page_when_the_command_ends_and_says_where(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(LEAKY)
    run = gradguard("run", "--mode", "warn", "--html", "page.html", "--report-dir", "reports", "train.py", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "gradguard run: the page of this run: page.html" in run.stderr
    text = (tmp_path / "page.html").read_text()
    assert '<code class="path">__main__:losses[*]</code>' in text and "losses = gradguard.guard([])" in text
    again = gradguard("report", "reports", "--html", "again.html", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    same = (tmp_path / "again.html").read_text()
    strip = lambda t: re.sub(r"page made [0-9: -]+", "", t)  # noqa: E731
    assert strip(same) == strip(text)


def test_sixty_four_ranks_make_one_page_with_a_curve_each(tmp_path: Path) -> None:
    from _reports import holder, process

    from gradguard._launch import _names, _report
    from gradguard._watch.timeline import Timeline

    folder = tmp_path / "run"
    folder.mkdir()
    for r in range(64):
        timeline = Timeline()
        for i in range(2000):
            timeline.point("micro", i // 4, i, 2**30 + (i * 4096 if r == 6 else (i % 4) * 1024), 10, i * 0.01)
        holders = [holder(8, outcome="warned", path="__main__:kept[*]")] if r == 6 else []
        report = {**process(pid=300 + r, rank=r, world_size=64, rank_from="RANK", label=f"rank {r}/64",
                            boundaries=500, audits=5, holders=holders), "timeline": timeline.to_dict()}  # fmt: skip
        _report.write(str(folder / _names.file_name("r1", "node-1", 300 + r)), report)
    assert commands.report(str(folder), None, html=str(tmp_path / "page.html")) == 0
    text = (tmp_path / "page.html").read_text()
    curves = re.findall(r'<polyline class="curve" data-process="([^"]+)"', text)
    assert len(curves) == 64 and curves[0] == "rank 6/64"
    assert len(re.findall(r'<tr class="process grows"', text)) == 1
    assert len(text) < 5_000_000


def test_a_folder_of_only_a_corrupt_report_still_makes_a_page_that_says_so(tmp_path: Path) -> None:
    (tmp_path / "report-r1-node-1-5-00.json").write_text('{"format": "gr')
    page, plot = tmp_path / "page.html", tmp_path / "plot.png"
    assert commands.report(str(tmp_path), None, html=str(page), png=str(plot)) == 1
    text = page.read_text()
    assert '<li class="bad">report-r1-node-1-5-00.json: unreadable (' in text and 'id="no-curve"' in text
    assert "nothing was checked" in text and plot.stat().st_size > 0


def test_a_holders_path_reads_back_as_its_links() -> None:
    from gradguard._tools.page.chain import links

    assert links("__main__:engine.output_lst[*]['model_output']['log_probs']") == [
        "__main__:engine", ".output_lst", "[*]", "['model_output']", "['log_probs']"
    ]  # fmt: skip
    assert links("mypkg.train:trainer.metrics['a].b']") == ["mypkg.train:trainer", ".metrics", "['a].b']"]
    assert links("train.py in Trainer.step: self.losses[*]") == ["train.py in Trainer.step: self", ".losses", "[*]"]
    assert links("mypkg.nodes:head(.next)*.value") == ["mypkg.nodes:head", "(.next)*", ".value"]
    assert links("mypkg:cache.keys()[*]") == ["mypkg:cache", ".keys()", "[*]"]
    assert links("closure of mypkg:make.<locals>.add: total") == ["closure of mypkg:make.<locals>.add: total"]


def test_each_holder_opens_to_its_retainer_chain_with_what_each_link_keeps(tmp_path: Path) -> None:
    """Two holders under one engine: the engine's link keeps both, each deeper link its own holder's."""
    from _reports import holder, process

    from gradguard._launch import _names, _report

    folder = tmp_path / "run"
    folder.mkdir()
    seed = "__main__:engine.output_lst[*]['model_output']['log_probs']"
    holders = [
        holder(4096, "warned", seed.replace("[*]", "[0]"), holder=seed, tensors=3, nodes=18, node_bytes=12288),
        holder(1024, "warned", "__main__:engine.last['loss']", holder="__main__:engine.last['loss']", tensors=1,
               nodes=3, node_bytes=2048),
    ]  # fmt: skip
    report = process(top=True, boundaries=4, audits=4, holders=holders)
    _report.write(str(folder / _names.file_name("r1", "node-1", 100)), report)
    assert commands.report(str(folder), None, html=str(tmp_path / "page.html")) == 0
    text = html.unescape((tmp_path / "page.html").read_text())
    opens = rf'<code class="path">{re.escape(seed)}</code>\s*<details class="chain" data-links="5">'
    found = re.search(rf"{opens}(.*?)</details>", text, re.DOTALL)
    assert found, text
    said = [re.sub(r"<[^>]+>", "", li).strip() for li in re.findall(r"<li[^>]*>(.*?)</li>", found[1])]
    assert said == [
        "__main__:engine keeps 4 tensor(s), 5.0 KiB pinned, 21 (~14.0 KiB) graph nodes (2 holders through it)",
        ".output_lst keeps 3 tensor(s), 4.0 KiB pinned, 18 (~12.0 KiB) graph nodes",
        "[*] keeps 3 tensor(s), 4.0 KiB pinned, 18 (~12.0 KiB) graph nodes",
        "['model_output'] keeps 3 tensor(s), 4.0 KiB pinned, 18 (~12.0 KiB) graph nodes",
        "['log_probs'] keeps 3 tensor(s), 4.0 KiB pinned, 18 (~12.0 KiB) graph nodes",
    ]
    assert f'title="{seed}"' in text  # the last link's whole path, on hover
    assert len(re.findall(r'<details class="chain"', text)) == 2
