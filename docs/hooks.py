"""mkdocs hooks: show the docstrings' reStructuredText roles as plain code.

The docstrings write cross-references the Sphinx way (:func:`gradguard.audit`,
:class:`~gradguard.Watcher`). Rendered as Markdown they would show the role's name before the
code; this hook drops the role (and, for ``~``, keeps the last dotted name).
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc|obj|const):(<code>)~?([^<]*?)(</code>)")


def _strip(match: re.Match[str]) -> str:
    name = match.group(2)
    if match.group(0).split("<code>", 1)[1].startswith("~"):
        name = name.rsplit(".", 1)[-1]
    return f"{match.group(1)}{name}{match.group(3)}"


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(_strip, html)
