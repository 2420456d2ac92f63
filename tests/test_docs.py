"""Every code example in README.md and docs/ runs, and says what it shows.

The conventions (docs/development.md, "Documentation"), read from the Markdown source:

* A fenced ``python`` block is run: each in a fresh ``__main__`` module, in the page's scratch
  folder; the blocks of every page run in one interpreter (``import torch`` once), page after page.
* A fenced ``console`` block is run: each line starting with ``$ `` is a command (a trailing ``\\``
  continues it), the lines after it are the output expected from it. A fenced ``bash`` block is run
  line by line, with no output to compare. Commands run with ``bash`` in the page's scratch folder,
  this checkout first on ``PYTHONPATH`` and this interpreter's ``bin`` first on ``PATH``. A command
  that exits non-zero fails the block, unless the next command is ``echo $?`` (which then shows it).
* Expected output is compared loosely: in order, whitespace runs as one space, ``...`` inside a line
  matches any text, a line that is only ``...`` stands for lines left out, a table's rule of dashes
  matches any widths; lines that are not in the expectation (a library's warning) are allowed.
* An HTML comment right before a fence (blank lines between are fine) changes that:
  ``<!-- fragment: why -->`` excludes the block, and says why (the reason is reported);
  ``<!-- file: NAME -->`` writes the block to ``NAME`` in the page's scratch folder instead of running it
  (a later command runs it); ``<!-- continue -->`` runs a ``python`` block in the namespace of the
  one before it; ``<!-- output -->`` before a ``text`` block makes it the expected output (stdout and
  stderr) of the ``python`` block before it; ``<!-- cwd: repo -->`` runs a shell block in the
  repository's root (a developer's command) instead of the scratch folder. ``<!-- requires: a, b -->``
  anywhere in a page names modules its examples need: without them the page is skipped, or fails
  under ``GRADGUARD_REQUIRE_ENGINES=1`` (CI), as the integration tests do.
* Any other fenced block must be of a language that is not code to run (``text``, ``yaml``,
  ``toml``, ``json``): a ``py``, ``sh`` or unlabelled block fails :func:`test_every_block_is_accounted_for`.

The counts (blocks run, commands run, blocks excluded and why) are printed at the end of the
session by ``tests/conftest.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _helpers import once_per_run

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = {"python", "console", "bash"}
NOT_CODE = {"text", "yaml", "toml", "json"}
COMMAND_TIMEOUT_S = 300

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^`]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*(?P<name>fragment|file|continue|output|cwd)\s*(?::\s*(?P<value>.*?))?\s*-->\s*$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, with the directives in the HTML comments right before each."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    directives: dict[str, str] = {}
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence is None:
            directive = _DIRECTIVE.match(line)
            if directive:
                directives[directive["name"]] = directive["value"] or ""
            elif line.strip():
                directives = {}
            i += 1
            continue
        indent, mark = len(fence["indent"]), fence["fence"]
        lang = fence["info"].strip().split(" ")[0].split("{")[0]
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(
            rf"^ {{0,{indent + 3}}}{re.escape(mark[0])}{{{len(mark)},}}\s*$", lines[i]
        ):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        found.append(Block(page, i - len(body), lang, "\n".join(body) + "\n", directives))
        directives = {}
        i += 1
    return found


ALL = {page: blocks(page) for page in PAGES}

_REQUIRES = re.compile(r"^\s*<!--\s*requires:\s*(?P<modules>.*?)\s*-->\s*$", re.M)


def requires(page: Path) -> list[str]:
    """The top-level modules a page's examples need (``<!-- requires: a, b -->`` anywhere in it)."""
    found = _REQUIRES.findall(page.read_text(encoding="utf-8"))
    return [m.strip() for line in found for m in line.split(",") if m.strip()]


def _env() -> dict[str, str]:
    unset = {"GRADGUARD", "GRADGUARD_AUDIT", "GRADGUARD_REPORT_DIR", "GRADGUARD_RUN_AUDIT", "COLUMNS"}
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


