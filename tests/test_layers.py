"""The package's layers: every module imports only from its own layer or the ones below (README,
"How it works"). A new module must be given a layer here, so the picture stays true."""

from __future__ import annotations

import ast
from pathlib import Path

import gradguard

LAYERS: list[set[str]] = [
    # the tree walk, graph inspection, the heap search, and the per-device memory figure
    {
        "_errors",
        "_containers",
        "_tree",
        "_graph",
        "_liveness",
        "_frames",
        "_paths",
        "_ownership",
        "_roots",
        "_holders",
        "_allocated",
    },
    # policy: modes, call site, stats, messages, the memory trigger's rule
    {"_policy", "_site", "_stats", "_message", "_table", "_trigger"},
    {"_publish"},  # the publish boundary
    {"_offload", "_store", "_contract", "_arguments", "_wrapper", "_results", "_step", "engines"},  # on top
    {
        "_enforce",
        "_compile",
        "testing",
        "_audit",
        "_criterion",
        "_repair",
        "_recipes",
        "_schedule",
        "_watch",
        "_memory",
        "_doctor",
        "_cli",
        "_launch",
        "_bench",
        "__init__",
        "__main__",
        "integrations",
    },  # tools
]
ROOT = Path(gradguard.__file__).parent


def _layer(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"gradguard.{name} has no layer in tests/test_layers.py: give it one")


def _imports(path: Path) -> set[str]:
    """The gradguard modules ``path`` imports, by their top-level name inside the package."""
    names = set()
    package = path.relative_to(ROOT).parts[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - node.level + 1])
            target = [*base, *(node.module.split(".") if node.module else [])]
            if target:
                names.add(target[0])
            else:  # from . import x: a module of the package, or a name from its __init__
                names.update(
                    a.name if (ROOT / f"{a.name}.py").exists() or (ROOT / a.name).is_dir() else "__init__"
                    for a in node.names
                )
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            for name in [module] if module else [a.name for a in node.names]:  # type: ignore[union-attr]
                if name and name.startswith("gradguard."):
                    names.add(name.split(".")[1])
    return names


def test_every_module_imports_only_from_below() -> None:
    violations = []
    for path in sorted(ROOT.rglob("*.py")):
        top = path.relative_to(ROOT).parts[0].removesuffix(".py")
        for imported in _imports(path) - {top}:
            if _layer(imported) > _layer(top):
                violations.append(f"{path.relative_to(ROOT)} imports gradguard.{imported} from a layer above")
    assert violations == []
