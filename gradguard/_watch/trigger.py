"""When memory says "audit now": the low-water rise rule over the per-boundary memory figures.

An audit searches the whole heap, so the watch cannot run one at every step boundary; a leak that
starts late would wait for the time-budget schedule. The bytes in use per device
(:class:`gradguard._watch.allocated.AllocatedReader`) cost a small fraction of an audit to read and grow
the moment a leak starts. :class:`Trigger` turns that stream of readings into audit requests. It is pure logic:
it reads no memory and no clock; the caller gives it each boundary's readings and each audit's
outcome.

The rule: low-water rise
    For each device, the *low-water mark* is the lowest figure of the last ``window`` boundaries
    (not counting the current one) since the last audit. The figure at a boundary is the level a
    training loop keeps across steps (parameters, gradients, optimizer state) plus whatever the
    current step still holds, so the mark finds the level and ignores the current step's transients.
    The *threshold* is ``max(floor, fraction * mark)``, times the device's back-off. When a device's
    figure is above its mark by more than its threshold at ``boundaries`` boundaries in a row, the
    trigger asks for an audit (reason ``"grew"``).

    A graph is a leak only once an audit finds it alive that an earlier audit already saw, and a
    graph a frame's variable holds only once it has survived two boundaries.
    So after a triggered audit the trigger asks for a confirming audit at the next boundary, and for
    a second at the one after while the figure is still rising (it exceeds the triggered boundary's
    by more than the threshold): a leak held by object state is reported one boundary after the
    triggered audit, one held by a variable two. Confirmations stop at the first audit that found
    something new.

    Every audit, whatever asked for it, re-bases all devices: the mark restarts from that boundary's
    figure, so a one-time step in the level (optimizer state made at the first step, a dataloader's
    prefetch filling up, a cache) costs at most one triggered audit and its confirmations, and the
    schedule's own audits keep the mark current. When a triggered audit and its confirmations found
    nothing new (a clean step in the level, or a leak already reported and kept, as in ``warn``
    mode), the threshold of each device that triggered is multiplied by ``backoff``: a leak that
    keeps growing is audited again only each time it has grown by twice as much as the last time,
    and a run whose figure is noisier than the threshold settles after a few doublings. The back-off
    is never undone within a watch.

Defaults (:class:`TriggerSettings`), and why
    The evidence is ``python -m benchmarks.trigger`` (``benchmarks/results/trigger-cpu.json``): the
    figure at each of 2000 boundaries of ``gradguard bench``'s three scenarios on CPU, each run in a
    fresh process, clean and with a leak of 256 KiB per step from step 500.

    ``floor=256 KiB``: glibc's in-use bytes rose at most about 100 KiB above their low-water mark in
    the clean runs. What moves them is cyclic garbage: each step leaves about 1.7 KiB that only
    the cyclic collector frees, every 40 steps or so, a sawtooth. The floor is 2.5 times that, and a
    leak of 256 KiB per step (plus its own objects) crosses it at its first boundary. ``fraction=
    1/1024``: what a step still holds at its boundary grows with the model and the batch, so the
    threshold grows with the level (on a GPU holding 60 GiB it is 60 MiB, under one micro-batch of
    the field's 45 MiB leak); on CPU it stays under the floor up to a level of 256 MiB.
    ``window=64``: a leak of ``floor / window`` = 4 KiB per step or more crosses the threshold within
    the window (a kept scalar loss, the field's smallest leak, keeps about 7 KiB per step), and
    slower drift never does (the clean runs drift by under 100 B per step; windows of 32, 64 and
    256 all gave no request on them). ``boundaries=2``: one boundary above the mark can be the
    current step's transient or garbage the collector has not freed yet; two still bring a leak of
    256 KiB per step that starts at step ``s`` to a request at ``s + 1`` (measured on all three
    scenarios), reported at ``s + 2`` when object state holds it and ``s + 3`` when a variable does.
    ``backoff=2``: a known leak costs audits logarithmic in its growth, and once the threshold
    exceeds what the leak adds over a window the trigger leaves it to the time-budget schedule (the
    persisting leak of the study: 8 episodes, 18 requests, none after its 150th leaking step).
    ``confirmations=2``: the two boundaries the leak criterion needs.

    :data:`RESIDENT_FLOOR` is the floor for the coarse CPU figure, the resident set (where glibc's
    ``mallinfo2`` cannot be used). It moves by whole mappings and by what glibc keeps or returns, up
    to 9 MiB above its low-water mark in the clean runs (a floor of 4 MiB asked for audits on two
    scenarios of three); 16 MiB leaves room, since on the platforms that need this fallback its
    noise was not measured. A leak of 256 KiB per step is then asked for 28 to 34 boundaries after
    it starts.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from typing import Literal

from .._errors import GradGuardError
from .._policy.message import human

__all__ = ["RESIDENT_FLOOR", "Request", "Trigger", "TriggerSettings"]

RESIDENT_FLOOR = 16 * 1024 * 1024
"""``floor`` for a CPU figure that is the resident set (``AllocatedReader.cpu_source == "statm"``)."""


def _positive_int(name: str, value: object, accepted: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GradGuardError(f"TriggerSettings({name}={value!r}) is not accepted; accepted: {accepted}")


@dataclasses.dataclass(frozen=True)
class TriggerSettings:
    """The low-water rise rule's settings (the rule and why these defaults: the guide's *Finding a leak*).

    ``floor``: the least growth over the low-water mark that counts, in bytes (a whole number ≥ 1).
    ``fraction``: the threshold's share of the mark (a number ≥ 0 and < 1); the threshold is
    ``max(floor, fraction * mark)``. ``window``: boundaries the mark looks back over (≥ 1).
    ``boundaries``: boundaries in a row above the threshold that ask for an audit (≥ 1).
    ``backoff``: the threshold's factor after a triggered audit that found nothing new (a number ≥ 1;
    1 turns back-off off). ``confirmations``: audits asked for after a triggered one (≥ 0). A bad
    value is a :class:`GradGuardError` naming it and what is accepted.
    """

    floor: int = 256 * 1024
    fraction: float = 1 / 1024
    window: int = 64
    boundaries: int = 2
    backoff: float = 2.0
    confirmations: int = 2

    def __post_init__(self) -> None:
        _positive_int("floor", self.floor, "a whole number of bytes >= 1")
        _positive_int("window", self.window, "a whole number of boundaries >= 1")
        _positive_int("boundaries", self.boundaries, "a whole number of boundaries >= 1")
        if isinstance(self.confirmations, bool) or not isinstance(self.confirmations, int) or self.confirmations < 0:
            raise GradGuardError(
                f"TriggerSettings(confirmations={self.confirmations!r}) is not accepted; accepted: a whole number >= 0"
            )
        if not _real(self.fraction) or not 0 <= self.fraction < 1:
            raise GradGuardError(
                f"TriggerSettings(fraction={self.fraction!r}) is not accepted; accepted: a number >= 0 and < 1"
            )
        if not _real(self.backoff) or self.backoff < 1:
            raise GradGuardError(
                f"TriggerSettings(backoff={self.backoff!r}) is not accepted; accepted: a number >= 1 (1: no back-off)"
            )


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Request:
    """An audit the trigger asks for at this boundary.

    ``reason``: ``"grew"`` (the rule fired) or ``"confirm"`` (a confirmation after a triggered
    audit). ``devices``: the devices whose figure was above its threshold (for ``"grew"``, those that
    fired; for ``"confirm"``, those that fired the episode). ``growth`` and ``threshold``: per device
    of ``devices``, the bytes above its low-water mark now and its threshold.
    """

    reason: Literal["grew", "confirm"]
    devices: tuple[str, ...]
    growth: Mapping[str, int]
    threshold: Mapping[str, int]

    def __str__(self) -> str:
        grown = ", ".join(
            f"{d} +{human(self.growth[d])} over its low-water mark (threshold {human(self.threshold[d])})"
            for d in self.devices
        )
        return f"memory grew: {grown}" if self.reason == "grew" else f"confirming the audit memory asked for ({grown})"


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

    def push(self, figure: int, settings: TriggerSettings) -> None:
        """Judge ``figure`` against the mark of the boundaries before it, then add it to the window."""
        lows = self.lows
        while lows and lows[0][0] < self.seen - settings.window:
            lows.popleft()
        if lows:
            mark = lows[0][1]
            self.threshold = math.ceil(max(settings.floor, settings.fraction * mark) * self.scale)
            self.growth = figure - mark
            self.above = self.above + 1 if self.growth > self.threshold else 0
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
    """The low-water rise rule over a stream of per-device readings (see the module documentation).

    At each step boundary call :meth:`observe` with that boundary's readings (``{"cpu": bytes,
    "cuda:0": bytes, ...}``; a device may come and go); it returns a :class:`Request` when the
    trigger asks for an audit at this boundary, else ``None``. After *every* audit at a boundary,
    whatever asked for it, call :meth:`audited` with whether it found something new. Readings of
    ``{}`` (no figure on this platform) never ask for anything.
    """

    def __init__(self, settings: TriggerSettings | None = None) -> None:
        self.settings = settings if settings is not None else TriggerSettings()
        self._devices: dict[str, _Device] = {}
        self._last: Mapping[str, int] = {}
        self._episode: _Episode | None = None
        self.requests = {"grew": 0, "confirm": 0}
        """How many requests of each reason so far."""
        self.backoffs = 0
        """How many episodes ended with nothing new found (each multiplied thresholds by ``backoff``)."""
        self._last_reason: Literal["grew", "confirm"] = "grew"

    def observe(self, readings: Mapping[str, int]) -> Request | None:
        """This boundary's readings; a :class:`Request` when an audit is asked for here."""
        s = self.settings
        self._last = readings
        for name, figure in readings.items():
            device = self._devices.get(name)
            if device is None:
                device = self._devices[name] = _Device()
            device.push(figure, s)
        episode = self._episode
        if episode is not None:
            if not episode.found and episode.confirmations < s.confirmations and self._rising(episode, readings):
                episode.confirmations += 1
                return self._request("confirm", episode.devices)
            self._close(episode)
        fired = tuple(name for name in readings if self._devices[name].above >= s.boundaries)
        if not fired:
            return None
        self._episode = _Episode(fired, {d: readings[d] for d in fired})
        return self._request("grew", fired)

    def audited(self, new: bool) -> None:
        """An audit ran at the boundary last observed. ``new``: it found a leak no earlier audit reported
        (a holder found again, repaired again or warned about again is not new)."""
        for name, device in self._devices.items():
            device.rebase(self._last.get(name))
        if self._episode is not None and new:
            self._episode.found = True

    def declined(self) -> None:
        """The request of the boundary last observed was not granted (the caller's time budget): no
        audit ran, so it is neither an episode nor a reason to back off; the trigger asks again at the
        next boundary that is still above its threshold."""
        self._episode = None
        if self.requests["grew"] or self.requests["confirm"]:
            last = "confirm" if self._last_reason == "confirm" else "grew"
            self.requests[last] -= 1

    def thresholds(self) -> dict[str, int]:
        """Each device's threshold as of the last boundary it was read at (0 before its second)."""
        return {name: device.threshold for name, device in self._devices.items()}

    # ---------------------------------------------------------------------------------------------

    def _rising(self, episode: _Episode, readings: Mapping[str, int]) -> bool:
        """Whether to confirm again: always the first time (the criterion needs a second audit), then
        while a device that fired is still rising, or not read at this boundary (unknown: confirm)."""
        if episode.confirmations == 0:
            return True
        return any(
            d not in readings or readings[d] - episode.figures[d] > self._devices[d].threshold for d in episode.devices
        )

    def _close(self, episode: _Episode) -> None:
        self._episode = None
        if episode.found:
            return
        self.backoffs += 1
        for name in episode.devices:
            self._devices[name].scale *= self.settings.backoff

    def _request(self, reason: Literal["grew", "confirm"], devices: tuple[str, ...]) -> Request:
        self.requests[reason] += 1
        self._last_reason = reason
        return Request(
            reason,
            devices,
            {d: self._devices[d].growth for d in devices},
            {d: self._devices[d].threshold for d in devices},
        )


@dataclasses.dataclass
class _Episode:
    """A triggered audit and its confirmations: who fired, their figures then, what was found."""

    devices: tuple[str, ...]
    figures: dict[str, int]
    confirmations: int = 0
    found: bool = False
