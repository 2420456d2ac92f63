"""The watch's records and its summary: one record per holder (:class:`HolderHistory`), one per watch
(:class:`WatchFigures`), and one renderer (:func:`summarize`) of the records of one watch or of several.

:meth:`gradguard.Watcher.summary` renders its own records; ``gradguard run`` and ``gradguard report``
render those the processes of a run wrote into their reports, read back into these types. Nothing here
imports torch: the launcher renders with it. What is said and why: the guide's *Finding a leak*.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Callable, Sequence

from .._policy import table as _table
from .._policy.message import display, fix_lines, human, nodes_text, plural, wrap
from .tuning import OLD

__all__ = ["BOUNDED", "NOTHING", "HolderHistory", "WatchFigures", "WatchRecord", "render", "summarize"]

BOUNDED = "bounded"
"""A holder's outcome when its graph was replaced at every step: listed, never acted on."""


@dataclasses.dataclass
class HolderHistory:
    """What the watch saw of one holder over the audits that found it.

    Attributes:
        holder: The grouping key (:attr:`Retention.holder`).
        path: The latest spelled path.
        fix: What to do about it.
        outcome: What the watch did the last time: ``"raised"``, ``"warned"``, ``"repaired"`` (its
            graphs were released: read back, the holder no longer reaches them), ``"repaired in
            part"``, ``"not repairable"`` (a dead graph held where gradguard may not write; ``why``
            says where), ``"live"`` (still usable for backward: reported, not repaired) or
            ``"bounded"`` (one step's graph, replaced at every step: listed, not acted on).
        tensors: Graph tensors it held at the latest audit.
        pinned_bytes: Bytes of tensors its graphs pinned then (see :class:`Retention`).
        survived: The most step boundaries one of its graphs had lived through.
        audits: How many audits found it.
        repaired: Tensors released in place, over all audits.
        nodes: Autograd nodes of its graphs at the latest audit.
        node_bytes: Their estimated bytes.
        alive: Whether its graphs could still be backwarded at the latest audit.
        why: Why it could not be repaired.
        found_at: The step boundary (of the watch, all threads) at which it was first found: leaking (a
            leak listed as bounded before counts from the boundary it was found leaking), or, for a bounded
            holder, keeping a graph for one boundary.
        released_bytes: Memory the repairs measurably gave back (the memory figure before and after a
            repair; 0 where nothing was measured: then ``pinned_bytes`` is the estimate).
        clock: ``"step"`` when it was found keeping graphs across optimizer steps, ``"micro"`` when found
            growing across the micro-batches of one step (``survived`` then counts micro-batch boundaries),
            ``"idle"`` when found growing while no backward ran and no optimizer stepped.
    """

    holder: str
    path: str
    fix: str
    outcome: str = ""
    tensors: int = 0
    pinned_bytes: int = 0
    survived: int = 0
    audits: int = 0
    repaired: int = 0
    nodes: int = 0
    node_bytes: int = 0
    alive: bool = False
    why: str = ""
    found_at: int = 0
    released_bytes: int = 0
    clock: str = "step"


