"""What happens once a graph is found: the call site, the stats, the warning or the error.

A record that carries no graph costs one per-thread counter (:func:`count_clean`): no frame walk,
no lock. A record that carried a graph (:func:`graph_seen`) is attributed to its call site, keyed by
the caller's code object and instruction offset, and counted in a per-thread table, still without a
lock. The full inspection (paths, the pinned-bytes estimate, the line number) happens once per site
and mode in each thread, for a warning, and in ``raise`` mode.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import types
import warnings
from dataclasses import dataclass
from typing import Any

import wrapt

from ._errors import GraphRetentionError, GraphRetentionWarning
from ._graph import pinned_bytes
from ._policy import RAISE, WARN, Mode
from ._tree import GraphRecord, find_graphs

__all__ = ["SiteStats", "Stats", "count_clean", "graph_seen", "reset_stats", "stats", "warn_outside"]

logger = logging.getLogger("gradguard")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_WRAPT_DIR = os.path.dirname(os.path.abspath(wrapt.__file__)) + os.sep
UNRESOLVED = "(no graph: site not resolved)"
_getframe = sys._getframe


class _Internal(dict[str, bool]):
    """filename -> whether it is gradguard's or wrapt's (frames skipped when finding the caller)."""

    def __missing__(self, filename: str) -> bool:
        flag = self[filename] = filename.startswith((_PACKAGE_DIR, _WRAPT_DIR))
        return flag


_internal = _Internal()


def _outside(frame: types.FrameType | None) -> types.FrameType | None:
    """``frame`` or the first one above it that is neither gradguard's nor wrapt's."""
    while frame is not None and _internal[frame.f_code.co_filename]:
        frame = frame.f_back
    return frame


def warn_outside(message: str, category: type[Warning]) -> None:
    """``warnings.warn``, attributed to the first caller outside gradguard and wrapt (as it would
    be with the right ``stacklevel``, whatever gradguard's own call depth)."""
    frame = _outside(_getframe(1))
    if frame is None:
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__"),
        registry=module_globals.setdefault("__warningregistry__", {}),
        module_globals=module_globals,
    )


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
    """One (store, ``file:line``) row: its estimate, and the code objects whose ids key it (kept alive)."""

    __slots__ = ("store", "site", "estimate", "codes")

    def __init__(self, store: str, site: str, estimate: int) -> None:
        self.store, self.site, self.estimate = store, site, estimate
        self.codes: list[types.CodeType] = []


_lock = threading.Lock()  # guards _sites, _warned, _tallies and _Site.codes; never taken per record
_sites: dict[tuple[str, str], _Site] = {}  # (store, "file:line") -> row
_warned: set[tuple[str, str]] = set()
# Per-thread counters: only their thread writes them, so the per-record paths take no lock.
#   clean: store -> records without a graph
#   sites: (store, id(code), f_lasti, mode) -> [site, records, tensors]; a key is present once its
#          site was inspected in this thread for that mode (in warn mode: once the site has warned)
_tallies: list[tuple[dict[str, int], dict[Any, list[Any]]]] = []
_local = threading.local()


def _this_thread() -> tuple[dict[str, int], dict[Any, list[Any]]]:
    tally: tuple[dict[str, int], dict[Any, list[Any]]] = ({}, {})
    _local.clean, _local.sites = tally
    with _lock:
        _tallies.append(tally)
    return tally


def stats() -> Stats:
    """A snapshot of the per-site counters of every guarded store in this process."""
    with _lock:
        rows = {key: SiteStats(site.store, site.site, 0, 0, site.estimate) for key, site in _sites.items()}
        tables = [(dict(clean), [tuple(e) for e in sites.values()]) for clean, sites in _tallies]
    for clean, entries in tables:
        for site, records, tensors in entries:
            row = rows[(site.store, site.site)]
            row.records += records
            row.tensors_detached += tensors
        for store, n in clean.items():
            rows.setdefault((store, UNRESOLVED), SiteStats(store, UNRESOLVED)).records += n
    snapshot = Stats()
    for key, row in rows.items():
        if row.records:
            row.pinned_bytes_released = row.records * row.pinned_bytes_per_record
            snapshot[key] = row
    return snapshot


