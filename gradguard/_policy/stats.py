"""Per-store, per-call-site counters, kept per thread so that no append takes a lock.

Each thread writes only its own :class:`_Tally`; :func:`stats` reads every tally under one lock and
adds them up. A thread's tally leaves with the thread: its counts are folded into the process-wide
totals when the thread ends. :func:`reset_stats` starts a new generation: every tally of an older
generation is ignored by :func:`stats` and emptied by its own thread at its next count, so a reset
never races a publishing thread.

A site is ``(store, file:line)``. Per thread it is keyed by ``(store, id(code), instruction offset,
mode)``, so a record from a known site costs a dictionary lookup; the code object is kept alive by
the site's row so that its id keeps meaning that code.
"""

from __future__ import annotations

import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any

from . import table as _table
from .message import display, human
from .modes import Mode

__all__ = [
    "SiteStats",
    "Stats",
    "claim_warning",
    "count_at",
    "count_clean",
    "count_refused",
    "estimate_of",
    "known_site",
    "new_site",
    "release_warning",
    "reset_stats",
    "stats",
]

UNRESOLVED = "(no graph: site not resolved)"


@dataclass
class SiteStats:
    """Counters for one (store, call site) pair.

    Attributes:
        store: The store's name (its ``name=``, an adapter's store, or ``"audit"`` for the watch's repairs).
        site: ``file:line`` of the code that published into the store, or, for records that carried no
            graph, the marker ``(no graph: site not resolved)`` (finding the caller is skipped on that path);
            for the watch's repairs, the holder's path.
        records: Records that carried a graph (in ``raise`` mode, the refused ones).
        tensors_detached: The distinct graph tensors replaced in them.
        pinned_bytes_per_record: What detaching the site's first such record releases (the leaves that
            require grad, not parameters, and their gradients, which its graph keeps once backward ran;
            in a forward-only pass the saved activations are released too and not counted).
        pinned_bytes_released: ``pinned_bytes_per_record`` times ``records``: an estimate, made once per site.
        refused: Of ``records``, those refused in ``raise`` mode (nothing of them was stored, or detached).
    """

    store: str
    site: str
    records: int = 0
    tensors_detached: int = 0
    pinned_bytes_per_record: int = 0
    pinned_bytes_released: int = 0
    refused: int = 0


class Stats(dict[tuple[str, str], SiteStats]):
    """``stats()``'s result: ``{(store, site): SiteStats}``; ``str()`` gives a table."""

    def __str__(self) -> str:
        header: tuple[str, ...] = ("store", "site", "records", "tensors detached", "released (est.)")
        rows: list[tuple[str, ...]] = [
            (display(s.store), display(s.site), str(s.records), str(s.tensors_detached), human(s.pinned_bytes_released))
            for s in self.values()
        ]
        if any(s.refused for s in self.values()):  # a column only where raise mode refused something
            header += ("refused",)
            rows = [(*row, str(s.refused)) for row, s in zip(rows, self.values())]
        return _table.text(header, rows)


class _Row:
    """One (store, ``file:line``) site: its estimate, and the code objects whose ids key it (kept alive)."""

    __slots__ = ("store", "site", "estimate", "codes")

    def __init__(self, store: str, site: str, estimate: int) -> None:
        self.store, self.site, self.estimate = store, site, estimate
        self.codes: dict[int, types.CodeType] = {}


class Count:
    """One thread's counters for one site and mode.

    Args:
        row: The site's row (its estimate, shared by every thread).
    """

    __slots__ = ("row", "records", "tensors")

    def __init__(self, row: _Row) -> None:
        self.row, self.records, self.tensors = row, 0, 0

    def add(self, tensors: int) -> None:
        """Count one more record.

        Two plain increments: a snapshot taken while this thread publishes may see the record
        before its tensors.

        Args:
            tensors: The distinct tensors detached from it.
        """
        self.records += 1
        self.tensors += tensors


class _Tally:
    __slots__ = ("generation", "clean", "counts")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.clean: dict[str, int] = {}
        self.counts: dict[tuple[str, int, int, str], Count] = {}


