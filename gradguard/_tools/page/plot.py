"""The page's plot: each process's memory curve from its report's timeline, on one axis of steps, the
markers of its holders' events, the slope of each curve, and the curve drawn as inline SVG.

The x axis is the step: a micro-batch boundary between step boundaries ``k`` and ``k+1`` sits at the
fraction of that step's time it came at, so the micro-batches show inside each step. Each bucket of the
timeline is drawn at its lowest and its highest figure, so a step in the curve is never smoothed away.
Pure Python: the page is one file with nothing to fetch.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..._watch.timeline import Timeline

__all__ = ["Curve", "Marker", "curves", "svg"]

_KINDS = ("leak-start", "report", "repair")
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf")  # fmt: skip


@dataclasses.dataclass
class Marker:
    """One holder's event on a curve.

    Attributes:
        kind: ``leak-start``, ``report`` or ``repair``.
        holder: The holder's path.
        x: Its place on the step axis.
        memory: The memory figure there (bytes), or ``None`` where the curve has none.
        text: What was said about it.
    """

    kind: str
    holder: str
    x: float
    memory: int | None
    text: str


@dataclasses.dataclass
class Curve:
    """One process's memory over the run.

    Attributes:
        label: The process (``rank 1/2``, ``pid 4242``).
        points: ``(x, low, high)`` per bucket, in order (bytes).
        slope: Bytes per step, fitted over the curve (0 without two points).
        growth: The curve's growth over the run by that slope (bytes).
        flagged: Whether this process grows (a leak found in it, or a clear slope).
        markers: Its holders' events.
        why: Why it is flagged: ``"leak found"``, ``"grows"``, or ``""``.
    """

    label: str
    points: list[tuple[float, int, int]]
    slope: float
    growth: float
    flagged: bool
    markers: list[Marker]
    why: str = ""


def _steps_at(step_buckets: Sequence[Sequence[Any]]) -> tuple[list[float], list[float]]:
    """``(seconds, step)`` pairs of the step boundaries, from the watch's start (step 0 at 0 s)."""
    seconds, steps = [0.0], [0.0]
    for b in step_buckets:
        if b[2] >= seconds[-1] and b[0] >= steps[-1]:
            seconds.append(float(b[2]))
            steps.append(float(b[0]))
    return seconds, steps


def _x(at: float, seconds: list[float], steps: list[float]) -> float:
    """The step axis's place of a moment: between the two step boundaries around it, by time."""
    i = bisect.bisect_right(seconds, at)
    if i >= len(seconds):
        if len(seconds) < 2:
            return at  # no step boundary: seconds stand for steps
        last = (seconds[-1] - seconds[0]) / max(steps[-1] - steps[0], 1)  # the mean step's time
        return steps[-1] + min((at - seconds[-1]) / last, 1.0) if last > 0 else steps[-1]
    before, after = seconds[i - 1], seconds[i]
    share = 0.0 if after <= before else (at - before) / (after - before)
    return steps[i - 1] + share * (steps[i] - steps[i - 1])