@dataclasses.dataclass(frozen=True)
class WatchFigures:
    """What one watch did, for :func:`render`.

    Attributes:
        boundaries: Step boundaries counted.
        audits: Boundaries audited (a pass over the heap).
        searches: Audits that searched the heap for the holders of old graphs.
        seconds: Wall time the audits and the memory readings took.
        elapsed: Wall time since the first boundary (0: unknown).
        memory_audits: Audits asked for by the memory figure.
        stamped: Graph nodes stamped (at backwards and audits) to be followed in constant time.
        unexplained: Graphs older than two boundaries, alive at the last audit, that no holder was found for.
        memory: One clause on the memory figure (its growth and what explained it), or ``""``.
        unseen: Step boundaries since the previous one of which no backward was seen (an autograd
            engine bound before the watch started, ``torch.func``, gradients set by hand).
        failures: Backwards the watch failed to stamp (its listener raised).
        declined: Requests of the signals that waited for the back-off or the watch's share of the time.
        collecting: Requests of the old-graph signal that waited for the program's own collection (its
            collector disabled: an old graph may be garbage that only a collection frees).
        garbage: Requests of the old-graph signal whose graphs a collection freed: cyclic garbage, no
            holder's.
        since_audit: Step boundaries between the last audit and the end (the most of any thread): a
            graph no signal sees (kept below a backward's nearest nodes, saving no parameter) is found
            only by an audit.
        backwards: Micro-batch boundaries: backwards that returned in a thread whose boundaries the watch
            keeps (a thread that steps, or runs backwards alone).
        micro_searches: Heap searches the micro-batch clock asked for.
    """

    boundaries: int
    audits: int
    searches: int = 0
    seconds: float = 0.0
    elapsed: float = 0.0
    memory_audits: int = 0
    stamped: int = 0
    unexplained: int = 0
    memory: str = ""
    unseen: int = 0
    failures: int = 0
    declined: int = 0
    collecting: int = 0
    garbage: int = 0
    since_audit: int = 0
    backwards: int = 0
    micro_searches: int = 0

    def __add__(self, other: WatchFigures) -> WatchFigures:
        """Both watches' figures added up (the programs one process ran, the processes of a run); the memory
        clause is ``other``'s, else this one's; ``since_audit`` is the larger."""
        return WatchFigures(
            **{
                f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in dataclasses.fields(self)
                if f.name not in ("memory", "since_audit")
            },
            memory=other.memory or self.memory,
            since_audit=max(self.since_audit, other.since_audit),
        )


@dataclasses.dataclass(frozen=True)
class WatchRecord:
    """What one watch did and found: one part of what :func:`summarize` renders.

    Attributes:
        figures: What it did.
        holders: Every holder it found, the bounded ones too (their ``outcome`` says which).
        name: How a summary of several watches names it (a process: ``rank 1/2``, ``pid 4242``); ``""``
            for a watch summarised on its own.
    """

    figures: WatchFigures
    holders: Sequence[HolderHistory] = ()
    name: str = ""


def render(
    figures: WatchFigures,
    history: Sequence[HolderHistory],
    bounded: Sequence[HolderHistory] = (),
    title: str = "gradguard watch",
) -> str:
    """The summary of one watch (:meth:`gradguard.Watcher.summary`).

    Args:
        figures: What it did.
        history: The holders it found leaking.
        bounded: The holders it found keeping one step's graph, replaced at every step.
        title: What the summary's first line starts with.

    Returns:
        :func:`summarize` of that one watch.
    """
    return summarize([WatchRecord(figures, (*history, *bounded))], title=title)


@dataclasses.dataclass
class _Row:
    """One holder across the watches that found it: ``found`` is ``(watch index, its record)`` each."""

    holder: str
    found: list[tuple[int, HolderHistory]]

    @property
    def bounded(self) -> bool:
        return all(h.outcome == BOUNDED for _, h in self.found)

    @property
    def name(self) -> str:
        return display(self.found[0][1].path if len(self.found) == 1 else self.holder)

    def most(self, field: str) -> int:
        return max(getattr(h, field) for _, h in self.found)

    def total(self, field: str) -> int:
        return sum(getattr(h, field) for _, h in self.found)

    def survived(self) -> str:
        """The steps its graphs survived; for a holder found growing within a step, that and the micro-batches."""
        micro = [h.survived for _, h in self.found if h.clock == "micro"]
        steps = max((h.survived for _, h in self.found if h.clock != "micro"), default=0)
        return f"{steps} ({max(micro)} micro-batches)" if micro else str(steps)

    def outcome(self) -> str:
        text = ", ".join(sorted({h.outcome for _, h in self.found}))
        released = self.total("released_bytes")
        return f"{text} ({human(released)} back)" if released else text


NOTHING = "nothing was checked"
"""What a summary says when no audit ran."""


