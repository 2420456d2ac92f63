"""The shape of the code a maintainer reads: short module docstrings, a reference that renders, no history.

- Every module docstring of ``gradguard/`` fits a screen (25 lines); the design lives in ``docs/``.
- Every name the API reference documents (the ``::: name`` lines of ``docs/reference/``), and every
  public method of its public classes, has a Google-style docstring that mkdocstrings renders as
  tables: ``Args:`` naming every parameter, ``Returns:`` (or ``Yields:``) when it returns something,
  and, for a record (a dataclass or a named tuple), ``Args:`` or ``Attributes:`` naming every field.
  Every name of ``gradguard.__all__`` and ``gradguard.testing.__all__`` is in the reference.
- No issue number of a tracker appears in the code, the tests or the docs: a comment says what the
  code guards against, not which report found it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
MAX_MODULE_DOCSTRING_LINES = 25

_SECTION = re.compile(r"^(?P<indent>[ ]*)(?P<name>Args|Returns|Yields|Raises|Attributes|Warns):[ ]*$")
_ENTRY = re.compile(r"^(?P<name>\*{0,2}\w+)(?:[ ]*\([^)]*\))?:")
_ISSUE = re.compile(r"\bissues?[ ]+#?[0-9]", re.IGNORECASE)


# --------------------------------------------------------------------------------------------------
# The checks
# --------------------------------------------------------------------------------------------------


def module_docstring_lines(source: str) -> int:
    """Lines of a module's docstring (0 without one)."""
    docstring = ast.get_docstring(ast.parse(source), clean=False)
    return len(docstring.splitlines()) if docstring else 0


def sections(docstring: str) -> dict[str, list[str]]:
    """Google-style sections of a docstring: each section's entry names (``Args:`` -> ``["x", "y"]``)."""
    found: dict[str, list[str]] = {}
    lines = inspect.cleandoc(docstring).splitlines()
    for i, line in enumerate(lines):
        match = _SECTION.match(line)
        if match is None:
            continue
        names = found.setdefault(match["name"], [])
        body_indent: int | None = None
        for body in lines[i + 1 :]:
            if not body.strip():
                continue
            indent = len(body) - len(body.lstrip())
            if indent <= len(match["indent"]):
                break
            if body_indent is None:
                body_indent = indent
            if indent == body_indent:
                entry = _ENTRY.match(body.strip())
                if entry is not None:
                    names.append(entry["name"].lstrip("*"))
    return found


def _is_record(cls: type) -> bool:
    return dataclasses.is_dataclass(cls) or (issubclass(cls, tuple) and hasattr(cls, "_fields"))