def _fit(points: Sequence[tuple[float, int, int]]) -> float:
    if len(points) < 2:
        return 0.0
    xs = [p[0] for p in points]
    ys = [p[2] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    return 0.0 if spread == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread


def _memory_at(points: Sequence[tuple[float, int, int]], x: float) -> int | None:
    if not points:
        return None
    i = min(bisect.bisect_left([p[0] for p in points], x), len(points) - 1)
    return points[i][2]


def curves(processes: Sequence[tuple[str, Mapping[str, Any] | None, Sequence[Any]]]) -> list[Curve]:
    """Each process's curve, the fastest-growing first.

    Args:
        processes: Per process its label, its report's timeline (or ``None``) and its holders
            (``HolderHistory``-like: ``path``, ``outcome``, ``found_at``).

    Returns:
        One :class:`Curve` per process (an empty one where the report has no timeline), sorted by slope.
    """
    made = []
    for label, data, holders in processes:
        timeline = Timeline.from_dict(data) if data is not None else None
        points: list[tuple[float, int, int]] = []
        markers: list[Marker] = []
        if timeline is not None:
            step_buckets = timeline.buckets("step")
            seconds, steps = _steps_at(step_buckets)
            found = [(float(b[0]), b[3], b[4]) for b in step_buckets if b[3] is not None]
            found += [(_x(b[2], seconds, steps), b[3], b[4]) for b in timeline.buckets("micro") if b[3] is not None]
            points = sorted(found)
            for e in timeline.events():
                if e["kind"] in _KINDS:
                    x = _x(e["seconds"], seconds, steps) if len(seconds) > 1 else float(e["step"])
                    markers.append(Marker(e["kind"], e["holder"], x, _memory_at(points, x), e["text"]))
        seen = {(m.kind, m.holder) for m in markers}
        for h in holders:  # a watch that kept no event for it: its first kept boundary, from the holder record
            if h.outcome != "bounded" and ("leak-start", h.path) not in seen and ("leak-start", h.holder) not in seen:
                x = float(h.found_at)
                markers.append(Marker("leak-start", h.holder, x, _memory_at(points, x), f"found at step {h.found_at}"))
        slope = _fit(points)
        span = (points[-1][0] - points[0][0]) if points else 0.0
        growth = slope * span
        lowest = min((p[1] for p in points), default=0)
        leaking = any(h.outcome != "bounded" for h in holders)
        grows = growth > 0.05 * max(lowest, 1) and growth > 1 << 20
        why = "leak found" if leaking else "grows" if grows else ""
        made.append(Curve(label, points, slope, growth, bool(why), markers, why))
    return sorted(made, key=lambda c: (not c.flagged, -c.slope, c.label))


def colour(i: int) -> str:
    """The colour of the ``i``-th curve."""
    return _COLOURS[i % len(_COLOURS)]


def _ticks(low: float, high: float, count: int = 6) -> list[float]:
    if high <= low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next((m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw), raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(count + 2) if first + i * step <= high]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def svg(made: Sequence[Curve], width: int = 960, height: int = 380) -> str:
    """The curves and their markers as one inline SVG element.

    Args:
        made: The curves (:func:`curves`).
        width: Its width in pixels.
        height: Its height in pixels.

    Returns:
        The ``<svg>`` element's text: a ``polyline.curve`` per curve that has points (``data-process``
        its label, ``data-inside`` how many of its points sit inside a step: micro-batch boundaries), a
        ``g.marker`` per marker (``data-kind``, ``data-holder``), the axes.
    """
    from html import escape

    left, right, top, bottom = 80, 20, 20, 40
    drawn = [c for c in made if c.points]
    xs = [p[0] for c in drawn for p in c.points] + [m.x for c in made for m in c.markers]
    ys = [v for c in drawn for p in c.points for v in p[1:]]
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    y0, y1 = (float(min(ys)), float(max(ys))) if ys else (0.0, 1.0)
    if x1 <= x0:
        x1 = x0 + 1
    if y1 <= y0:
        y0, y1 = y0 - 1, y1 + 1
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def py(y: float) -> float:
        return height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)

    parts = [f'<svg id="timeline" viewBox="0 0 {width} {height}" '
             f'width="{width}" height="{height}" role="img" aria-label="memory per process over the steps">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>']  # fmt: skip
    unit = next((u for u in (2**40, 2**30, 2**20, 2**10) if max(abs(y0), abs(y1)) >= 4 * u), 1)
    for t in (v * unit for v in _ticks(y0 / unit, y1 / unit)):
        parts.append(f'<line class="grid" x1="{left}" x2="{width - right}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
                     f'stroke="#e5e5e5"/><text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end" '
                     f'font-size="11">{_bytes(t)}</text>')  # fmt: skip
    for t in _ticks(x0, x1, 10):
        parts.append(f'<line x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{height - bottom}" y2="{height - bottom + 4}" '
                     f'stroke="#333"/><text x="{px(t):.1f}" y="{height - bottom + 16}" text-anchor="middle" '
                     f'font-size="11">{t:g}</text>')  # fmt: skip
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle" font-size="12">'
                 "step (micro-batches inside each step)</text>")  # fmt: skip
    parts.append(
        f'<line x1="{left}" x2="{left}" y1="{top}" y2="{height - bottom}" stroke="#333"/>'
        f'<line x1="{left}" x2="{width - right}" y1="{height - bottom}" y2="{height - bottom}" stroke="#333"/>'
    )
    for i, c in enumerate(made):
        if not c.points:
            continue
        coords = []
        for j, (x, low, high) in enumerate(c.points):
            rising = j + 1 >= len(c.points) or c.points[j + 1][2] >= high
            for y in ((low, high) if rising else (high, low)) if low != high else (low,):
                coords.append(f"{px(x):.1f},{py(y):.1f}")
        inside = sum(1 for x, _, _ in c.points if x != math.floor(x))
        parts.append(f'<polyline class="curve" data-process="{escape(c.label)}" data-inside="{inside}" '
                     f'fill="none" stroke="{colour(i)}" '
                     f'stroke-width="{2.2 if c.flagged else 1.4}" points="{" ".join(coords)}">'
                     f"<title>{escape(c.label)}</title></polyline>")  # fmt: skip
    shapes = {
        "leak-start": "M0,-7 L6,5 L-6,5 Z",
        "report": "M-6,-6 L6,-6 L6,6 L-6,6 Z",
        "repair": "M0,-7 L7,0 L0,7 L-7,0 Z",
    }
    fills = {"leak-start": "#d62728", "report": "#ff7f0e", "repair": "#2ca02c"}
    for c in made:
        for m in c.markers:
            at = py(m.memory) if m.memory is not None else height - bottom - 8.0
            parts.append(f'<g class="marker" data-kind="{m.kind}" data-holder="{escape(m.holder)}" '
                         f'data-process="{escape(c.label)}" transform="translate({px(m.x):.1f},{at:.1f})">'
                         f'<path d="{shapes[m.kind]}" fill="{fills[m.kind]}" stroke="#000" stroke-width="0.6"/>'
                         f"<title>{escape(c.label)}: {m.kind} of {escape(m.holder)} at step {m.x:.2f}"
                         f"{': ' + escape(m.text) if m.text else ''}</title></g>")  # fmt: skip
    if not drawn:
        middle = (top + height - bottom) / 2
        parts.append(f'<text id="no-curve" x="{(left + width - right) / 2}" y="{middle}" text-anchor="middle" '
                     'font-size="14" fill="#777">no memory timeline in these reports</text>')  # fmt: skip
    parts.append("</svg>")
    return "\n".join(parts)