def reset_stats() -> None:
    """Clear every counter, and forget which sites were already warned about."""
    with _lock:
        _sites.clear()
        _warned.clear()
        for clean, sites in _tallies:
            clean.clear()
            sites.clear()


def count_clean(store: str, n: int = 1) -> None:
    """Count ``n`` records that reached ``store`` carrying nothing to detach."""
    try:
        clean = _local.clean
    except AttributeError:
        clean = _this_thread()[0]
    clean[store] = clean.get(store, 0) + n


def graph_seen(store: str, mode: Mode, record: Any, n_detached: int, skip: int | None = 0) -> None:
    """Account one record from which ``n_detached`` tensors were detached; warn or raise per ``mode``.

    ``record`` is the original (undetached) record. The call site is found from the caller of the
    function that called ``graph_seen`` (gradguard's ``publish_into``): that frame itself when
    ``skip`` is ``None`` (a store's ``append``: whoever called it appended); else the first frame
    that is neither gradguard's nor wrapt's, searching from ``skip`` frames above it. A site already
    inspected in this thread for ``mode`` only has its counters bumped. Otherwise see :func:`_inspect`.
    """
    start = _getframe(2 if skip is None else 2 + skip)
    try:
        sites = _local.sites
    except AttributeError:
        sites = _this_thread()[1]
    # Looked up before the frame is checked: most records come from a site already counted, and a
    # search past gradguard's and wrapt's frames never ends on one of theirs, so never on a key made
    # from a start frame that needed it.
    entry = sites.get((store, id(start.f_code), start.f_lasti, mode))
    if entry is None:
        frame: types.FrameType | None = start
        if skip is not None and _internal[start.f_code.co_filename]:
            frame = _outside(start.f_back)
        key = (store, 0, 0, mode) if frame is None else (store, id(frame.f_code), frame.f_lasti, mode)
        entry = sites.get(key)
        if entry is None:
            _inspect(store, mode, record, n_detached, frame, sites, key)
            return
    # two increments: a concurrent stats() may see the record before its tensors
    entry[1] += 1
    entry[2] += n_detached


def _inspect(
    store: str, mode: Mode, record: Any, n: int, frame: types.FrameType | None, sites: dict[Any, list[Any]], key: Any
) -> None:
    """A site's first record in this thread and mode: find the graphs, estimate, warn or raise, count.

    In ``raise`` mode this raises :class:`GraphRetentionError` and counts nothing (nor is the site
    remembered: every record there is inspected). A record whose detached tensors were all leaves
    (no graph) is counted as clean. In ``warn`` mode the warning comes before the counting: when a
    warnings filter turns it into an exception, the record is refused like in ``raise`` mode and the
    site is not marked as warned.
    """
    graphs = find_graphs(record)
    if not graphs:
        count_clean(store)
        return
    where = ("<unknown>", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)
    site_name = f"{where[0]}:{where[1]}"
    row = (store, site_name)
    with _lock:
        site = _sites.get(row)
    estimate = site.estimate if site is not None else pinned_bytes(record)
    if mode == RAISE:
        raise GraphRetentionError(_message(store, site_name, graphs, estimate, refused=True))
    if mode == WARN:
        with _lock:
            warn = row not in _warned
            _warned.add(row)  # claimed before warning: one warning per site across threads
        if warn:
            try:
                warnings.warn_explicit(
                    _message(store, site_name, graphs, estimate, refused=False), GraphRetentionWarning, *where
                )
            except BaseException:
                with _lock:
                    _warned.discard(row)
                raise
    with _lock:
        site = _sites.get(row)
        first = site is None
        if site is None:
            site = _sites[row] = _Site(store, site_name, estimate)
        if frame is not None:
            site.codes.append(frame.f_code)  # keeps id(f_code) in this thread's key meaning this code
    sites[key] = [site, 1, n]
    if first:
        logger.debug(
            "gradguard: first graph-carrying record at %s into %s (~%s pinned)", site_name, store, _human(estimate)
        )


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