def _record_fields(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(cls._fields)  # type: ignore[attr-defined]


def _parameters(obj: Any, method: bool) -> list[str]:
    """The parameters a caller passes: a method's first one (``self``) is not."""
    try:
        names = list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return []
    return names[1:] if method else names


def _returns_something(function: Any) -> bool:
    annotation = inspect.signature(function).return_annotation
    return annotation not in (inspect.Signature.empty, None, "None")


def missing(obj: Any, method: bool = False) -> list[str]:
    """What ``obj``'s docstring lacks for the reference to render its parameters and result (``method``: a
    function defined in a class, called on an instance)."""
    docstring = inspect.getdoc(obj) or ""
    found = sections(docstring)
    problems = []
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return []  # raised, not called: the docstring says when
        if _is_record(obj):
            documented = set(found.get("Args", [])) | set(found.get("Attributes", []))
            undocumented = [f for f in _record_fields(obj) if f not in documented]
            if undocumented:
                problems.append(f"Args:/Attributes: entries for the fields {undocumented}")
            return problems
        parameters = _parameters(obj, method=False)  # a class's signature is its __init__'s, without self
    else:
        parameters = _parameters(obj, method)
        if _returns_something(obj) and "Returns" not in found and "Yields" not in found:
            problems.append("a Returns: section")
    if parameters:
        documented = set(found.get("Args", []))
        undocumented = [p for p in parameters if p not in documented]
        if "Args" not in found:
            problems.append(f"an Args: section (for {parameters})")
        elif undocumented:
            problems.append(f"Args: entries for {undocumented}")
    return problems


def issue_numbers(text: str) -> list[str]:
    """Every ``issue N`` (``issue #N``, ``Issues 12``) in ``text``."""
    return [m.group(0) for m in _ISSUE.finditer(text)]


# --------------------------------------------------------------------------------------------------
# The checks can fail
# --------------------------------------------------------------------------------------------------


def test_a_long_module_docstring_is_counted() -> None:
    assert module_docstring_lines('"""One.\n' + "more\n" * 25 + '"""\nx = 1\n') == 26
    assert module_docstring_lines("x = 1\n") == 0


def test_a_docstring_without_sections_misses_them() -> None:
    def scale(x: float, by: float = 2.0) -> float:
        """Scale ``x``."""
        return x * by

    def scaled(x: float, by: float = 2.0) -> float:
        """Scale ``x``.

        Args:
            x: The number.
            by (float): The factor.

        Returns:
            ``x * by``.
        """
        return x * by

    def partly(x: float, by: float = 2.0) -> None:
        """Scale ``x``.

        Args:
            x: The number.
        """

    class Scaler:
        def scale(self, x: float) -> None:
            """Scale ``x``.

            Args:
                x: The number.
            """

    assert missing(scale) == ["a Returns: section", "an Args: section (for ['x', 'by'])"]
    assert missing(Scaler.scale, method=True) == []
    assert missing(Scaler.scale) == ["Args: entries for ['self']"]
    assert missing(scaled) == []
    assert missing(partly) == ["Args: entries for ['by']"]


def test_a_record_needs_every_field_named() -> None:
    class Point(NamedTuple):
        """A point.

        Attributes:
            x: Across.
        """

        x: int
        y: int

    @dataclasses.dataclass
    class Box:
        """A box.

        Args:
            width: Across.
            height: Up.
        """

        width: int
        height: int

    assert missing(Point) == ["Args:/Attributes: entries for the fields ['y']"]
    assert missing(Box) == []


def test_an_issue_number_is_found() -> None:
    assert issue_numbers("fixed (issue 18)\nsee Issue #5; issues 3") == ["issue 1", "Issue #5", "issues 3"]
    assert issue_numbers("an issue with 3 parts, reissue 4") == []


# --------------------------------------------------------------------------------------------------
# The package
# --------------------------------------------------------------------------------------------------


def _package_modules() -> list[Path]:
    return sorted(p for p in (ROOT / "gradguard").rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _package_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_docstring_fits_a_screen(path: Path) -> None:
    lines = module_docstring_lines(path.read_text(encoding="utf-8"))
    assert lines <= MAX_MODULE_DOCSTRING_LINES, (
        f"{path.relative_to(ROOT)}: its module docstring has {lines} lines (at most "
        f"{MAX_MODULE_DOCSTRING_LINES}): keep what a maintainer needs there, move the design to docs/ "
        "(docs/how-it-works.md) and link it"
    )


def _reference_names() -> list[str]:
    names = []
    for page in sorted(REFERENCE.glob("*.md")):
        names += re.findall(r"^::: ([\w.]+)[ ]*$", page.read_text(encoding="utf-8"), re.MULTILINE)
    return names


def _resolve(name: str) -> Any:
    module_name, _, attribute = name.rpartition(".")
    while module_name:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            module_name, _, parent = module_name.rpartition(".")
            attribute = f"{parent}.{attribute}"
            continue
        obj: Any = module
        for part in attribute.split("."):
            obj = getattr(obj, part)
        return obj
    raise LookupError(name)


def _reference_params() -> list[Any]:
    """The reference's names; a framework's integration runs with the integration tests (it imports the framework)."""
    return [
        pytest.param(name, marks=pytest.mark.integration) if name.startswith("gradguard.integrations.") else name
        for name in _reference_names()
    ]


@pytest.mark.parametrize("name", _reference_params())
def test_the_reference_shows_the_parameters_of(name: str) -> None:
    try:
        obj = _resolve(name)
    except ImportError as error:  # an integration whose framework is not installed here
        pytest.skip(f"{name}: {error}")
    shown = [(name, obj, False)]  # what mkdocstrings shows: the object, and a class's own public methods
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        shown += [
            (f"{name}.{attribute}", value, True)
            for attribute, value in vars(obj).items()
            if not attribute.startswith("_") and inspect.isfunction(value)
        ]
    problems = [f"{each}: {'; '.join(missing(o, method))}" for each, o, method in shown if missing(o, method)]
    need = "docstrings need (Google style: Args:, Returns:, Raises:, Attributes:):\n"
    assert problems == [], need + "\n".join(problems)


def test_every_public_name_is_in_the_reference() -> None:
    import gradguard
    import gradguard.testing

    documented = set(_reference_names())
    public = {f"gradguard.{n}" for n in gradguard.__all__ if n != "__version__"}
    public |= {f"gradguard.testing.{n}" for n in gradguard.testing.__all__}
    assert sorted(public - documented) == []


# --------------------------------------------------------------------------------------------------
# No history
# --------------------------------------------------------------------------------------------------


def _texts() -> list[Path]:
    found = []
    suffixes = (".py", ".md", ".txt", ".toml", ".yml", ".yaml", ".sh")
    for folder in ("gradguard", "gradguard_pytest", "tests", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in suffixes and "__pycache__" not in path.parts:
                found.append(path)
    return found + [ROOT / "README.md"]


def test_no_issue_number_in_the_code_the_tests_or_the_docs() -> None:
    this = Path(__file__).resolve()
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _texts()
        if path.resolve() != this
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if issue_numbers(line)
    ]
    assert found == [], "say what the code guards against instead of which issue found it:\n" + "\n".join(found)