def _norm(line: str) -> str:
    """Whitespace runs as one space; a table's rule (dashes and spaces only) as ``---``, whatever its widths."""
    line = " ".join(line.split())
    return "---" if line and set(line) <= {"-", " "} and "--" in line else line


def matches(expected: str, actual: str) -> str | None:
    """``None`` when ``actual`` shows ``expected`` (the loose rules above), else what is missing."""
    got = [_norm(line) for line in actual.splitlines()]
    at = 0
    for want in expected.splitlines():
        want = _norm(want)
        if not want or want == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")) + "$")
        while at < len(got) and not pattern.match(got[at]):
            at += 1
        if at == len(got):
            return f"expected, in order, a line like:\n  {want}"
        at += 1
    return None


# ----------------------------------------------------------------------------------------------------
# What ran: the session summary (tests/conftest.py prints it)
# ----------------------------------------------------------------------------------------------------

SUMMARY: dict[str, list[str]] = {"python": [], "commands": [], "files": [], "excluded": []}


# ----------------------------------------------------------------------------------------------------
# The tests
# ----------------------------------------------------------------------------------------------------


def test_every_block_is_accounted_for() -> None:
    """Each fenced block is run, written as a file, excluded with a reason, or not code at all."""
    wrong = []
    for found in ALL.values():
        for block in found:
            d = block.directives
            if block.lang in RUN:
                if "fragment" in d and not d["fragment"]:
                    wrong.append(f"{block.where}: <!-- fragment --> needs a reason: <!-- fragment: why -->")
                if "output" in d:
                    wrong.append(f"{block.where}: <!-- output --> is for the text block after a python block")
                if "file" in d and (block.lang != "python" or not d["file"]):
                    wrong.append(f"{block.where}: <!-- file: NAME --> is for python blocks and needs a name")
                if "fragment" in d:
                    SUMMARY["excluded"].append(f"{block.where} ({block.lang}): {d['fragment']}")
            elif block.lang in NOT_CODE:
                if d.keys() - {"output"}:
                    wrong.append(f"{block.where}: directives {sorted(d)} on a {block.lang!r} block")
            else:
                wrong.append(
                    f"{block.where}: a fenced block of language {block.lang!r}: write python, console or bash "
                    f"(run), or one of {sorted(NOT_CODE)} (not code)"
                )
    assert not wrong, "\n".join(wrong)
    assert sum(b.lang in RUN and "fragment" not in b.directives for found in ALL.values() for b in found) > 20


_RUNNER = r"""
import contextlib, gc, io, json, os, sys, time, traceback, types, warnings
pages = json.load(sys.stdin)
results = {}
for page in pages:
    os.chdir(page["scratch"])
    done = results[page["page"]] = []
    namespace = None
    for block in page["blocks"]:
        if not block["continue"] or namespace is None:
            if namespace is not None:
                namespace.__dict__.clear()
            namespace = types.ModuleType("__main__")
            namespace.__dict__["__builtins__"] = __builtins__
            gc.collect()
            if "gradguard" in sys.modules:
                sys.modules["gradguard"].reset_stats()
                sys.modules["gradguard"].set_mode(None)
        sys.modules["__main__"] = namespace
        out = io.StringIO()
        start = time.perf_counter()
        print("docs block", block["where"], file=sys.__stderr__, flush=True)
        error = None
        try:
            code = compile(block["code"], block["filename"], "exec")
            with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                exec(code, namespace.__dict__)
        except BaseException:
            error = traceback.format_exc()
        done.append({"where": block["where"], "output": out.getvalue(), "error": error,
                     "seconds": time.perf_counter() - start})
        if error is not None:
            break  # the page's later blocks may depend on this one
    if namespace is not None:
        namespace.__dict__.clear()
print(json.dumps(results))
"""
RUNNER_TIMEOUT_S = 900  # every page's Python blocks together; they take about half a minute


def _python_blocks(page: Path) -> list[Block]:
    return [b for b in ALL[page] if b.lang == "python" and not b.directives.keys() & {"fragment", "file"}]