def summarize(
    watches: Sequence[WatchRecord],
    *,
    title: str = "gradguard watch",
    who: Callable[[Sequence[int]], str] | None = None,
    nothing: str = NOTHING,
) -> str:
    """The summary of one watch, or of several (the processes of one run): what was checked, what was found,
    and a table of the leaking holders.

    It says plainly when nothing was checked, how much of the run an all-clear covers, and what is not
    explained (old graphs no holder was found for, memory growth no holder accounts for, a watch that
    stepped but never audited); it never says all is clear while one of these remains. Several watches,
    or one with a name, are named: the head counts them, and each holder's row says which found it.

    Args:
        watches: The records of each watch.
        title: What the first line starts with.
        who: The text naming the watches of the given indices in a holder's row (``ranks 0-3 of 4``);
            by default their names, joined.
        nothing: What is said when no audit ran (a run whose guarded stores checked records says that no
            step boundary was).

    Returns:
        Lines within :data:`~gradguard._policy.message.WIDTH` columns where their content allows: the head
        (what was checked), then each finding and each thing not covered on a line of its own (indented, a
        long one wrapped), then, when holders kept graphs, their table with each one's fix under its row.
    """
    several = len(watches) > 1 or any(w.name for w in watches)
    f = functools.reduce(operator.add, [w.figures for w in watches])
    where = f" in {plural(len(watches), 'process')}" if several else ""
    idle = not f.boundaries and not f.backwards
    if idle and not f.audits:
        return _lines(f"{title}: no optimizer step and no backward was seen{where}: {nothing}")
    where = f",{where}" if where else ""
    since = "their time since the first" if len(watches) > 1 else "the time since the first"
    share = f" ({100 * f.seconds / f.elapsed:.2f}% of {since})" if f.elapsed > 0 and f.seconds and f.audits else ""
    asked = f", {f.memory_audits} of them for memory growth" if f.memory_audits else ""
    steps = plural(f.boundaries, "step boundary") if f.boundaries else "no optimizer step"
    micro = f" ({plural(f.backwards, 'backward')})" if f.backwards else ""
    head = f"{title}: {steps}{micro}, {f.audits} audited{asked}{where}{share}"
    if idle:
        looks = plural(f.audits, "look")
        head = f"{title}: no optimizer step and no backward, {looks} when the memory grew{where}{share}"
    memory = [_memory(watches)] if _memory(watches) else []
    if not f.audits:
        return _lines(f"{head}: no audit ran, {nothing}", *memory)
    rows = _rows(watches)
    leaks = [row for row in rows if not row.bounded]
    unaudited = [w.name for w in watches if several and w.figures.boundaries and not w.figures.audits]
    tail = [
        *_unexplained(watches, several),
        *_coverage(f),
        *_bounded([row for row in rows if row.bounded]),
        *memory,
        *([f"not audited, so not checked: {', '.join(unaudited)}"] if unaudited else []),
    ]
    if not leaks and idle:
        return _lines(head, "no holder's graphs grew from one look to the next", *tail)
    if not leaks:
        followed = f" ({plural(f.stamped, 'graph node')} followed)" if f.stamped else ""
        if f.unexplained:
            return _lines(head, f"no holder was found keeping a graph{followed}", *tail)
        if f.garbage:
            return _lines(
                head,
                f"no holder kept a graph the watch followed past two step boundaries{followed}: the old ones were "
                f"cyclic garbage, freed by the collector ({plural(f.garbage, 'time')})",
                *tail,
            )
        return _lines(head, f"no graph the watch followed outlived two step boundaries{followed}", *tail)
    released = sum(row.total("released_bytes") for row in leaks)
    if released:
        tail.insert(0, f"the repairs gave back {human(released)} of memory (measured)")
    total = sum(row.total("pinned_bytes") for row in leaks)
    nodes = sum(row.total("node_bytes") for row in leaks)
    found_in = {i for row in leaks for i, _ in row.found}
    in_processes = f" in {plural(len(found_in), 'process')}" if several else ""
    clocks = {h.clock for row in leaks for _, h in row.found}
    across = {
        frozenset({"step"}): "across step boundaries",
        frozenset({"micro"}): "across the micro-batches of a step",
        frozenset({"idle"}): "that grew while no backward ran and no optimizer stepped",
    }.get(frozenset(clocks), "across micro-batches and step boundaries")
    verdict = (
        f"{plural(len(leaks), 'holder')} kept autograd graphs {across}{in_processes} "
        f"({human(total)} of tensors and ~{human(nodes)} of graph nodes pinned at their last audit)"
    )
    return f"{_lines(head, verdict, *tail)}\n{_table_of(leaks, watches, several, who)}"


def _lines(head: str, *clauses: str) -> str:
    """The head, then each clause on a line of its own, indented; each wrapped within the width."""
    lines = wrap(head, "", "  ")
    for clause in clauses:
        lines += wrap(clause, "  ", "    ")
    return "\n".join(lines)


