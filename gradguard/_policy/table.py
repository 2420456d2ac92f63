"""One plain-text table renderer for every table gradguard prints: ``stats()``, ``gradguard bench``,
the overhead benchmark and the audit report."""

from __future__ import annotations

from collections.abc import Sequence

from .message import WIDTH

__all__ = ["fitted", "markdown", "text"]


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


def fitted(header: Sequence[str], rows: Sequence[Sequence[str]], notes: Sequence[Sequence[str]] = ()) -> str:
    """A plain-text table kept within :data:`~gradguard._policy.message.WIDTH` columns where its cells allow,
    with lines of notes under its rows.

    The first column (a holder's path) is as wide as the room the other columns leave, at least as wide
    as its name; a first cell wider than that is written on a line of its own, and its row's other cells
    on the next line, under their columns.

    Args:
        header: The column names.
        rows: The cells, one sequence per row, as many as ``header``.
        notes: For each row, the lines written under it (a fix), already indented; none by default.

    Returns:
        The table as :func:`text` makes it, with those long first cells and the notes.
    """
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    rest = sum(widths[1:]) + 2 * (len(widths) - 1)
    widths[0] = max(len(header[0]), min(widths[0], WIDTH - rest - 2))

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    lines = [line(header), "  ".join("-" * w for w in widths)]
    for i, row in enumerate(rows):
        if len(str(row[0])) > widths[0]:
            lines += [str(row[0]), line(["", *row[1:]])]
        else:
            lines.append(line(row))
        lines.extend(notes[i] if i < len(notes) else ())
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
