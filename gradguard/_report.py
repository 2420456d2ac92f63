"""What happens once a graph is found: the call site, the stats, the warning or the error.

Nothing here runs for a record that carries no graph except :func:`count_clean`, a per-thread
counter: site attribution (a frame walk) only happens on the graph path, and the full inspection
(paths, the pinned-bytes estimate) only on a site's first record, for a warning, or in raise mode.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import wrapt

from ._errors import GraphRetentionError, GraphRetentionWarning
from ._graph import pinned_bytes
from ._policy import DETACH, RAISE, WARN, Mode
from ._tree import GraphRecord, find_graphs

__all__ = ["SiteStats", "Stats", "caller", "count_clean", "graph_seen", "reset_stats", "stats"]

logger = logging.getLogger("gradguard")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_WRAPT_DIR = os.path.dirname(os.path.abspath(wrapt.__file__)) + os.sep
UNRESOLVED = "(no graph: site not resolved)"


_internal_files: dict[str, bool] = {}


def caller() -> tuple[str, int]:
    """``(filename, lineno)`` of the innermost frame outside gradguard and wrapt.

    The walk starts above the function that called ``caller`` (always gradguard's own).
    """
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = _internal_files.get(filename)
        if internal is None:
            internal = _internal_files[filename] = filename.startswith((_PACKAGE_DIR, _WRAPT_DIR))
        if not internal:
            return filename, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>", 0


@dataclass
class SiteStats:
    """Counters for one (store, call site) pair.

    ``site`` is ``file:line`` of the code that published into the store, or, for records that carried
    no graph, the marker ``(no graph: site not resolved)`` (attribution is skipped to keep that path
    cheap). ``pinned_bytes_released`` is ``pinned_bytes`` of the first graph-carrying record seen at the
    site times the number of such records: an estimate, made once per site.
    """

    store: str
    site: str
    records: int = 0
    tensors_detached: int = 0
    pinned_bytes_per_record: int = 0
    pinned_bytes_released: int = 0


class Stats(dict[tuple[str, str], SiteStats]):
    """``stats()``'s result: ``{(store, site): SiteStats}``; ``str()`` gives a table."""

    def __str__(self) -> str:
        header = ("store", "site", "records", "tensors detached", "pinned released (est.)")
        rows = [
            (s.store, s.site, str(s.records), str(s.tensors_detached), _human(s.pinned_bytes_released))
            for s in self.values()
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


class _Site:
    __slots__ = ("store", "site", "estimate", "records", "tensors")

    def __init__(self, store: str, site: str, estimate: int) -> None:
        self.store, self.site, self.estimate = store, site, estimate
        self.records = self.tensors = 0

    def snapshot(self) -> SiteStats:
        return SiteStats(self.store, self.site, self.records, self.tensors, self.estimate, self.records * self.estimate)


_lock = threading.Lock()
_sites: dict[tuple[str, tuple[str, int]], _Site] = {}  # (store, (filename, lineno)) -> counters
_warned: set[tuple[str, tuple[str, int]]] = set()
# Clean records are counted per thread without a lock (the hot path); stats() adds the tables up.
_clean_tables: list[dict[str, int]] = []
_local = threading.local()


def stats() -> Stats:
    """A snapshot of the per-site counters of every guarded store in this process."""
    with _lock:
        snapshot = Stats({(s.store, s.site): s.snapshot() for s in _sites.values()})
        tables = [dict(t) for t in _clean_tables]
    for table in tables:
        for store, n in table.items():
            row = snapshot.setdefault((store, UNRESOLVED), SiteStats(store, UNRESOLVED))
            row.records += n
    return snapshot


def reset_stats() -> None:
    """Clear every counter, and forget which sites were already warned about."""
    with _lock:
        _sites.clear()
        _warned.clear()
        for table in _clean_tables:
            table.clear()


def count_clean(store: str, n: int = 1) -> None:
    """Count ``n`` records that reached ``store`` carrying nothing to detach."""
    try:
        table = _local.table
    except AttributeError:
        table = _local.table = {}
        with _lock:
            _clean_tables.append(table)
    table[store] = table.get(store, 0) + n


def graph_seen(store: str, mode: Mode, record: Any, n_detached: int, where: tuple[str, int]) -> None:
    """Account one record from which ``n_detached`` tensors were detached; warn or raise per ``mode``.

    ``record`` is the original (undetached) record. Once a site is known (and, in ``warn`` mode, has
    warned), this only bumps its counters: the record is inspected (``find_graphs``, and the
    ``pinned_bytes`` estimate, once per site) on a site's first record, for its warning, and in
    ``raise`` mode, where it raises :class:`GraphRetentionError` and counts nothing. A record whose
    detached tensors were all leaves (no graph) is counted as clean there. In ``warn`` mode the
    warning comes before the counting: when a warnings filter turns it into an exception, the record
    is refused like in ``raise`` mode and the site is not marked as warned.
    """
    key = (store, where)
    entry = _sites.get(key)
    if entry is not None and (mode == DETACH or (mode == WARN and key in _warned)):
        _lock.acquire()  # not `with`: this is the per-record path of a known site
        entry.records += 1
        entry.tensors += n_detached
        _lock.release()
        return
    graphs = find_graphs(record)
    if not graphs:
        count_clean(store)
        return
    estimate = entry.estimate if entry is not None else pinned_bytes(record)
    site = f"{where[0]}:{where[1]}"
    if mode == RAISE:
        raise GraphRetentionError(_message(store, site, graphs, estimate, refused=True))
    if mode == WARN:
        with _lock:
            warn = key not in _warned
            _warned.add(key)  # claimed before warning: one warning per site across threads
        if warn:
            try:
                warnings.warn_explicit(
                    _message(store, site, graphs, estimate, refused=False), GraphRetentionWarning, *where
                )
            except BaseException:
                with _lock:
                    _warned.discard(key)
                raise
    with _lock:
        entry = _sites.get(key)
        first = entry is None
        if entry is None:
            entry = _sites[key] = _Site(store, site, estimate)
        entry.records += 1
        entry.tensors += n_detached
    if first:
        logger.debug("gradguard: first graph-carrying record at %s into %s (~%s pinned)", site, store, _human(estimate))


def _message(store: str, site: str, graphs: list[GraphRecord], estimate: int, *, refused: bool) -> str:
    shown = "\n".join(
        f"    {g.path or '<the record itself>'}  {g.grad_fn}  shape={g.shape} {g.dtype}" for g in graphs[:8]
    )
    more = f"\n    ... and {len(graphs) - 8} more" if len(graphs) > 8 else ""
    outcome = (
        "Refused (mode 'raise'): nothing was stored."
        if refused
        else "Detached before storing (mode 'warn'); this site will not warn again."
    )
    return (
        f"{len(graphs)} tensor(s) carrying an autograd graph reached store {store} from {site}, "
        f"pinning ~{_human(estimate)} per record:\n{shown}{more}\n{outcome} "
        "Fix at the source: publish `.detach()`ed values *after* the loss is computed."
    )


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
