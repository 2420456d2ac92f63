"""The low-water rise rule: turns a stream of per-boundary readings into requests for an audit.

Pure logic: it reads no memory and no clock; the caller gives it each boundary's readings and each
audit's outcome. The watch runs two of them: one over the memory figure (bytes in use per device)
and one over the reference counts of a few parameters (:mod:`gradguard._graph.held`). The rule and
the evidence behind the defaults: ``docs/how-it-works.md``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping

from .._policy.message import human
from .._policy.validate import number, whole
from .tuning import RESIDENT_FLOOR, TRIGGER_BACKOFF, TRIGGER_BOUNDARIES, TRIGGER_FLOOR, TRIGGER_FRACTION, TRIGGER_WINDOW

__all__ = ["DEFAULT_MEMORY", "RESIDENT_FLOOR", "Request", "Trigger", "TriggerSettings"]


@dataclasses.dataclass(frozen=True)
class TriggerSettings:
    """The low-water rise rule's settings (the rule and why these defaults: the guide's *Finding a leak*).

    For each device the watch reads, the *low-water mark* is the lowest figure of the last ``window``
    boundaries; a figure at least ``max(floor, fraction * mark)`` over it at ``boundaries`` boundaries
    in a row asks for an audit. Each argument is kept as the attribute of the same name.

    Args:
        floor: The least growth over the low-water mark that counts, in bytes (a whole number ≥ 1).
        fraction: The threshold's share of the mark (a number ≥ 0 and < 1).
        window: Boundaries the mark looks back over (a whole number ≥ 1).
        boundaries: Boundaries in a row above the threshold that ask for an audit (a whole number ≥ 1).
        backoff: The threshold's factor after a triggered audit that found nothing new (a number ≥ 1;
            1 turns back-off off).

    Raises:
        GradGuardError: a bad value, naming it and what is accepted.
    """

    floor: int = TRIGGER_FLOOR
    fraction: float = TRIGGER_FRACTION
    window: int = TRIGGER_WINDOW
    boundaries: int = TRIGGER_BOUNDARIES
    backoff: float = TRIGGER_BACKOFF

    def __post_init__(self) -> None:
        within = "TriggerSettings"
        whole(self.floor, what="floor", least=1, accepted="a whole number of bytes >= 1", within=within, text=False)
        for name in ("window", "boundaries"):
            whole(getattr(self, name), what=name, least=1, accepted="a whole number of boundaries >= 1",
                  within=within, text=False)  # fmt: skip
        number(self.fraction, what="fraction", accepted="a number >= 0 and < 1", within=within,
               ok=lambda x: 0 <= x < 1, text=False)  # fmt: skip
        number(self.backoff, what="backoff", accepted="a number >= 1 (1: no back-off)", within=within,
               ok=lambda x: x >= 1, text=False)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Request:
    """An audit the trigger asks for at this boundary.

    ``devices``: the devices (or counters) whose figure rose past its threshold over its low-water
    mark at ``boundaries`` boundaries in a row. ``growth`` and ``threshold``: per device of
    ``devices``, how far above its mark it is now, and its threshold.
    """

    devices: tuple[str, ...]
    growth: Mapping[str, int]
    threshold: Mapping[str, int]

    def __str__(self) -> str:
        grown = ", ".join(
            f"{d} +{human(self.growth[d])} over its low-water mark (threshold {human(self.threshold[d])})"
            for d in self.devices
        )
        return f"memory grew: {grown}"


DEFAULT_MEMORY = TriggerSettings()
"""The rule of ``memory=True``: the one instance whose CPU figure gets :data:`RESIDENT_FLOOR` where that
figure is the resident set (a rule the user gives keeps its own floor)."""


class _Device:
    """One device's window of figures (a monotonic deque: the mark in O(1)) and its run above threshold."""

    __slots__ = ("lows", "seen", "above", "scale", "growth", "threshold")

    def __init__(self) -> None:
        self.lows: collections.deque[tuple[int, int]] = collections.deque()  # (boundary, figure), figures rising
        self.seen = 0
        self.above = 0
        self.scale = 1.0
        self.growth = 0
        self.threshold = 0

    def push(self, figure: int, settings: TriggerSettings, floor: int) -> None:
        """Judge ``figure`` against the mark of the boundaries before it (``floor``: this device's), then add
        it to the window."""
        lows = self.lows
        while lows and lows[0][0] < self.seen - settings.window:
            lows.popleft()
        if lows:
            mark = lows[0][1]
            self.threshold = math.ceil(max(floor, settings.fraction * mark) * self.scale)
            self.growth = figure - mark
            self.above = self.above + 1 if self.growth >= self.threshold else 0
        while lows and lows[-1][1] >= figure:
            lows.pop()
        lows.append((self.seen, figure))
        self.seen += 1

    def rebase(self, figure: int | None) -> None:
        self.lows.clear()
        self.above = 0
        if figure is not None:
            self.lows.append((self.seen - 1, figure))


