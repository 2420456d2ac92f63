"""Reading back the tables and fixes gradguard prints (the summary's holders, ``gradguard.audit()``'s report),
as the tests that check their cells need them."""

from __future__ import annotations

WIDTH = 100
"""The columns every line of a warning, an error or a summary is kept within, where its content allows."""


def flat(text: str) -> str:
    """``text`` with each run of whitespace (a line wrapped, its indent) as one space: what a test finds
    a phrase in, wherever the lines were broken."""
    return " ".join(text.split())


def fix_text(lines: list[str]) -> str:
    """A fix read back from its lines (``fix: ...`` and the lines under it) as the one line a report keeps:
    a line at the first clause's column starts a clause (``; ``), a line further in continues one."""
    first = lines[0]
    column = first.index("fix: ") + len("fix: ")
    clauses = [first[column:].strip()]
    for line in lines[1:]:
        indent = len(line) - len(line.lstrip())
        if indent == column:
            clauses.append(line.strip())
        else:
            clauses[-1] += " " + line.strip()
    return "; ".join(clauses)


def last_fix(message: str) -> str:
    """The last fix a warning or an error gives (its ``fix:`` line and the lines under it), as one line."""
    lines = message.splitlines()
    at = max(i for i, line in enumerate(lines) if line.lstrip().startswith("fix: "))
    column = lines[at].index("fix: ") + len("fix: ")
    end = at + 1
    while end < len(lines) and len(lines[end]) - len(lines[end].lstrip()) >= column:
        end += 1
    return fix_text(lines[at:end])


def table_rows(text: str, first: str = "holder") -> list[list[str]]:
    """The rows of the table whose header starts with ``first`` (cells split on runs of two spaces), each
    with its fix (read back by :func:`fix_text`) as its last cell where the table gives one.

    A first cell too long for its column stands on a line of its own, the row's other cells on the next.
    """
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first + "  "))
    rows: list[list[str]] = []
    fixes: dict[int, list[str]] = {}
    for line in lines[start + 2 :]:
        if not line.strip() or line.startswith(("(", "gradguard", "process  ", first + "  ")):
            break
        cells = [cell.strip() for cell in line.split("  ") if cell.strip()]
        if not line.startswith(" "):
            rows.append(cells)
        elif line.lstrip().startswith("fix: "):
            fixes[len(rows) - 1] = [line]
        elif len(rows) - 1 in fixes:
            fixes[len(rows) - 1].append(line)
        elif rows and len(rows[-1]) == 1:
            rows[-1] += cells
        else:
            break
    return [row + ([fix_text(fixes[i])] if i in fixes else []) for i, row in enumerate(rows)]


def too_wide(text: str, paths: tuple[str, ...] = ()) -> list[str]:
    """The lines of ``text`` wider than :data:`WIDTH`, but for a line that holds only one of ``paths`` (with
    ``gradguard:`` before it, or a Python warning's ``file:line: Category:`` prefix before that)."""
    wide = []
    for line in text.splitlines():
        if len(line) <= WIDTH:
            continue
        if any(line.strip() == path or line.endswith(f"gradguard: {path}") for path in paths):
            continue
        wide.append(line)
    return wide
