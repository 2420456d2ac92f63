"""Every tuned number of the watch, in one table: what each trades off, and where it was measured.

The modules that use a number import it from here; ``docs/how-it-works.md`` (*The tuned numbers*) shows
this table, and ``tests/watch/test_tuning.py`` keeps the two equal. A number that is a definition (the
size of a ``struct``, a format's version) is not here; one that trades cost against what is seen is.
"""

from __future__ import annotations

__all__ = [
    "BACKSTOP_SHARE",
    "CAPPED",
    "COLLECT_SHARE",
    "COSTS_KEPT",
    "CUDA_RESCAN",
    "DEEP_NODES",
    "DEEP_SHARE",
    "FOLLOW",
    "GAP_CAP",
    "HUNTING_BACKSTOP_SHARE",
    "HUNTING_FIRST",
    "IDLE_FREE",
    "IDLE_PERIOD",
    "KEPT_BOUNDARIES",
    "MEMORY_FIRST",
    "MICRO_FREE",
    "MOST",
    "NODE_BYTES",
    "OLD",
    "OPTIMIZER_RESCAN",
    "PARAMETER_SAMPLE",
    "QUIET",
    "READ_SHARE",
    "RESIDENT_FLOOR",
    "SHARE",
    "STARTUP",
    "STEP_FREE",
    "TABLE",
    "TIMELINE_FIRST",
    "TIMELINE_KEYS",
    "TIMELINE_TEXT",
    "TRIGGER_BACKOFF",
    "TRIGGER_BOUNDARIES",
    "TRIGGER_FLOOR",
    "TRIGGER_FRACTION",
    "TRIGGER_WINDOW",
]

# --- the budget: one share of the wall time, and the parts of it ------------------------------------

SHARE = 0.01
"""The most of the wall time the watch's work may take after the start-up check, everything included."""

BACKSTOP_SHARE = SHARE / 10
"""The part of :data:`SHARE` the audits no signal asked for may take (graphs no signal sees)."""

COLLECT_SHARE = SHARE / 4
"""The part of :data:`SHARE` the watch's own collections of the young generations may take."""

READ_SHARE = 0.0005
"""The part of :data:`SHARE` the memory readings may take."""

DEEP_SHARE = 0.002
"""The part of :data:`SHARE` stamping the nodes below a backward's roots may take."""

HUNTING_BACKSTOP_SHARE = 0.1
"""With ``every=N``: the most of the wall time the backstop's audits may take (hunting pays to see more)."""

# --- the step clock ------------------------------------------------------------------------------------

STARTUP = 2
"""Step boundaries of a thread (and after each entry of a watch) audited whatever the signals say; the
backwards of the steps up to the last of them are stamped below their roots whatever it costs."""

OLD = 3
"""Step boundaries back a stamp alive asks for an audit: it lived through two (with ``every=N``, one less:
a list's second record asks). The summary says an audit was long ago past as many."""

STEP_FREE = 1
"""Requests of a step signal served at once while they find nothing new."""

CAPPED = 64
"""The longest ``deque`` (its ``maxlen``) on a holder's path that makes the holder bounded by construction:
a longer one grows for that many boundaries, and is judged as any store."""

MEMORY_FIRST = 4
"""Times its threshold the memory figure must grow before its request is served at once."""

QUIET = 8
"""Boundaries without a request after which a signal's back-off is forgotten."""

HUNTING_FIRST = 3
"""With ``every=N``: times the start-up check's cost that go by before the backstop's first audit."""

GAP_CAP = 1024
"""The most boundaries (of either clock) between two requests of a signal that keeps finding nothing new."""

KEPT_BOUNDARIES = 4096
"""Step boundaries remembered per optimizer: a graph's survival is counted up to there."""


PARAMETER_SAMPLE = 4
"""Parameters whose reference count is read at each step boundary, in turn."""

OPTIMIZER_RESCAN = 30.0
"""Seconds between two looks for live optimizers in the heap (at an audit)."""

# --- the micro-batch clock -----------------------------------------------------------------------------

MICRO_FREE = 2
"""Searches of the micro-batch signal served at once while they find nothing to follow (the previous
micro-batch's record may still be named by a local the program rebinds after its backward)."""

FOLLOW = 16
"""Micro-batch boundaries a holder is read by name without growing before it is no longer followed."""

IDLE_FREE = 2
"""Idle looks that see graphs served at once, the first growth's two sides; the others within :data:`SHARE`."""

IDLE_PERIOD = 0.02
"""Seconds between two readings of the memory figure of a program that has run no backward and stepped no
optimizer yet (a look follows only when the figure grew)."""

# --- stamps --------------------------------------------------------------------------------------------


DEEP_NODES = 32
"""Nodes stamped below a backward's roots, nearest first (the whole graph with ``every=N``)."""

MOST = 16
"""Holders followed by name by the step clock; the least recently found is forgotten first."""

# --- the memory figure and its rule ----------------------------------------------------------------------

TRIGGER_FLOOR = 256 * 1024
"""The least growth over the low-water mark that asks for an audit, in bytes."""

TRIGGER_FRACTION = 1 / 1024
"""The threshold's share of the low-water mark (a big process's transient is big)."""

TRIGGER_WINDOW = 64
"""Boundaries the low-water mark looks back over."""

TRIGGER_BOUNDARIES = 2
"""Boundaries in a row above the threshold that ask for an audit."""

TRIGGER_BACKOFF = 2.0
"""The threshold's factor after a memory audit that found nothing new."""

