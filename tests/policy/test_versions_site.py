"""A warning never crashes the program whatever its module globals look like: a script run by
``runpy.run_path`` (as debuggers run one), code run by ``exec``, a notebook's namespace. From 3.12
``warnings.warn_explicit`` refuses globals whose ``__spec__`` has no loader, and deprecates
globals whose ``__loader__`` and ``__spec__`` disagree; the line is then read from the file."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from gradguard import GradGuardWarning, _compat
from gradguard._policy import site

NAMESPACES = {
    "runpy.run_path": {"__name__": "<run_path>", "__spec__": None, "__loader__": None},
    "python script.py": {
        "__name__": "__main__",
        "__spec__": None,
        "__loader__": importlib.machinery.SourceFileLoader("__main__", __file__),
    },
    "python -c": {"__name__": "__main__", "__spec__": None, "__loader__": importlib.machinery.BuiltinImporter},
    "exec": {"__name__": "snippet"},
    "a spec without a loader": {
        "__name__": "nb",
        "__spec__": importlib.machinery.ModuleSpec("nb", None),
        "__loader__": None,
    },
}


@pytest.mark.parametrize("kind", list(NAMESPACES))
def test_a_warning_at_any_globals_is_emitted_and_never_raises(kind: str) -> None:
    namespace: dict[str, object] = dict(NAMESPACES[kind])
    namespace["warn_at"], namespace["sys"] = site.warn_at, sys
    code = compile("def f(category):\n    warn_at('kept a graph', category, sys._getframe())\n", __file__, "exec")
    exec(code, namespace)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("error", DeprecationWarning)  # -W error: a deprecation would crash the program
        namespace["f"](GradGuardWarning)  # type: ignore[operator]
    assert [str(w.message) for w in caught] == ["kept a graph"]


def test_globals_given_only_where_every_python_reads_them() -> None:
    this = sys.modules[__name__].__dict__
    assert _compat.warning_module_globals(this) is this
    for kind, namespace in NAMESPACES.items():
        if kind != "python script.py" or sys.version_info >= (3, 12):
            assert _compat.warning_module_globals(namespace) is None, kind  # type: ignore[arg-type]


def test_a_script_run_by_runpy_is_warned_not_crashed(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, gradguard
            gradguard.set_mode("warn")
            losses = gradguard.guard([], name="losses")
            losses.append(torch.ones(2, requires_grad=True) * 2)
            print("done")
            """
        )
    )
    runner = f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", runner], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "done"
    assert "GraphRetentionWarning" in done.stderr
