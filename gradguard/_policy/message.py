"""What a user reads when a graph is found: the warning and error texts, and how names are shown.

Every name that comes from user code (a store's name, a call site) is shown as it is when it is
plain printable text, and as its ``repr`` otherwise, so a newline or a terminal escape in a name can
never forge a line of a message or of the stats table.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotation only: the launcher's summary uses this module without torch
    from .._tree.walk import GraphRecord

__all__ = ["WIDTH", "display", "fix_lines", "human", "nodes_text", "plural", "retention", "wrap"]

_SHOWN = 8

WIDTH = 100
"""The columns a line of a warning, an error or a summary is kept within (a terminal of 100 columns), where
its content allows: a word longer than that (a holder's path) gets a line of its own instead."""

_KEEP = "\xa0"  # stands for a space that must not break a line; display() never lets one through

OUTCOMES = {
    "refused": "Refused (mode 'raise'): nothing was stored.",
    "detached": "Detached before storing (mode 'warn'); this site will not warn again.",
    "kept": (
        "gradguard cannot rebuild what holds them (an object no rule knows, a set, a dict key), so they were "
        "stored as they are (mode 'warn'); this site will not warn again. Teach the container with "
        "gradguard.register_container, or"
    ),
}


def display(name: str) -> str:
    """A name from user code, as a message shows it.

    Args:
        name: A store's name, a call site, a holder's path.

    Returns:
        ``name`` itself when it is plain printable text, else its ``repr`` (a newline or an escape cannot
        forge a line).
    """
    return name if name.isprintable() else repr(name)


def wrap(text: str, indent: str = "", later: str | None = None, keep: Sequence[str] = ()) -> list[str]:
    """``text`` as lines of at most :data:`WIDTH` columns, broken at spaces.

    Args:
        text: One paragraph.
        indent: What the first line starts with.
        later: What the lines after it start with (``indent`` by default).
        keep: Parts of ``text`` never broken across lines (a holder's path, which may hold spaces): one too
            long for a line gets a line of its own.

    Returns:
        The lines, without trailing spaces; a word longer than a line is left whole on its own line.
    """
    for part in keep:
        text = text.replace(part, part.replace(" ", _KEEP))
    lines = textwrap.wrap(
        text,
        WIDTH,
        initial_indent=indent,
        subsequent_indent=indent if later is None else later,
        break_long_words=False,
        break_on_hyphens=False,
    )
    return [line.replace(_KEEP, " ") for line in lines] or [indent.rstrip()]


def fix_lines(fix: str, indent: str = "") -> list[str]:
    """A fix as a message shows it: ``fix:`` on a line of its own, each of its clauses (``; ``-separated:
    the change to make, then the alternatives) starting a line under the first, a clause too long for
    one line continued two columns further in.

    Args:
        fix: The holder's fix (one line, as reports and tables keep it).
        indent: What the ``fix:`` line starts with.

    Returns:
        The lines, each within :data:`WIDTH` columns where the words allow.
    """
    head, later = f"{indent}fix: ", " " * (len(indent) + len("fix: "))
    lines: list[str] = []
    for i, clause in enumerate(display(fix).split("; ")):
        lines.extend(wrap(clause, head if i == 0 else later, later + "  "))
    return lines


def human(n: int) -> str:
    """Bytes for people.

    Args:
        n: A number of bytes.

    Returns:
        ``384 B``, ``1.5 KiB``, ``45.4 MiB``, ``2.0 GiB`` (GiB the largest unit).
    """
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def plural(n: int, word: str) -> str:
    """A count and its noun.

    Args:
        n: The count.
        word: The noun in the singular (``step boundary``, ``process``, ``multiprocessing child``).

    Returns:
        ``1 step boundary``, ``3 step boundaries``, ``2 processes``, ``4 multiprocessing children``.
    """
    if n == 1:
        return f"{n} {word}"
    if word.endswith("y") and word[-2:-1] not in "aeiou":
        return f"{n} {word[:-1]}ies"
    if word.endswith("child"):
        return f"{n} {word}ren"
    return f"{n} {word}es" if word.endswith(("s", "x", "ch", "sh")) else f"{n} {word}s"


def nodes_text(nodes: int, node_bytes: int) -> str:
    """A holder's graph nodes and what they take, as the watch's tables and messages show them.

    Args:
        nodes: How many autograd nodes its graphs have.
        node_bytes: Their estimated bytes (0: counted for another holder that shares them).

    Returns:
        ``7 (~4.8 KiB)``, ``7 (shared)``, or ``0``.
    """
    if not nodes:
        return "0"
    return f"{nodes} (~{human(node_bytes)})" if node_bytes else f"{nodes} (shared)"


def retention(store: str, site: str, graphs: list[GraphRecord], estimate: int, outcome: str) -> str:
    """The message for graphs that reached a guarded store.

    Args:
        store: The store's name.
        site: The call site that published (``file:line``).
        graphs: The tensors of the record that carried a graph (the first few are listed).
        estimate: What one such record pins, in bytes.
        outcome: What was done: a key of :data:`OUTCOMES` (``refused``, ``detached``, ``kept``).

    Returns:
        The lines of the warning or error.
    """
    shown = "\n".join(
        f"    {display(g.path) or '<the record itself>'}  {g.grad_fn}  shape={g.shape} {g.dtype}"
        for g in graphs[:_SHOWN]
    )
    more = f"\n    ... and {len(graphs) - _SHOWN} more" if len(graphs) > _SHOWN else ""
    fix = "Fix at the source: publish `.detach()`ed values *after* the loss is computed."
    if outcome == "kept":
        fix = "publish `.detach()`ed values *after* the loss is computed."
    return (
        f"{len(graphs)} tensor(s) carrying an autograd graph reached store {display(store)} from {display(site)}, "
        f"pinning ~{human(estimate)} per record:\n{shown}{more}\n{OUTCOMES[outcome]} {fix}"
    )