def _outputs(page: Path) -> dict[int, Block]:
    """Expected outputs, keyed by the line of the python block they belong to."""
    expected: dict[int, Block] = {}
    last: Block | None = None
    for block in ALL[page]:
        if block.lang == "python" and "fragment" not in block.directives and "file" not in block.directives:
            last = block
        elif "output" in block.directives:
            assert last is not None, f"{block.where}: <!-- output --> with no python block before it"
            expected[last.line] = block
    return expected


def _write_files(page: Path, root: Path) -> Path:
    """The page's scratch folder, with its ``<!-- file: NAME -->`` blocks written into it."""
    root.mkdir()
    for block in ALL[page]:
        name = block.directives.get("file")
        if block.lang == "python" and name and "fragment" not in block.directives:
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code, encoding="utf-8")
            SUMMARY["files"].append(f"{block.where} -> {name}")
    return root


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


RUNNABLE = [p for p in PAGES if any(b.lang in RUN and "fragment" not in b.directives for b in ALL[p])]


@dataclass
class Pages:
    """Every page's scratch folder, and what its Python blocks did (run once, in one interpreter)."""

    scratch: dict[Path, Path]
    env: dict[str, str]
    results: dict[str, list[dict[str, object]]] | None = None
    failure: str | None = None


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Pages:
    """The Python blocks of every page, run once per test run (under xdist, for every worker)."""
    ran = once_per_run(tmp_path_factory, "docs-pages", _run_python_blocks)
    scratch = {page: Path(ran["scratch"][_page_id(page)]) for page in RUNNABLE}
    return Pages(scratch, _env(), ran["results"], ran["failure"])


def _run_python_blocks(root: Path) -> dict[str, Any]:
    """Each page's scratch folder under ``root``, its files written; every page's Python blocks run in
    one interpreter; ``{"scratch", "results", "failure"}`` as JSON."""
    scratch = {page: _write_files(page, root / f"page{i}") for i, page in enumerate(RUNNABLE)}
    ran: dict[str, Any] = {
        "scratch": {_page_id(p): str(d) for p, d in scratch.items()},
        "results": None,
        "failure": None,
    }
    payload = [
        {
            "page": _page_id(page),
            "scratch": str(scratch[page]),
            "blocks": [
                {
                    "where": b.where,
                    "filename": _page_id(page),
                    "code": "\n" * b.line + b.code,  # tracebacks and warnings give the page's own line numbers
                    "continue": "continue" in b.directives,
                }
                for b in _python_blocks(page)
            ],
        }
        for page in RUNNABLE
        if _python_blocks(page)
    ]
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _RUNNER],
            input=json.dumps(payload),
            capture_output=True,
            text=True,
            cwd=root,
            env=_env(),
            timeout=RUNNER_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        started = re.findall(r"^docs block (\S+)", (exc.stderr or b"").decode(errors="replace"), re.M)
        ran["failure"] = f"the Python blocks timed out after {RUNNER_TIMEOUT_S} s, in the block at {started[-1:]}"
        return ran
    if proc.returncode != 0 or not proc.stdout.strip():
        ran["failure"] = f"the runner of the Python blocks exited {proc.returncode}\n{proc.stderr[-4000:]}"
        return ran
    ran["results"] = json.loads(proc.stdout.strip().splitlines()[-1])
    return ran


