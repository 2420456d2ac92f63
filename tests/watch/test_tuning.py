"""The tuned numbers: one module holds them all, and the documentation's table shows exactly that module's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gradguard._watch import tuning

ROOT = Path(__file__).resolve().parents[2]


def _documented() -> dict[str, float]:
    text = (ROOT / "docs" / "how-it-works.md").read_text()
    section = text.split("## The tuned numbers", 1)[1].split("\n## ", 1)[0]
    return {name: float(value) for name, value in re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", section, re.M)}


def test_the_documented_table_is_the_modules_table() -> None:
    documented = _documented()
    assert documented.keys() == tuning.TABLE.keys()
    for name, (value, why) in tuning.TABLE.items():
        assert documented[name] == value, name
        assert why and getattr(tuning, name) == value


def test_every_number_the_module_names_is_in_the_table() -> None:
    assert set(tuning.__all__) - {"TABLE"} == set(tuning.TABLE)


DEFINITIONS = {
    "allocated.py: _PROBE_BYTES",  # the size of the allocation that tells whether glibc's figure is honest
    "timeline.py: VERSION",  # the timeline's format
    "idle.py: _ALONE",  # the switch interval during a look: longer than any look
}


def test_no_other_module_of_the_watch_defines_a_tuned_number_of_its_own() -> None:
    """A module-level constant bound to a number, in the watch's modules, is the table's (imported from it),
    or a definition (a size, a format's version)."""
    own: list[str] = []
    for path in sorted((ROOT / "gradguard" / "_watch").glob("*.py")):
        if path.name == "tuning.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Constant, ast.BinOp)):
                for target in node.targets:
                    value = node.value
                    numeric = isinstance(value, ast.BinOp) or isinstance(getattr(value, "value", None), (int, float))
                    if isinstance(target, ast.Name) and target.id.isupper() and numeric:
                        own.append(f"{path.name}: {target.id}")
    assert set(own) - DEFINITIONS == set(), own


def _flat(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


def _percent(share: float) -> str:
    return f"{100 * share:g}%"


def test_the_shares_and_counts_the_docs_state_are_the_modules() -> None:
    """What the pages say of the watch's budget, read against the numbers it runs on."""
    cli = _flat("docs/reference/cli.md")
    assert {"2": "two"}[str(tuning.STARTUP)] in cli.split("the first ", 1)[1].split(" step boundaries of each thread")[
        0
    ]
    assert f"a backstop within {_percent(tuning.BACKSTOP_SHARE)} of the time" in cli
    assert (
        tuning.BACKSTOP_SHARE == tuning.SHARE / 10 and f"a tenth of the watch's {_percent(tuning.SHARE)} share" in cli
    )
    guide = _flat("docs/guide/finding-leaks.md")
    assert f"read within {_percent(tuning.READ_SHARE)} of the wall time" in guide
    assert f"within {_percent(tuning.SHARE)} of the wall time" in guide
    assert f"within {_percent(tuning.SHARE)} of the wall time" in _flat("README.md")
    assert f"a `deque` whose `maxlen` is at most {tuning.CAPPED}" in _flat("docs/limits.md")
    assert tuning.HUNTING_BACKSTOP_SHARE == 0.1 and "within a tenth of the wall time (hunting)" in " ".join(
        (ROOT / "gradguard" / "_watch" / "watcher.py").read_text().split()
    )