class Trigger:
    """The low-water rise rule over a stream of per-device readings.

    For each device the *low-water mark* is the lowest figure of the last ``window`` boundaries (the
    current one not counted) since the last audit; the *threshold* is ``max(floor, fraction * mark)``
    times the device's back-off. When a figure is at least its threshold over its mark at
    ``boundaries`` boundaries in a row, :meth:`observe` returns a :class:`Request`. Every audit,
    whatever asked for it, re-bases every device on its last figure (:meth:`audited`); when an audit
    the trigger asked for found nothing new, the thresholds of the devices that fired are multiplied
    by ``backoff``, so a level that keeps rising for good reasons asks less and less often. Readings
    of ``{}`` (no figure) never ask for anything; a device may come and go.
    """

    def __init__(self, settings: TriggerSettings | None = None, floors: Mapping[str, int] | None = None) -> None:
        self.settings = settings if settings is not None else TriggerSettings()
        self._floors = dict(floors or {})  # a device's own floor, above the settings' (the resident set's)
        self._devices: dict[str, _Device] = {}
        self._last: Mapping[str, int] = {}
        self._asked: tuple[str, ...] | None = None  # the devices of the last request, until it is judged
        self._found = False
        self.requests = 0
        """Requests made so far (declined ones not counted)."""
        self.backoffs = 0
        """Requests whose audit found nothing new (each multiplied the thresholds of its devices)."""

    def observe(self, readings: Mapping[str, int]) -> Request | None:
        """This boundary's readings; a :class:`Request` when an audit is asked for here."""
        s = self.settings
        self._last = readings
        for name, figure in readings.items():
            device = self._devices.get(name)
            if device is None:
                device = self._devices[name] = _Device()
            device.push(figure, s, max(s.floor, self._floors.get(name, 0)))
        if self._asked is not None:
            self._close()
        fired = tuple(name for name in readings if self._devices[name].above >= s.boundaries)
        if not fired:
            return None
        self._asked, self._found = fired, False
        self.requests += 1
        return Request(
            fired,
            {d: self._devices[d].growth for d in fired},
            {d: self._devices[d].threshold for d in fired},
        )

    def audited(self, new: bool) -> None:
        """An audit ran at the boundary last observed. ``new``: it found a leak no earlier audit reported
        (a holder found again, repaired again or warned about again is not new)."""
        for name, device in self._devices.items():
            device.rebase(self._last.get(name))
        self._found = self._found or new

    def declined(self) -> None:
        """The request of the boundary last observed was not granted (the caller's time budget): no audit
        ran, so it is no reason to back off; the trigger asks again while the figure stays above."""
        if self._asked is not None:
            self._asked = None
            self.requests -= 1

    def thresholds(self) -> dict[str, int]:
        """Each device's threshold as of the last boundary it was read at (0 before its second)."""
        return {name: device.threshold for name, device in self._devices.items()}

    def _close(self) -> None:
        asked, self._asked = self._asked, None
        if self._found or asked is None:
            return
        self.backoffs += 1
        for name in asked:
            self._devices[name].scale *= self.settings.backoff
