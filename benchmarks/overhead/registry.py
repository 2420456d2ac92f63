"""What a case is and how cases are registered in groups: the benchmark's vocabulary, apart from the
cases themselves (:mod:`benchmarks.overhead.cases`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DECIDE",
    "DELTA_US",
    "GROUPS",
    "INFO",
    "KINDS",
    "RATIO",
    "SHARE",
    "Builder",
    "Case",
    "Group",
    "Share",
    "StepTime",
    "Unavailable",
    "group",
    "select",
]

RATIO = "ratio"
DELTA_US = "delta_us"
SHARE = "share"
DECIDE = "decide"
INFO = "info"
KINDS = (RATIO, DELTA_US, SHARE, DECIDE, INFO)


class Unavailable(Exception):
    """Raised by a group's setup when a dependency is missing; the reason is reported, the run goes on."""


@dataclass(frozen=True)
class StepTime:
    """A ``gradguard bench`` scenario's guarded micro-batch steps, timed without the memory meter."""

    scenario: str
    micro_batches: int
    median_s: float
    best_s: float
    publishes_per_microbatch: float  # what gradguard.stats() counted, over the micro-batches


@dataclass(frozen=True)
class Share:
    """What a ``share`` case relates its per-call cost to: ``calls_per_microbatch`` calls in each step of
    ``scenario``, measured by ``step(micro_batches)``."""

    scenario: str
    calls_per_microbatch: int
    step: Callable[[int], StepTime]


@dataclass
class Case:
    """One comparison: ``candidate(arg)`` against ``baseline(arg)``.

    ``reset`` runs before every timed batch, outside the timed region; ``check`` runs once before
    timing and raises when the two sides do not compute the same thing.
    """

    name: str
    kind: str
    candidate: Callable[[Any], Any]
    baseline: Callable[[Any], Any]
    candidate_label: str
    baseline_label: str
    arg: Any = None
    target: float | None = None
    reset: Callable[[], None] | None = None
    check: Callable[[], None] | None = None
    share: Share | None = None
    group: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"case {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if (self.kind == INFO) != (self.target is None):
            need = "has no" if self.kind == INFO else "needs a"
            raise ValueError(f"case {self.name!r}: an {self.kind} case {need} target")
        if (self.kind == SHARE) != (self.share is not None):
            raise ValueError(f"case {self.name!r}: a share needs a Share, and only a share has one")


Builder = Callable[[frozenset[str]], AbstractContextManager[list[Case]]]


@dataclass(frozen=True)
class Group:
    """Cases that share a setup: their names, known before anything is built, and the builder
    (``build(selected)``: a context manager that sets up, yields the selected cases, and tears down)."""

    title: str
    names: tuple[str, ...]
    build: Builder

    @contextmanager
    def setup(self, selected: frozenset[str]) -> Iterator[list[Case]]:
        """:attr:`build` of ``selected``, checked: only names of this group, and exactly those built."""
        unknown = selected - set(self.names)
        if unknown:
            raise ValueError(f"group {self.title!r} has no case {sorted(unknown)}")
        with self.build(selected) as built:
            names = [c.name for c in built]
            if sorted(names) != sorted(selected):
                raise RuntimeError(f"group {self.title!r} built {names}, expected {sorted(selected)}")
            for c in built:
                c.group = self.title
            yield built


GROUPS: list[Group] = []


def group(title: str, *names: str) -> Callable[[Callable[[frozenset[str]], Iterator[list[Case]]]], Builder]:
    """Register a generator ``fn(selected_names)`` that sets up, yields the selected cases, and tears down."""

    def register(fn: Callable[[frozenset[str]], Iterator[list[Case]]]) -> Builder:
        build = contextmanager(fn)
        GROUPS.append(Group(title, names, build))
        return build

    return register


def select(only: Sequence[str] | None, groups: Sequence[Group] | None = None) -> list[tuple[Group, frozenset[str]]]:
    """The groups and case names matching any of ``only`` (case-insensitive substrings of a case's name
    or its group's title; ``None``: every case), in registry order. Nothing is built."""
    chosen = []
    for g in GROUPS if groups is None else groups:
        if only is None:
            names = frozenset(g.names)
        else:
            words = [w.lower() for w in only]
            names = frozenset(n for n in g.names if any(w in n.lower() or w in g.title.lower() for w in words))
        if names:
            chosen.append((g, names))
    return chosen
