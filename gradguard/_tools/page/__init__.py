"""The page of a run: ``gradguard run --html FILE`` and ``gradguard report DIR --html FILE`` (and
``--png FILE``, its plot alone).

One self-contained HTML file that opens offline (no request of any kind: the style, the script and the
plot are inline): every process's memory curve on one axis of steps, the process that grows flagged and
first, each holder's leak start, report and repair marked on its curve, the holders as a sortable table
(each row expandable), the report files left out and why, the run's summary, the command, the versions
and the machine. The templates are package data (Jinja2, the ``gradguard[report]`` extra); the plot is
SVG drawn here (:mod:`.plot`); the PNG is matplotlib's.
"""

from __future__ import annotations

from .render import Process, html_page, png_plot, require

__all__ = ["Process", "html_page", "png_plot", "require"]
