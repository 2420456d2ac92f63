"""The publish boundary: a value published into a store goes through the active mode here.

Guarded stores, the ``forward_step`` decorator and the engine adapters all call :func:`publish` (one
record) or :func:`publish_many` (a batch, stored all or nothing). Per mode:

* ``off``: the value itself;
* ``detach``: :func:`gradguard.detach_tree` of it; a record that carried a graph is counted at its
  call site (the first frame outside gradguard and wrapt);
* ``warn``: the same, and one :class:`GraphRetentionWarning` per call site; every record is also
  inspected for graphs the walk could not replace (inside objects no rule can rebuild), which are
  stored as they are and warned about once per site;
* ``raise``: every record is inspected, and one that holds a graph anywhere is refused with
  :class:`GraphRetentionError`: nothing is stored, and the refusal is counted at its call site.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from .._errors import GraphRetentionError, GraphRetentionWarning
from .._graph.memory import pinned_bytes, released_bytes
from .._policy import stats as _stats
from .._policy.message import human, retention
from .._policy.modes import OFF, RAISE, WARN, Mode, resolve
from .._policy.site import caller, location, warn_at
from .._tree.walk import detach, find_graphs

__all__ = ["ToHost", "publish", "publish_many"]

ToHost = Callable[[Any], Any]
logger = logging.getLogger("gradguard")


def publish(value: Any, store: str, mode: Mode | None = None, to_host: ToHost | None = None) -> Any:
    """What ``store`` should hold for ``value`` under ``mode`` (``None``: the context's mode).

    ``to_host``, when given, then moves what is stored off the accelerator (``offload="cpu"``).
    """
    mode = resolve(mode)
    if mode == OFF:
        return value
    if mode == RAISE:
        _refuse_graphs(store, (value,))
    new, tensors = detach(value)
    if mode == WARN:
        _warn_kept(store, new)  # before counting: a warning turned into an error stores nothing
    if new is value:
        _stats.count_clean(store)
    else:
        _site(store, mode, value).add(tensors)
    return new if to_host is None else to_host(new)


def publish_many(
    values: Iterable[Any], store: str, mode: Mode | None = None, to_host: ToHost | None = None
) -> list[Any]:
    """:func:`publish` for a batch, all or nothing: one refused value (``raise``, or a warning turned
    into an error) refuses the whole batch before any of it is counted (a refusal is counted as one)."""
    values = list(values)
    mode = resolve(mode)
    if mode == OFF:
        return values
    if mode == RAISE:
        _refuse_graphs(store, values)
    walks = [detach(value) for value in values]
    counts: list[tuple[_stats.Count, int]] = []
    for value, (new, tensors) in zip(values, walks):
        if mode == WARN:
            _warn_kept(store, new)
        if new is not value:
            counts.append((_site(store, mode, value), tensors))
    for count, tensors in counts:
        count.add(tensors)
    if len(counts) < len(values):
        _stats.count_clean(store, len(values) - len(counts))
    news = [new for new, _ in walks]
    return news if to_host is None else [to_host(new) for new in news]


def _refuse_graphs(store: str, values: Iterable[Any]) -> None:
    for value in values:
        graphs = find_graphs(value)
        if graphs:
            frame = caller()
            site = location(frame)
            message = retention(store, site, graphs, pinned_bytes(value), "refused")
            _stats.count_refused(store, site)
            raise GraphRetentionError(message)


def _site(store: str, mode: Mode, record: Any) -> _stats.Count:
    """The counters of ``record``'s call site, a record that carried a graph; a site's first record
    makes its estimate and, in ``warn`` mode, warns."""
    frame = caller()
    count = _stats.known_site(store, mode, frame)
    if count is None:
        site = location(frame)
        estimate = _stats.estimate_of(store, site)
        if estimate is None:
            estimate = released_bytes(record)
        if mode == WARN:
            _warn_once(store, site, "detached", find_graphs(record), pinned_bytes(record), frame)
        count, first = _stats.new_site(store, mode, frame, site, estimate)
        if first:
            logger.debug(
                "gradguard: first graph-carrying record at %s into %s (~%s released)", site, store, human(estimate)
            )
    return count


def _warn_kept(store: str, stored: Any) -> None:
    """``warn``: graphs left in what is stored (where the walk cannot rebuild) are warned about, once per site."""
    graphs = find_graphs(stored)
    if graphs:
        frame = caller()
        _warn_once(store, location(frame), "kept", graphs, pinned_bytes(stored), frame)


def _warn_once(store: str, site: str, kind: str, graphs: Any, estimate: int, frame: Any) -> None:
    if not _stats.claim_warning(store, site, kind):
        return
    try:
        warn_at(retention(store, site, graphs, estimate, kind), GraphRetentionWarning, frame)
    except BaseException:
        # a filter turned the warning into an error: nothing was stored, and the site may warn again
        _stats.release_warning(store, site, kind)
        raise
