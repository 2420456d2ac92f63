"""One plain-text table renderer for every table gradguard prints: ``stats()``, ``gradguard bench``,
the overhead benchmark and the audit report."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["markdown", "text"]


def text(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table.

    Args:
        header: The column names.
        rows: The cells, one sequence per row, as many as ``header``.

    Returns:
        Columns padded to their widest cell, a rule of dashes under the header, no trailing spaces.
    """
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table.

    Args:
        header: The column names.
        rows: The cells, one sequence per row.

    Returns:
        The table's lines (``|`` in a cell is escaped).
    """

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *(line(r) for r in rows)])