class _Holder:
    """Lives in the thread's ``threading.local``: when the thread ends it goes, and its tally is retired."""

    __slots__ = ("tally", "__weakref__")

    def __init__(self, tally: _Tally) -> None:
        self.tally = tally


_lock = threading.Lock()  # guards everything below; never taken per record
_generation = 0
_rows: dict[tuple[str, str], _Row] = {}
_warned: set[tuple[str, str, str]] = set()
_live: dict[int, _Tally] = {}  # id(holder) -> the tally of a live thread
_retired_clean: dict[str, int] = {}
_retired: dict[tuple[str, str], list[int]] = {}  # (store, site) -> [records, tensors, estimate] of ended threads
_refused: dict[tuple[str, str], int] = {}  # (store, site) -> records refused (rare: each one raised)
_local = threading.local()


def _tally() -> _Tally:
    try:
        tally: _Tally = _local.holder.tally
    except AttributeError:
        with _lock:
            tally = _Tally(_generation)
            holder = _Holder(tally)
            _live[id(holder)] = tally
        weakref.finalize(holder, _retire, id(holder))
        _local.holder = holder
    if tally.generation != _generation:
        tally.clean.clear()
        tally.counts.clear()
        tally.generation = _generation
    return tally


def _retire(key: int) -> None:
    with _lock:
        tally = _live.pop(key, None)
        if tally is None or tally.generation != _generation:
            return
        for store, n in list(tally.clean.items()):
            _retired_clean[store] = _retired_clean.get(store, 0) + n
        for count in list(tally.counts.values()):
            totals = _retired.setdefault((count.row.store, count.row.site), [0, 0, count.row.estimate])
            totals[0] += count.records
            totals[1] += count.tensors


def count_clean(store: str, n: int = 1) -> None:
    """Count records that carried nothing to detach.

    Args:
        store: The store's name.
        n: How many records.
    """
    clean = _tally().clean
    clean[store] = clean.get(store, 0) + n


def _key(store: str, mode: Mode, frame: types.FrameType | None) -> tuple[str, int, int, str]:
    return (store, 0, 0, mode) if frame is None else (store, id(frame.f_code), frame.f_lasti, mode)


def known_site(store: str, mode: Mode, frame: types.FrameType | None) -> Count | None:
    """This thread's counters for a call site, when it has counted it in this mode already.

    Args:
        store: The store's name.
        mode: The mode the record was published in.
        frame: The publishing frame (its code object and instruction are the key); ``None``: unknown.

    Returns:
        The counters, or ``None`` for a site this thread has not seen in ``mode``.
    """
    return _tally().counts.get(_key(store, mode, frame))


def estimate_of(store: str, site: str) -> int | None:
    """The estimate made for a site already, by any thread.

    Args:
        store: The store's name.
        site: ``file:line``.

    Returns:
        Its pinned bytes per record, or ``None`` when no thread has counted it.
    """
    with _lock:
        row = _rows.get((store, site))
        return None if row is None else row.estimate


def new_site(store: str, mode: Mode, frame: types.FrameType | None, site: str, estimate: int) -> tuple[Count, bool]:
    """Start counting a call site in this thread.

    Args:
        store: The store's name.
        mode: The mode the record was published in.
        frame: The publishing frame, as for :func:`known_site`.
        site: ``file:line`` of it.
        estimate: Its pinned bytes per record (kept from the first thread that counts it).

    Returns:
        ``(this thread's counters, whether the site is new to the process)``.
    """
    tally = _tally()
    with _lock:
        row = _rows.get((store, site))
        first = row is None
        if row is None:
            row = _rows[(store, site)] = _Row(store, site, estimate)
        if frame is not None:
            row.codes[id(frame.f_code)] = frame.f_code  # keeps id(f_code) in the threads' keys meaning this code
    count = tally.counts[_key(store, mode, frame)] = Count(row)
    return count, first


