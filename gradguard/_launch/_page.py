"""``--html`` and ``--png`` of ``gradguard run`` and ``gradguard report``: checked before anything runs,
then the run's processes handed to the page's writer (:mod:`gradguard._tools.page`) once the run ends."""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import GradGuardError
from .._policy import validate
from ._processes import combined, labels
from ._report import ProcessReport, Record

__all__ = ["check", "write"]


def check(html: str | None, png: str | None) -> str | None:
    """What is wrong with ``--html`` and ``--png``, or ``None``.

    Args:
        html: ``--html``'s file, or ``None``.
        png: ``--png``'s file, or ``None``.

    Returns:
        The refusal (the option, its value, what is accepted or what to install), else ``None``.
    """
    from .._tools.page import require

    try:
        for flag, path in (("--html", html), ("--png", png)):
            if path is not None:
                validate.output_file(path, what=flag)
                require(flag)
    except GradGuardError as exc:
        return str(exc)
    if html is not None and png is not None and html == png:
        return f"--html and --png name the same file {html!r}: give two files"
    return None


def _order(r: ProcessReport) -> tuple[bool, bool, int, str, str, int]:
    return (not r.top, r.rank is None, r.rank or 0, r.actor or "", r.host, r.pid)


def write(
    html: str | None, png: str | None, reports: Sequence[Record], problems: Sequence[str], summary: str, folder: str
) -> list[str]:
    """Write the page and the PNG that were asked for.

    Args:
        html: The page's file, or ``None``.
        png: The PNG's file, or ``None``.
        reports: The run's records (of every kind: the processes are shown, the rest is in ``summary``).
        problems: A line per report file left out.
        summary: The run's merged summary.
        folder: The run folder.

    Returns:
        A line per file: ``the page of this run: PATH``, or ``cannot write ...: why`` (starting so).
    """
    from .._tools.page import Process, html_page, png_plot

    processes = sorted(combined([r for r in reports if isinstance(r, ProcessReport)]), key=_order)
    shown = [Process(label, r) for r, label in zip(processes, labels(processes))]
    said = []
    for flag, path, what in (("--html", html, "the page of this run"), ("--png", png, "the plot of this run")):
        if path is None:
            continue
        try:
            if flag == "--html":
                html_page(path, shown, problems, summary, folder)
            else:
                png_plot(path, shown)
        except (OSError, GradGuardError, ValueError) as exc:
            said.append(f"cannot write {flag} {path!r}: {exc}")
        else:
            said.append(f"{what}: {path}")
    return said
