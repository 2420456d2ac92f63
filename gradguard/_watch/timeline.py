"""The watch's timeline: the memory figure and the graph nodes alive at each boundary of both clocks
(``"step"``: an optimizer step boundary; ``"micro"``: a backward, a micro-batch boundary), and the
events (audits, each holder's leak start, report and repair), bounded whatever the run's length.

:meth:`Timeline.point` is on the micro-batch hot path: it appends one tuple to a buffer, and the buffer
is folded into buckets in amortized batches. Each bucket keeps the lowest and the highest memory
figure and node count of the points it merged, so a step in the curve is never smoothed away; when a
clock has more than ``most`` buckets, neighbouring pairs are merged (each bucket then stands for twice
as many boundaries). Events keep the first few per holder and kind, the latest one, and a count.
:meth:`Timeline.to_dict` is one JSON object of at most ``most`` buckets per clock: a run of a million
boundaries serializes to well under a megabyte. Pure Python: nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .tuning import TIMELINE_FIRST as _FIRST
from .tuning import TIMELINE_KEYS as _KEYS
from .tuning import TIMELINE_TEXT as _TEXT

__all__ = ["CLOCKS", "EVENTS", "FORMAT", "VERSION", "Timeline"]

FORMAT = "gradguard-timeline"
VERSION = 1
CLOCKS = ("step", "micro")
EVENTS = ("audit", "leak-start", "report", "repair", "bounded")
_COLUMNS = ("step", "micro", "seconds", "memory_min", "memory_max", "nodes_min", "nodes_max", "count")

# A bucket: [step, micro, seconds, memory_min, memory_max, nodes_min, nodes_max, count], the step, micro and
# seconds of its last point; a memory or node figure is None where no point of the bucket read it.
Bucket = list[Any]


def _low(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None or a <= b else b


def _high(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None or a >= b else b


def _bucket(points: Sequence[tuple[int, int, int | None, int | None, float]]) -> Bucket:
    memory = [p[2] for p in points if p[2] is not None]
    nodes = [p[3] for p in points if p[3] is not None]
    last = points[-1]
    return [
        last[0], last[1], last[4],
        min(memory) if memory else None, max(memory) if memory else None,
        min(nodes) if nodes else None, max(nodes) if nodes else None,
        len(points),
    ]  # fmt: skip


def _pairs(buckets: list[Bucket]) -> list[Bucket]:
    """Neighbouring buckets merged two by two (the second's position, both one's extremes)."""
    merged = []
    for i in range(0, len(buckets) - 1, 2):
        a, b = buckets[i], buckets[i + 1]
        merged.append([b[0], b[1], b[2], _low(a[3], b[3]), _high(a[4], b[4]), _low(a[5], b[5]), _high(a[6], b[6]),
                       a[7] + b[7]])  # fmt: skip
    if len(buckets) % 2:
        merged.append(list(buckets[-1]))
    return merged


class _Series:
    """One clock's buckets, and the points not yet folded into them."""

    __slots__ = ("buckets", "raw", "stride", "fold_at")

    def __init__(self, fold_at: int) -> None:
        self.buckets: list[Bucket] = []
        self.raw: list[tuple[int, int, int | None, int | None, float]] = []
        self.stride = 1  # points per bucket
        self.fold_at = fold_at


