"""A holder's retainer chain, as the page shows it: the links of its path, from the root that names it to
the tensors, each with what the holders found through it keep.

A report records each holder by its path (``HolderHistory.holder``: ``__main__:engine.output_lst[*]
['model_output']['log_probs']``) and its figures, not the live objects along it; the links are read back
from that spelling (:func:`gradguard._heap.paths.holder_key` writes it), and what a link keeps is the sum,
over the holders of the same process whose paths pass through it, of their tensors, pinned bytes and
graph nodes: two holders under one ``engine`` both count at ``engine``. So every report version that has
holders gives chains, and the report stays the size it was.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

__all__ = ["chains", "links"]

_STEP = re.compile(
    r"\.[A-Za-z_]\w*(\(\))?"  # .attr, .keys()
    r"|\((\.[A-Za-z_]\w*)+\)\*"  # (.next)*: a linked list's repeated attribute
    r"|\{…\}"  # a set member
)
_ENDS = ".[({ "  # what may start the step after a name


def _name_end(path: str, start: int) -> int:
    """Where the name starting at ``start`` ends: at the next character that starts a step."""
    ends = [i for i in (path.find(c, start + 1) for c in _ENDS) if i != -1]
    return min(ends, default=len(path))


def _root_end(path: str) -> int:
    """Where the root (``module:NAME``, ``file in function: name``, ``closure of f: name``) ends."""
    framed = path.find(": ")
    if framed != -1 and "[" not in path[:framed]:  # a frame's local, a closure's cell, a named object
        return _name_end(path, framed + 2)
    colon = path.find(":")
    if colon == -1:
        return len(path)
    return _name_end(path, colon + 1)


def _bracket_end(path: str, start: int) -> int:
    """The end of the ``[...]`` at ``start``; a ``]`` inside a quoted key does not close it."""
    quote = ""
    i = start + 1
    while i < len(path):
        c = path[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == "]":
            return i + 1
        i += 1
    return len(path)


def links(path: str) -> list[str]:
    """The links of a holder's path, root first.

    Args:
        path: A holder's path as a report spells it.

    Returns:
        ``["__main__:engine", ".output_lst", "[*]", "['model_output']", "['log_probs']"]``; their
        concatenation is ``path``. A path that cannot be read as links is one link.
    """
    at = _root_end(path)
    found = [path[:at]]
    while at < len(path):
        if path[at] == "[":
            end = _bracket_end(path, at)
        else:
            step = _STEP.match(path, at)
            end = step.end() if step else _name_end(path, at)
        found.append(path[at:end])
        at = end
    return found


def _through(holder: str, prefix: str) -> bool:
    return holder == prefix or (holder.startswith(prefix) and holder[len(prefix)] in _ENDS)


def chains(holders: Sequence[Any]) -> dict[str, list[dict[str, Any]]]:
    """Each holder's chain, from the holders one process found.

    Args:
        holders: The process's holder records (``holder``, ``tensors``, ``pinned_bytes``, ``nodes``,
            ``node_bytes``), the bounded ones too.

    Returns:
        For each holder, its links root first, each as ``link`` (the step), ``path`` (the path up to and
        with it), ``holders`` (how many of the holders pass through it), ``tensors``, ``pinned_bytes``,
        ``nodes`` and ``node_bytes`` (their sums over those holders).
    """
    made: dict[str, list[dict[str, Any]]] = {}
    for h in holders:
        steps = links(h.holder)
        chain = []
        for i, link in enumerate(steps):
            prefix = "".join(steps[: i + 1])
            through = [other for other in holders if _through(other.holder, prefix)]
            chain.append(
                {
                    "link": link,
                    "path": prefix,
                    "holders": len(through),
                    "tensors": sum(o.tensors for o in through),
                    "pinned_bytes": sum(o.pinned_bytes for o in through),
                    "nodes": sum(o.nodes for o in through),
                    "node_bytes": sum(o.node_bytes for o in through),
                }
            )
        made[h.holder] = chain
    return made
