"""The package's layers: every module imports only from its own layer or the ones below
(docs/how-it-works.md), no two modules import each other, directly or round a circle, and no module
imports what another package keeps to itself (a name or a module starting with ``_``). The folders are
the layers' parts: a new module goes into the folder of what it holds, a new folder gets a layer here,
so the picture stays true."""

from __future__ import annotations

import ast
from pathlib import Path

import gradguard

LAYERS: list[set[str]] = [
    {"_errors", "_compat"},  # every exception and warning; the version facts (private torch and CPython internals)
    {"_tree", "_graph", "_heap"},  # the tree walk, graph inspection, who holds a tensor
    {"_policy"},  # modes, call site, stats, messages
    {"_boundary"},  # the publish boundary
    {"_guards", "engines"},  # stores, the loss contract, the decorator; the engine adapters
    {"_scope"},  # enforce()
    {"_watch"},  # the audit and the step-boundary watch
    {"_launch", "_tools", "testing", "integrations", "__init__", "__main__"},  # the tools
]
ROOT = Path(gradguard.__file__).parent


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: gradguard.{top} has no layer in tests/test_layers.py: give it one")


def _imports(path: Path) -> set[str]:
    """The gradguard modules ``path`` imports (at the top or inside a function)."""
    name = _module(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(package[: len(package) - node.level + 1] + (node.module or "").split("."))
                target = target.rstrip(".")
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                module = sub if sub in MODULES else target
                if module in MODULES and module != name:
                    found.add(module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES and a.name != name)
    return found


GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def test_every_module_imports_only_from_below() -> None:
    violations = [
        f"{name} imports {imported} from a layer above"
        for name, imported_all in sorted(GRAPH.items())
        for imported in sorted(imported_all)
        if imported != "gradguard" and _layer(imported) > _layer(name)
    ]
    assert violations == []


def test_no_module_imports_round_a_circle() -> None:
    """Tarjan's strongly connected components of the import graph: each must be one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v] - {"gradguard"}:  # the package itself: its __init__ imports everything
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert circles == []


def _package_of(dotted: list[str]) -> list[str]:
    """The package (folder) ``dotted`` is, or the one its module is in."""
    return dotted if (ROOT.parent.joinpath(*dotted) / "__init__.py").exists() else dotted[:-1]


def _private_imports(name: str, source: str, is_package: bool = False) -> list[str]:
    """The imports in module ``name`` that reach a ``_`` name another package (folder) keeps to itself:
    ``from ..x import _y``, ``from ..x._y import z``, ``import gradguard.x._y``. A package's modules share
    their private names among themselves."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets: list[list[str]] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = base + (node.module.split(".") if node.module else [])
            else:
                module = (node.module or "").split(".")
            targets = [[*module, alias.name] for alias in node.names]
        else:
            targets = [alias.name.split(".") for alias in node.names]
        for target in targets:
            if target[0] != "gradguard":
                continue
            for i, part in enumerate(target[2:], start=2):  # the layers' own folders are gradguard's: any may use them
                owner = _package_of(target[:i])
                if part.startswith("_") and not part.startswith("__") and package[: len(owner)] != owner:
                    found.append(f"{name}:{node.lineno} imports {'.'.join(target)}, private to {'.'.join(owner)}")
                    break
    return found


def test_no_module_imports_a_name_another_package_keeps_to_itself() -> None:
    found = [
        line
        for name, path in sorted(MODULES.items())
        for line in _private_imports(name, path.read_text(), path.name == "__init__.py")
    ]
    assert found == []


def test_the_check_of_private_imports_sees_each_form() -> None:
    """The three spellings are found; a package's own private names, shared by its modules, are not."""
    source = "\n".join(
        [
            "from .._policy.modes import _env_mode",
            "from ..engines import _patch",
            "import gradguard._launch._names",
            "from ..engines._patch import install",
            "from . import enforce",
            "from .enforce import _acquire",
            "from .._policy.modes import resolve",
        ]
    )
    found = [line.split(" imports ")[1] for line in _private_imports("gradguard._scope.sample", source)]
    assert found == [
        "gradguard._policy.modes._env_mode, private to gradguard._policy",
        "gradguard.engines._patch, private to gradguard.engines",
        "gradguard._launch._names, private to gradguard._launch",
        "gradguard.engines._patch.install, private to gradguard.engines",
    ]


def test_the_folders_are_the_layers_parts() -> None:
    """Only the public modules, the errors and the version facts sit at the package's top; the rest is in a folder."""
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "_compat.py", "_errors.py", "testing.py"]
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set().union(*LAYERS) - {"_errors", "_compat", "testing", "__init__", "__main__"}