class Timeline:
    """The memory figure, the graph nodes and the watch's events over a run, bounded.

    Args:
        most: The most buckets kept per clock (at least 2): beyond it neighbouring ones are merged.

    Raises:
        ValueError: ``most`` is not a whole number >= 2.
    """

    def __init__(self, most: int = 4096) -> None:
        if isinstance(most, bool) or not isinstance(most, int) or most < 2:
            raise ValueError(
                f"Timeline(most={most!r}) is not accepted; accepted: a whole number >= 2 (buckets kept per clock)"
            )
        self.most = most
        self._buffer = max(1, most // 8)
        self._step = _Series(self._buffer)
        self._micro = _Series(self._buffer)
        self._events: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._latest: dict[tuple[str, str], dict[str, Any]] = {}
        self._counts: dict[tuple[str, str], int] = {}
        self._uncounted = 0  # events of (holder, kind) pairs beyond _KEYS
        self._folding = False

    # ------------------------------------------------------------------------------------------ writing

    def point(self, clock: str, step: int, micro: int, memory: int | None, nodes: int | None, seconds: float) -> None:
        """Record one boundary: a few appends, the folding amortized over many calls.

        Args:
            clock: ``"step"`` (an optimizer step boundary) or ``"micro"`` (a backward: a micro-batch boundary).
            step: The step boundaries so far.
            micro: The backwards so far (in the thread that ran this one).
            memory: Bytes in use (CUDA's allocated bytes where CUDA is used, else the CPU figure), or
                ``None`` where not read at this boundary.
            nodes: Graph nodes alive, or ``None``.
            seconds: Time since the watch started.

        Raises:
            ValueError: ``clock`` is neither ``"step"`` nor ``"micro"``.
        """
        if clock == "micro":
            series = self._micro
        elif clock == "step":
            series = self._step
        else:
            raise ValueError(f"clock={clock!r} is not accepted; accepted: 'step' or 'micro'")
        raw = series.raw
        raw.append((step, micro, memory, nodes, seconds))
        if len(raw) >= series.fold_at:
            self._fold(series)

    def _fold(self, series: _Series) -> None:
        if self._folding:  # a point recorded while folding (a finalizer the fold's allocations ran): the next fold's
            return
        self._folding = True
        try:
            raw, stride = series.raw, series.stride
            full = len(raw) - len(raw) % stride
            points = raw[:full]
            del raw[:full]
            if stride == 1:  # a point per bucket (a run's first boundaries): no extremes to find
                series.buckets.extend([p[0], p[1], p[4], p[2], p[2], p[3], p[3], 1] for p in points)
            else:
                series.buckets.extend(_bucket(points[i : i + stride]) for i in range(0, full, stride))
            while len(series.buckets) > self.most - self._buffer:
                series.buckets = _pairs(series.buckets)
                series.stride *= 2
            series.fold_at = max(self._buffer, series.stride)
        finally:
            self._folding = False

    def event(
        self, kind: str, holder: str, step: int, micro: int, seconds: float, bytes: int = 0, text: str = ""
    ) -> None:
        """Record one event of the watch.

        Args:
            kind: ``"audit"``, ``"leak-start"`` (a holder's first kept boundary), ``"report"``, ``"repair"``
                or ``"bounded"``.
            holder: The holder's path (``""`` for an audit).
            step: The step boundaries so far.
            micro: The backwards so far.
            seconds: Time since the watch started.
            bytes: The bytes it concerns (pinned, or given back by a repair).
            text: One line said about it.

        Raises:
            ValueError: ``kind`` is not one of those.
        """
        if kind not in EVENTS:
            raise ValueError(f"event kind={kind!r} is not accepted; accepted: {', '.join(map(repr, EVENTS))}")
        key = (holder, kind)
        entry = {"kind": kind, "holder": holder, "step": step, "micro": micro, "seconds": seconds,
                 "bytes": bytes, "text": text[:_TEXT]}  # fmt: skip
        kept = self._events.get(key)
        if kept is None:
            if len(self._events) >= _KEYS:
                self._uncounted += 1
                return
            kept = self._events[key] = []
        self._counts[key] = self._counts.get(key, 0) + 1
        if len(kept) < _FIRST:
            kept.append(entry)
        else:
            self._latest[key] = entry

    # ------------------------------------------------------------------------------------------ reading

    def buckets(self, clock: str) -> list[Bucket]:
        """One clock's buckets, oldest first, at most ``most`` (the points not yet folded included).

        Args:
            clock: ``"step"`` or ``"micro"``.

        Returns:
            ``[step, micro, seconds, memory_min, memory_max, nodes_min, nodes_max, count]`` per bucket.
        """
        series = {"step": self._step, "micro": self._micro}[clock]
        found = [list(b) for b in series.buckets]
        raw, stride = series.raw, series.stride
        found.extend(_bucket(raw[i : i + stride]) for i in range(0, len(raw), stride))
        while len(found) > self.most:
            found = _pairs(found)
        return found

    def latest(self) -> dict[str, Any] | None:
        """The last boundary recorded, of either clock (for a logger's scalars).

        Returns:
            ``clock``, ``step``, ``micro``, ``memory``, ``nodes``, ``seconds`` of the latest point (a
            bucket's highest figures where it was merged), or ``None`` before the first.
        """
        found: dict[str, Any] | None = None
        for clock, series in (("step", self._step), ("micro", self._micro)):
            if series.raw:
                step, micro, memory, nodes, seconds = series.raw[-1]
            elif series.buckets:
                step, micro, seconds, _, memory, _, nodes, _ = series.buckets[-1]
            else:
                continue
            if found is None or seconds >= found["seconds"]:
                found = {"clock": clock, "step": step, "micro": micro, "memory": memory, "nodes": nodes,
                         "seconds": seconds}  # fmt: skip
        return found

    def events(self) -> list[dict[str, Any]]:
        """The events kept, in the order of their time.

        Returns:
            One dict per event: ``kind``, ``holder``, ``step``, ``micro``, ``seconds``, ``bytes``, ``text``.
        """
        found = [e for kept in self._events.values() for e in kept] + list(self._latest.values())
        return sorted(found, key=lambda e: (e["seconds"], e["step"], e["micro"]))

    def to_dict(self) -> dict[str, Any]:
        """The timeline as one JSON-ready object (read back by :meth:`from_dict`).

        Returns:
            ``format``, ``version``, ``most``, per clock its columns (lists of equal length), the events
            kept, and per holder and kind how many events there were.
        """
        clocks = {}
        for clock in CLOCKS:
            found = self.buckets(clock)
            columns: dict[str, list[Any]] = {name: [b[i] for b in found] for i, name in enumerate(_COLUMNS)}
            columns["seconds"] = [round(s, 4) for s in columns["seconds"]]
            clocks[clock] = columns
        counts = [{"holder": h, "kind": k, "count": n} for (h, k), n in self._counts.items()]
        return {"format": FORMAT, "version": VERSION, "most": self.most, "clocks": clocks, "events": self.events(),
                "counts": counts, "uncounted": self._uncounted}  # fmt: skip

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Timeline:
        """A timeline read back from :meth:`to_dict`'s object.

        Args:
            data: The object.

        Returns:
            The timeline (its buckets as they were written; new points fold into them).

        Raises:
            ValueError: ``data`` is not such an object: the message names the first field that is wrong.
        """
        _check(data)
        made = cls(int(data["most"]))
        for clock in CLOCKS:
            columns = data["clocks"][clock]
            series = made._step if clock == "step" else made._micro
            series.buckets = [list(row) for row in zip(*(columns[name] for name in _COLUMNS))]
            series.stride = max([1, *(b[7] for b in series.buckets)])
            series.fold_at = max(made._buffer, series.stride)
        for e in data["events"]:
            key = (e["holder"], e["kind"])
            made._events.setdefault(key, []).append(dict(e))
        made._counts = {(c["holder"], c["kind"]): c["count"] for c in data["counts"]}
        made._uncounted = data["uncounted"]
        return made


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


_EVENT_FIELDS: dict[str, Any] = {"kind": str, "holder": str, "step": _whole, "micro": _whole,
                                 "seconds": _number, "bytes": _whole, "text": str}  # fmt: skip
_COLUMN_OK = {"step": _whole, "micro": _whole, "seconds": _number, "count": _whole}


def _wrong(where: str, value: object, accepted: str) -> ValueError:
    shown = repr(value)
    return ValueError(f"timeline field {where!r} is {shown[:40]}, not {accepted}")


def _check(data: object) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"a timeline is a JSON object, not {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise _wrong("format", data.get("format"), repr(FORMAT))
    if data.get("version") != VERSION:
        raise _wrong("version", data.get("version"), f"{VERSION} (written by another gradguard)")
    if not _whole(data.get("most")) or data["most"] < 2:
        raise _wrong("most", data.get("most"), "a whole number >= 2")
    clocks = data.get("clocks")
    if not isinstance(clocks, Mapping):
        raise _wrong("clocks", clocks, "an object of 'step' and 'micro'")
    for clock in CLOCKS:
        columns = clocks.get(clock)
        if not isinstance(columns, Mapping):
            raise _wrong(f"clocks.{clock}", columns, "an object of columns")
        length = None
        for name in _COLUMNS:
            column = columns.get(name)
            where = f"clocks.{clock}.{name}"
            if not isinstance(column, list):
                raise _wrong(where, column, "a list")
            if length is not None and len(column) != length:
                raise ValueError(f"timeline field {where!r} has {len(column)} values, not {length} (as many as 'step')")
            length = len(column)
            ok = _COLUMN_OK.get(name, lambda v: v is None or _whole(v))
            bad = next((v for v in column if not ok(v)), _Missing)
            if bad is not _Missing:
                raise _wrong(where + "[]", bad, "a number >= 0" + ("" if name in _COLUMN_OK else " or null"))
        if length is not None and length > data["most"]:
            raise ValueError(f"timeline field 'clocks.{clock}' has {length} buckets, more than 'most' ({data['most']})")
    events = data.get("events")
    if not isinstance(events, list):
        raise _wrong("events", events, "a list")
    for i, e in enumerate(events):
        if not isinstance(e, Mapping):
            raise _wrong(f"events[{i}]", e, "an object")
        for name, kind in _EVENT_FIELDS.items():
            value = e.get(name)
            if not (isinstance(value, kind) if isinstance(kind, type) else kind(value)):
                raise _wrong(f"events[{i}].{name}", value, "a string" if kind is str else "a number >= 0")
        if e["kind"] not in EVENTS:
            raise _wrong(f"events[{i}].kind", e["kind"], f"one of {', '.join(EVENTS)}")
    counts = data.get("counts")
    if not isinstance(counts, list) or not all(
        isinstance(c, Mapping) and isinstance(c.get("holder"), str) and c.get("kind") in EVENTS
        and _whole(c.get("count")) for c in counts
    ):  # fmt: skip
        raise _wrong("counts", counts, "a list of {holder, kind, count}")
    if not _whole(data.get("uncounted")):
        raise _wrong("uncounted", data.get("uncounted"), "a whole number >= 0")


class _Missing:
    """What no column holds."""