def _table_of(
    rows: Sequence[_Row], watches: Sequence[WatchRecord], several: bool, who: Callable[[Sequence[int]], str] | None
) -> str:
    fixes = [fix_lines(row.found[0][1].fix, "  ") for row in rows]
    if not several:
        header: tuple[str, ...] = ("holder", "tensors", "pinned", "nodes", "steps survived", "outcome")
        body: list[tuple[str, ...]] = [
            (row.name, str(row.most("tensors")), human(row.total("pinned_bytes")), _nodes(row),
             row.survived(), row.outcome())
            for row in rows
        ]  # fmt: skip
        return _table.fitted(header, body, fixes)
    if who is None:
        names = [w.name for w in watches]

        def who(indices: Sequence[int]) -> str:
            return ", ".join(names[i] for i in indices)

    header = ("holder", "processes", "tensors", "pinned (max)", "pinned (sum)", "nodes", "steps survived",
              "outcome")  # fmt: skip
    body = [
        (row.name, who([i for i, _ in row.found]), str(row.most("tensors")), human(row.most("pinned_bytes")),
         human(row.total("pinned_bytes")), _nodes(row), row.survived(), row.outcome())
        for row in rows
    ]  # fmt: skip
    return _table.fitted(header, body, fixes)


def _nodes(row: _Row) -> str:
    return nodes_text(row.most("nodes"), row.most("node_bytes"))


def _rows(watches: Sequence[WatchRecord]) -> list[_Row]:
    """The holders, each once across the watches, most pinned bytes first."""
    rows: dict[str, _Row] = {}
    for i, w in enumerate(watches):
        for h in w.holders:
            rows.setdefault(h.holder, _Row(h.holder, [])).found.append((i, h))
    return sorted(rows.values(), key=lambda row: (-row.total("pinned_bytes"), row.holder))


def _memory(watches: Sequence[WatchRecord]) -> str:
    """What the memory figures did: each watch's clause, named when several said different things."""
    said = [(w.name, w.figures.memory) for w in watches if w.figures.memory]
    if len({text for _, text in said}) <= 1:
        return said[0][1] if said else ""
    return "; ".join(f"in {name}: {text}" if name else text for name, text in said)


def _unexplained(watches: Sequence[WatchRecord], several: bool) -> list[str]:
    count = sum(w.figures.unexplained for w in watches)
    if not count:
        return []
    where = ""
    if several:
        where = " in " + ", ".join(w.name for w in watches if w.figures.unexplained)
    return [
        f"NOT EXPLAINED{where}: {plural(count, 'graph')} older than two step boundaries "
        f"{'was' if count == 1 else 'were'} alive at the last audit that no holder was found for (garbage "
        "not collected yet, a graph node held directly, or C++ code)"
    ]


def _coverage(f: WatchFigures) -> list[str]:
    """What the watch's checks did not cover: each clause only where it applies, with its figure."""
    said = []
    if f.unseen:
        said.append(
            f"{plural(f.unseen, 'step boundary')} of {f.boundaries} saw no backward (an autograd engine bound before "
            "the watch started, torch.func, gradients set by hand): their graphs were looked for by audits only"
        )
    if f.failures:
        said.append(f"{plural(f.failures, 'backward')} could not be followed (the gradguard logger says why at DEBUG)")
    if f.declined:
        said.append(
            f"{plural(f.declined, 'check')} the watch asked for waited for its share of the time (a leak that "
            "started meanwhile may be reported late)"
        )
    if f.collecting:
        said.append(
            f"{plural(f.collecting, 'check')} for old graphs waited for the program's own collection "
            "(the collector is disabled: a leak that started meanwhile is reported after the next one)"
        )
    if f.since_audit >= OLD:
        said.append(
            "a graph kept below a backward's nearest nodes, or saving no parameter, is found by an audit only: the "
            f"last ran {plural(f.since_audit, 'step boundary')} before the end"
        )
    return [f"not covered: {text}" for text in said]


def _bounded(rows: Sequence[_Row]) -> list[str]:
    if not rows:
        return []
    shown = ", ".join(f"{row.name} ({human(row.most('pinned_bytes') + row.most('node_bytes'))})" for row in rows[:3])
    more = f" and {len(rows) - 3} more" if len(rows) > 3 else ""
    return [f"bounded, not acted on (one step's graph, replaced every step): {shown}{more}"]