RESIDENT_FLOOR = 16 * 1024 * 1024
"""The default floor where the CPU figure is the resident set (it moves by whole mappings)."""

CUDA_RESCAN = 64
"""Memory readings between two scans of every CUDA device for one first used since."""

COSTS_KEPT = 3
"""Readings whose cheapest cost rations the next (one preempted reading does not stall the ration)."""

NODE_BYTES = 700
"""Estimated bytes of one autograd node a kept graph pins."""

# --- the timeline ----------------------------------------------------------------------------------------

TIMELINE_FIRST = 8
"""Events kept per holder and kind (the latest one is kept besides)."""

TIMELINE_KEYS = 256
"""(holder, kind) pairs with events of their own; the others are only counted."""

TIMELINE_TEXT = 400
"""Characters of an event's text kept."""

TABLE: dict[str, tuple[float, str]] = {
    "SHARE": (SHARE, "leaks found later on fast steps vs the watch's cost; benchmarks/watch"),
    "BACKSTOP_SHARE": (BACKSTOP_SHARE, "graphs no signal sees found later vs audits on clean runs; benchmarks/watch"),
    "COLLECT_SHARE": (COLLECT_SHARE, "cyclic-garbage storms vs collections; benchmarks/watch (kept exception, cycles)"),
    "READ_SHARE": (READ_SHARE, "memory readings skipped on fast steps vs their cost; benchmarks/watch"),
    "DEEP_SHARE": (DEEP_SHARE, "records below the loss seen later vs stamping cost; benchmarks/watch"),
    "HUNTING_BACKSTOP_SHARE": (HUNTING_BACKSTOP_SHARE, "every=N: torch.func graphs found vs audits; tests"),
    "STARTUP": (STARTUP, "a first-step leak of any shape judged by boundary 3 vs two audits a run"),
    "OLD": (OLD, "the criterion's two boundaries lived through, read in constant time"),
    "CAPPED": (CAPPED, "a window kept on purpose (32 losses, tests/watch/corpus) vs a deque(maxlen=1000) of graphs"),
    "STEP_FREE": (STEP_FREE, "a signal's first request at once vs storms; benchmarks/watch (storms)"),
    "MEMORY_FIRST": (MEMORY_FIRST, "a big leak seen early vs a replay buffer's audits; benchmarks/trigger"),
    "QUIET": (QUIET, "a later leak not delayed by an early stray request vs storms; benchmarks/watch"),
    "HUNTING_FIRST": (HUNTING_FIRST, "every=N: a short run gets a backstop audit vs its cost"),
    "GAP_CAP": (GAP_CAP, "the longest wait of a signal that keeps finding nothing"),
    "KEPT_BOUNDARIES": (KEPT_BOUNDARIES, "survival counted far back vs memory per optimizer"),
    "PARAMETER_SAMPLE": (PARAMETER_SAMPLE, "parameters read per boundary vs the boundary's cost; benchmarks/watch"),
    "OPTIMIZER_RESCAN": (OPTIMIZER_RESCAN, "optimizers made before the watch found vs census passes"),
    "MICRO_FREE": (MICRO_FREE, "the seed's store found in its first step vs searches on clean programs"),
    "FOLLOW": (FOLLOW, "a slow store judged vs reads of a GPipe list; tests/watch/test_microbatch.py"),
    "IDLE_FREE": (IDLE_FREE, "a short loop judged from its first two looks vs their cost"),
    "IDLE_PERIOD": (IDLE_PERIOD, "a short evaluation loop looked at twice vs a thread's wake-ups"),
    "DEEP_NODES": (DEEP_NODES, "how far below the loss a record is seen vs stamping cost"),
    "MOST": (MOST, "holders read by name vs the memory of their recipes"),
    "TRIGGER_FLOOR": (
        TRIGGER_FLOOR,
        "a 256 KiB-a-step leak at its first boundary vs clean runs' noise; benchmarks/trigger",
    ),
    "TRIGGER_FRACTION": (TRIGGER_FRACTION, "the threshold grows with the level; benchmarks/trigger"),
    "TRIGGER_WINDOW": (TRIGGER_WINDOW, "a 4 KiB-a-step leak crosses it vs slow drift; benchmarks/trigger"),
    "TRIGGER_BOUNDARIES": (TRIGGER_BOUNDARIES, "a step's transient vs one boundary later; benchmarks/trigger"),
    "TRIGGER_BACKOFF": (TRIGGER_BACKOFF, "a known leak's audits logarithmic in its growth"),
    "RESIDENT_FLOOR": (RESIDENT_FLOOR, "the resident set's noise in clean runs (up to 9 MiB); benchmarks/trigger"),
    "CUDA_RESCAN": (CUDA_RESCAN, "a device first used late is read vs scanning every device"),
    "COSTS_KEPT": (COSTS_KEPT, "one preempted reading does not stall the ration"),
    "NODE_BYTES": (NODE_BYTES, "640-780 B a node measured; benchmarks/results/audit-cpu.md"),
    "TIMELINE_FIRST": (TIMELINE_FIRST, "a holder's first events shown vs the report's size"),
    "TIMELINE_KEYS": (TIMELINE_KEYS, "holders with events of their own vs the report's size (at most 1 MB)"),
    "TIMELINE_TEXT": (TIMELINE_TEXT, "an event's text vs the report's size"),
}
"""Each tuned number by name: its value, and what it trades off (where it was measured)."""