@pytest.mark.parametrize("page", RUNNABLE, ids=_page_id)
def test_page(page: Path, pages: Pages) -> None:
    """The page's python blocks (run by the ``pages`` fixture), then its shell blocks, in its scratch folder."""
    for module in requires(page):
        if importlib.util.find_spec(module) is None:  # top-level names only: nothing is imported here
            if os.environ.get("GRADGUARD_REQUIRE_ENGINES") == "1":
                pytest.fail(f"{_page_id(page)} needs {module} (GRADGUARD_REQUIRE_ENGINES=1), which is not installed")
            pytest.skip(f"{_page_id(page)} needs {module}, which is not installed")
    found = _python_blocks(page)
    if found:
        assert pages.failure is None, pages.failure
        assert pages.results is not None
        results = pages.results[_page_id(page)]
        expected = _outputs(page)
        for block, result in zip(found, results):
            assert result["error"] is None, f"{block.where}: the block failed\n{result['output']}\n{result['error']}"
            SUMMARY["python"].append(f"{block.where} ({result['seconds']:.1f} s)")
            want = expected.get(block.line)
            if want is not None:
                missing = matches(want.code, str(result["output"]))
                assert missing is None, (
                    f"{block.where}: its output differs from {want.where}: {missing}\n--- output\n{result['output']}"
                )
        assert len(results) == len(found), f"{_page_id(page)}: {len(found) - len(results)} blocks did not run"
    for block in ALL[page]:
        if block.lang in {"console", "bash"} and "fragment" not in block.directives:
            cwd = ROOT if block.directives.get("cwd") == "repo" else pages.scratch[page]
            _run_shell(block, cwd, pages.env)


def commands(block: Block) -> list[tuple[str, str]]:
    """``(command, expected output)`` pairs of a shell block."""
    pairs: list[tuple[str, str]] = []
    lines = block.code.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if block.lang == "console":
            if not line.startswith("$ "):
                assert not pairs, f"{block.where}: output before the first command"
                i += 1
                continue
            line = line[2:]
        elif not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        command = [line]
        while command[-1].rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            command.append(lines[i])
        i += 1
        output: list[str] = []
        while block.lang == "console" and i < len(lines) and not lines[i].startswith("$ "):
            output.append(lines[i])
            i += 1
        pairs.append(("\n".join(command), "\n".join(output)))
    return pairs


def _run_shell(block: Block, cwd: Path, env: dict[str, str]) -> None:
    pairs = commands(block)
    for n, (command, want) in enumerate(pairs):
        if command.strip() == "echo $?":
            continue  # shown with the command before it
        shows_status = n + 1 < len(pairs) and pairs[n + 1][0].strip() == "echo $?"
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                ["bash", "-c", command],
                capture_output=True,
                text=True,
                cwd=cwd,
                env=env,
                timeout=COMMAND_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where}: `{command}` did not end within {COMMAND_TIMEOUT_S} s")
        seconds = time.perf_counter() - start
        output = proc.stdout + proc.stderr
        shown = f"--- the command: {command}\n--- its output (exit status {proc.returncode}):\n{output[-6000:]}"
        if shows_status:
            status_want = pairs[n + 1][1].strip()
            assert str(proc.returncode) == status_want, f"{block.where}: exit status, not {status_want}\n{shown}"
        else:
            assert proc.returncode == 0, f"{block.where}: the command failed\n{shown}"
        missing = matches(want, output)
        assert missing is None, f"{block.where}: {missing}\n{shown}"
        SUMMARY["commands"].append(f"{block.where}: {command.splitlines()[0]} ({seconds:.1f} s)")


# ----------------------------------------------------------------------------------------------------
# The runner's own rules
# ----------------------------------------------------------------------------------------------------


def test_matches_is_loose_but_ordered() -> None:
    actual = "a warning from a library\nholder   tensors\nHISTORY[*]   6\nthe end"
    assert matches("holder tensors\n...\nthe end", actual) is None
    assert matches("HISTORY[...] 6", actual) is None
    assert matches("the end\nholder tensors", actual) is not None
    assert matches("HISTORY[*] 7", actual) is not None


def test_blocks_and_directives(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- fragment: a signature only -->\n\n```python\ndef f(): ...\n```\n\n"
        "- item\n\n    ```console\n    $ echo hi \\\n      there\n    hi there\n    ```\n"
        "<!-- file: train.py -->\n```python\nx = 1\n```\nplain words\n\n```text\nout\n```\n",
        encoding="utf-8",
    )
    found = blocks(page)
    assert [(b.lang, b.directives) for b in found] == [
        ("python", {"fragment": "a signature only"}),
        ("console", {}),
        ("python", {"file": "train.py"}),
        ("text", {}),
    ]
    assert commands(found[1]) == [("echo hi \\\n  there", "hi there")]
    assert found[0].line == 5 and found[0].code == "def f(): ...\n"