def count_at(store: str, site: str, records: int, tensors: int, estimate: int) -> None:
    """Count records at a site named by the caller rather than a line of code (the step-boundary watch:
    store ``"audit"``, the repaired holder's path as the site).

    Args:
        store: The store's name.
        site: The site's name.
        records: How many records.
        tensors: The tensors detached from them.
        estimate: The site's pinned bytes per record, kept from its first count.
    """
    tally = _tally()
    key = (store, -1, 0, site)  # no code object has id -1: never a line-of-code site's key
    count = tally.counts.get(key)
    if count is None:
        with _lock:
            row = _rows.get((store, site))
            if row is None:
                row = _rows[(store, site)] = _Row(store, site, estimate)
        count = tally.counts[key] = Count(row)
    count.records += records
    count.tensors += tensors


def count_refused(store: str, site: str) -> None:
    """Count a record refused in ``raise`` mode (it carried a graph; nothing of it was stored).

    Args:
        store: The store's name.
        site: ``file:line`` of the code that published it.
    """
    with _lock:  # a refusal raises: never on a path that runs per record
        _refused[(store, site)] = _refused.get((store, site), 0) + 1


def claim_warning(store: str, site: str, kind: str) -> bool:
    """Whether a warning is to be shown: once per site and kind, in any thread, until :func:`reset_stats`.

    Args:
        store: The store's name.
        site: The site.
        kind: What the warning is about (``"warn"``, a repair's outcome).

    Returns:
        ``True`` the first time ``(store, site, kind)`` asks.
    """
    with _lock:
        key = (store, site, kind)
        if key in _warned:
            return False
        _warned.add(key)
        return True


def release_warning(store: str, site: str, kind: str) -> None:
    """Undo :func:`claim_warning` (the warning was turned into an exception, so it was not shown).

    Args:
        store: As for :func:`claim_warning`.
        site: As for :func:`claim_warning`.
        kind: As for :func:`claim_warning`.
    """
    with _lock:
        _warned.discard((store, site, kind))


def stats() -> Stats:
    """The counters of every guarded store in this process.

    Returns:
        A snapshot, ``{(store, site): SiteStats}``: every thread's counts, ended threads' included;
        ``str()`` of it is a table.
    """
    with _lock:
        tallies = [t for t in _live.values() if t.generation == _generation]
        # dict() and list() of a dict are single C calls: a publishing thread cannot change them midway
        cleans = [dict(t.clean) for t in tallies] + [dict(_retired_clean)]
        counts = [c for t in tallies for c in list(t.counts.values())]
        retired = [(key, list(totals)) for key, totals in _retired.items()]
        refused = dict(_refused)
    rows: dict[tuple[str, str], SiteStats] = {}
    for (store, site), (records, tensors, estimate) in retired:
        row = rows.setdefault((store, site), SiteStats(store, site, 0, 0, estimate))
        row.records += records
        row.tensors_detached += tensors
    for count in counts:
        r = count.row
        row = rows.setdefault((r.store, r.site), SiteStats(r.store, r.site, 0, 0, r.estimate))
        row.records += count.records
        row.tensors_detached += count.tensors
    for clean in cleans:
        for store, n in clean.items():
            rows.setdefault((store, UNRESOLVED), SiteStats(store, UNRESOLVED)).records += n
    for (store, site), n in refused.items():
        row = rows.setdefault((store, site), SiteStats(store, site))
        row.records += n
        row.refused += n
    snapshot = Stats()
    for key, row in rows.items():
        if row.records:
            row.pinned_bytes_released = (row.records - row.refused) * row.pinned_bytes_per_record
            snapshot[key] = row
    return snapshot


def reset_stats() -> None:
    """Clear every counter, and forget which sites were already warned about."""
    global _generation
    with _lock:
        _generation += 1
        _rows.clear()
        _warned.clear()
        _retired.clear()
        _retired_clean.clear()
        _refused.clear()


def _tables() -> dict[str, Any]:
    """Sizes of the internal tables (tests of bounded growth)."""
    with _lock:
        return {"live": len(_live), "rows": len(_rows), "warned": len(_warned), "retired": len(_retired)}
