"""``gradguard.audit()``: every live autograd graph, who holds it, what it pins, and how to fix it.

At a step boundary no autograd graph should still be alive: every tensor carrying ``grad_fn`` that
Python can still reach names, through the path to it, what holds it. :func:`audit` lists them all,
the current step's own ``loss`` included (deciding what is a leak is the watch's business);
:func:`scan` is the same search for gradguard's own tools, with the live objects along each path.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any

import torch

from .._errors import GradGuardError
from .._graph import memory as _graph
from .._graph.liveness import Liveness
from .._heap.census import live_graph_tensors
from .._heap.hold import search_lock
from .._heap.holders import find_paths, running_thread
from .._heap.paths import Path, holder_key, spell
from .._policy.message import display, fix_lines, human, nodes_text, wrap
from .._policy.table import fitted
from .._tree.walk import graph_record
from .fix import fix
from .tuning import NODE_BYTES

__all__ = [
    "NODE_BYTES",
    "Finding",
    "Ignore",
    "Retention",
    "RetentionReport",
    "audit",
    "check_ignore",
    "scan",
    "scan_tensors",
]


@dataclasses.dataclass(frozen=True)
class Retention:
    """One holder of live autograd graphs: what :func:`gradguard.audit` reports.

    A record refers to no tensor and no object of the program: keeping it pins nothing.

    Attributes:
        path: One concrete path from a root to a tensor it holds, spelled as Python does:
            ``mypkg.train:HISTORY[3]['loss']`` (a module global), ``mypkg.train:Trainer.cache`` (a class
            attribute), ``train.py:42 in train_step: metrics['loss_sum']`` (a frame local, in any
            thread, or in a suspended generator or coroutine), ``closure of
            mypkg.train:make.<locals>.add: total``. Only what a module global, a thread's frame or a
            named root reaches is listed: garbage cycles are not.
        holder: The path with sequence indices as ``[*]`` and without a line number:
            ``mypkg.train:HISTORY[*]['loss']``. All the tensors reached through one holder are one entry.
        kind: What the path is named from: ``"global"`` (a module global), ``"local"`` (a frame local:
            of a thread, or of a suspended generator or coroutine), ``"cell"`` (a closure) or
            ``"named"`` (an object a framework names, such as a Ray actor's instance).
        grad_fn: The name of the ``grad_fn`` type of the tensor at ``path``.
        shape: That tensor's shape; ``None`` where it has no single shape.
        dtype: That tensor's dtype.
        device: That tensor's device.
        tensors: How many graph tensors this holder keeps.
        nodes: How many distinct autograd nodes their graphs have (a holder that accumulates,
            ``loss_sum += loss``, grows by nodes).
        pinned_bytes: What the graphs keep alive (the rules of :func:`gradguard.pinned_bytes`), each
            storage counted once across the whole report, for the holder that pins the most.
        fix: What to do about it, offered only where it applies: a change the user can make that
            releases the graph (checked: the suggested guard would detach this holder's value), or,
            for a graph held in a library's state, where to pass a detached value instead; else ``""``.
        thread: The name of the thread whose running frame holds it (``kind == "local"``, not a
            suspended generator's frame); ``None`` otherwise. Another thread in the middle of its
            forward is listed like any holder: telling its live graph from a leak is the caller's business.
        alive: Whether a backward through its graphs can still succeed: ``False`` once a backward freed
            them or a tensor they saved was modified in place (an optimizer step), so detaching them
            changes no gradient.
        node_bytes: What the graphs' own autograd nodes take, estimated at a fixed figure per node
            (``NODE_BYTES``) and counted once across the report: after a backward a kept loss pins no
            tensor, but its nodes stay (a ``loss_sum += loss`` grows by them every step).
    """

    path: str
    holder: str
    kind: str
    grad_fn: str
    shape: tuple[int | torch.SymInt, ...] | None
    dtype: torch.dtype
    device: torch.device
    tensors: int
    nodes: int
    pinned_bytes: int
    fix: str
    thread: str | None = None
    alive: bool = True
    node_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values.

        Returns:
            Every field by name: dtype and device as strings, shape as a list (or ``None``).
        """
        entry = dataclasses.asdict(self)
        entry.update(
            shape=None if self.shape is None else list(self.shape), dtype=str(self.dtype), device=str(self.device)
        )
        return entry


Ignore = str | Iterable[str] | Callable[[Retention], bool] | None


class RetentionReport(Sequence[Retention]):
    """What :func:`gradguard.audit` found: the :class:`Retention` entries, most pinned bytes first.

    ``len(report)``, iteration and indexing give the entries; ``print(report)`` shows a table.

    Args:
        entries: The holders found.
        untraced: Graph tensors alive that no root reaches (garbage cycles not collected yet, tensors
            only C++ code holds): they are not entries.
        frozen: How many objects ``gc.freeze()`` had frozen: Python's collector lists neither them nor
            what refers to them, so a graph held by a container made before the freeze is counted as
            untraced, not named.

    Attributes:
        untraced: As given.
        frozen: As given.
    """

    def __init__(self, entries: Iterable[Retention], untraced: int = 0, frozen: int = 0) -> None:
        self._entries = tuple(entries)
        self.untraced = untraced
        self.frozen = frozen

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Retention]:
        return iter(self._entries)

    def __getitem__(self, index: Any) -> Any:
        return self._entries[index]

    @property
    def pinned_bytes(self) -> int:
        """The entries' total pinned bytes (no storage counted twice)."""
        return sum(e.pinned_bytes for e in self._entries)

    @property
    def node_bytes(self) -> int:
        """The entries' total estimated bytes of autograd nodes."""
        return sum(e.node_bytes for e in self._entries)

    @property
    def tensors(self) -> int:
        """The graph tensors the entries keep, in all."""
        return sum(e.tensors for e in self._entries)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values.

        Returns:
            ``holders``, ``tensors``, ``pinned_bytes``, ``node_bytes``, ``untraced``, ``frozen``, and
            ``entries``: each entry's :meth:`Retention.to_dict`.
        """
        return {
            "holders": len(self._entries),
            "tensors": self.tensors,
            "pinned_bytes": self.pinned_bytes,
            "node_bytes": self.node_bytes,
            "untraced": self.untraced,
            "frozen": self.frozen,
            "entries": [e.to_dict() for e in self._entries],
        }

    def __str__(self) -> str:
        if not self._entries:
            return "gradguard.audit: no live autograd graph is held" + self._untraced_line()
        rows = [
            [
                display(e.path if e.tensors == 1 else e.holder),
                str(e.tensors),
                human(e.pinned_bytes),
                nodes_text(e.nodes, e.node_bytes),
                "yes" if e.alive else "no",
                e.grad_fn,
                "?" if e.shape is None else "x".join(map(str, e.shape)) or "scalar",
                str(e.dtype).removeprefix("torch."),
                str(e.device),
            ]
            for e in self._entries
        ]
        fixes = [fix_lines(e.fix, "  ") if e.fix else [] for e in self._entries]
        header = ["holder", "tensors", "pinned", "nodes", "backward", "grad_fn", "shape", "dtype", "device"]
        title = "\n".join(
            wrap(
                f"gradguard.audit: {len(self._entries)} holder(s) keep {self.tensors} tensor(s) carrying an autograd "
                f"graph, pinning ~{human(self.pinned_bytes)} of tensors and ~{human(self.node_bytes)} of graph nodes",
                "",
                "  ",
            )
        )
        return f"{title}\n{fitted(header, rows, fixes)}{self._untraced_line()}"

    def _untraced_line(self) -> str:
        if not self.untraced:
            return ""
        why = "garbage not collected yet, or held by C++ code"
        if self.frozen:
            why = (
                f"{why}, or by one of the {self.frozen:,} objects gc.freeze() froze, which the audit cannot "
                "search: call gc.unfreeze() before auditing"
            )
        said = f"({self.untraced} more graph tensor(s) alive that nothing Python can reach holds: {why})"
        return "\n" + "\n".join(wrap(said, "", " "))

    def __repr__(self) -> str:
        return (
            f"<RetentionReport: {len(self._entries)} holder(s), {self.tensors} tensor(s), {human(self.pinned_bytes)}, "
            f"~{human(self.node_bytes)} of nodes>"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Finding:
    """One holder, with the live objects behind it: what :func:`scan` returns to gradguard's tools.

    ``retention`` is the public record; ``key`` is ``retention.holder`` (stable from one step boundary
    to the next: no line numbers, sequence indices as ``[*]``). ``tensors`` are the live graph
    tensors and ``paths[i]`` the live path, root first, to ``tensors[i]``
    (``_paths.read(paths[i][-1]) is tensors[i]``). ``thread_id``: the ident of the thread whose
    running frame the example path starts in (``threading.get_ident()`` there), else ``None``. Drop
    findings as soon as they are used: they keep the tensors, their graphs and every owner on the
    paths alive.
    """

    retention: Retention
    key: str
    tensors: tuple[torch.Tensor, ...]
    paths: tuple[Path, ...]
    thread_id: int | None = None


# --------------------------------------------------------------------------------------------------
# ignore
# --------------------------------------------------------------------------------------------------


def check_ignore(ignore: Ignore) -> Callable[[Retention], bool] | None:
    """``ignore`` as a predicate (``None``: nothing ignored); :class:`GradGuardError` for anything else.

    A string or an iterable of strings: path prefixes, matched against both the concrete ``path`` and
    the ``holder`` of an entry. A callable: called with each :class:`Retention`, ignored when true.
    """
    if ignore is None:
        return None
    if isinstance(ignore, str):
        prefixes: tuple[str, ...] = (ignore,)
    elif callable(ignore):
        return ignore
    elif isinstance(ignore, (bytes, bytearray)) or not isinstance(ignore, Iterable) or isinstance(ignore, dict):
        raise GradGuardError(_bad_ignore(ignore))
    else:
        prefixes = tuple(ignore)
        bad = [p for p in prefixes if not isinstance(p, str) or not p]
        if bad:
            raise GradGuardError(_bad_ignore(ignore, f" (holds {bad[0]!r})"))
    if "" in prefixes:
        raise GradGuardError(_bad_ignore(ignore, " (an empty prefix ignores everything)"))

    def prefixed(entry: Retention) -> bool:
        return entry.path.startswith(prefixes) or entry.holder.startswith(prefixes)

    return prefixed


def _bad_ignore(ignore: Any, detail: str = "") -> str:
    shown = repr(ignore)
    shown = shown if len(shown) <= 80 else shown[:79] + "…"
    return (
        f"gradguard.audit: ignore={shown}{detail} is not accepted; pass a path prefix (a non-empty str, e.g. "
        "'mypkg.train:HISTORY'), an iterable of them, or a predicate called with each Retention "
        "(lambda r: r.holder.startswith('mypkg.')), or None"
    )


# --------------------------------------------------------------------------------------------------
# The scan
# --------------------------------------------------------------------------------------------------


def scan(ignore: Ignore = None, *, exclude_ids: Iterable[int] = ()) -> list[Finding]:
    """Every holder of a live autograd graph, with the live objects behind it, most pinned bytes first.

    ``ignore`` as in :func:`audit` (a predicate sees each holder's pinned bytes counted on its own);
    tensors and objects whose ids are in ``exclude_ids`` are not considered (a caller's own state).
    Never mutates anything, never unpacks a saved tensor. The findings keep what they name alive:
    see :class:`Finding`.
    """
    exclude = set(exclude_ids)
    with search_lock:
        tensors = live_graph_tensors(exclude)
        return scan_tensors(tensors, check_ignore(ignore), exclude)[0]


def audit(*, ignore: Ignore = None) -> RetentionReport:
    """Find every live tensor that carries ``grad_fn`` and who holds it.

    Looks at the whole process: module globals, class attributes, closure cells, the frames of
    every thread (a thread in the middle of a forward is listed too) and of suspended generators and
    coroutines. Never an ``nn.Parameter`` or a view of one (a tied weight), never a FakeTensor or
    another tensor torch.compile traces with, never gradguard's own objects or frames.

    The audit never mutates anything, never calls the program's code (no ``__iter__``, property or
    ``__getattr__`` of its objects, no frame's ``locals()`` snapshot written), never unpacks a saved
    tensor that has hooks, and keeps nothing alive once it returns: the report holds strings and
    numbers only.

    Args:
        ignore: Graphs kept on purpose (double backward, ``retain_graph=True``): path prefixes (a
            ``str``, or an iterable of ``str``, matched against an entry's ``path`` and ``holder``), or
            a predicate called with each :class:`Retention`, true for those to leave out; ``None``
            leaves nothing out.

    Returns:
        One :class:`Retention` per holder, the current step's own ``loss`` included (deciding what is
        a leak is the watch's business).

    Raises:
        GradGuardError: ``ignore`` is none of the accepted kinds (or holds an empty prefix), naming it.
    """
    keep_out = check_ignore(ignore)
    with search_lock:
        tensors = live_graph_tensors(set())
        findings, untraced = scan_tensors(tensors, keep_out, set())
        del tensors
    entries = [f.retention for f in findings]
    del findings
    return RetentionReport(entries, untraced, gc.get_freeze_count())


def scan_tensors(
    tensors: list[torch.Tensor],
    keep_out: Callable[[Retention], bool] | None,
    exclude: set[int],
    liveness: Liveness | None = None,
    known: dict[int, Path] | None = None,
    untraced_out: list[torch.Tensor] | None = None,
) -> tuple[list[Finding], int]:
    """:func:`scan` of the given graph tensors (``live_graph_tensors``' result): the findings, most
    pinned bytes first, and how many of the tensors no root reaches. Call it holding
    :data:`~gradguard._heap.hold.search_lock`; ``liveness``, when given, is the audit's (its held nodes
    are these tensors').
    ``known``: live paths already found for some of them (by id): the heap is searched only for the
    others, and not at all when there are none. ``untraced_out``, when given, receives the tensors no
    root reaches."""
    if not tensors:
        return [], 0
    known = known or {}
    unknown = [t for t in tensors if id(t) not in known]
    found = iter(find_paths(unknown, {id(tensors), id(unknown), *exclude}) if unknown else ())
    paths = [known[id(t)] if id(t) in known else next(found) for t in tensors]
    del unknown, found
    groups: dict[str, list[tuple[str, torch.Tensor, Path]]] = {}
    lost = []  # no root reaches them
    for t, path in zip(tensors, paths):
        if path is None:
            lost.append(t)
            continue
        groups.setdefault(holder_key(path), []).append((spell(path), t, path))
    del paths
    names = {t.ident: t.name for t in threading.enumerate()}
    liveness = liveness or Liveness({t.grad_fn for t in tensors})
    inside: set[int] = set()  # what the graphs found hold (saved tensors, leaves)
    drafts = []
    for key, members in groups.items():
        members.sort(key=lambda m: (len(m[0]), m[0]))  # the example: HISTORY[0] rather than HISTORY[17]
        example, group = members[0][2], tuple(m[1] for m in members)
        alone, nodes = _graph.graph_memory([t.grad_fn for t in group], set(), inside)
        thread = running_thread(example[0].owner) if example[0].kind == "local" else None
        name = None if thread is None else names.get(thread, str(thread))
        alive = any(liveness.state(t.grad_fn).alive for t in group)
        retention = _retention(key, members[0][0], example, group, nodes, alone, name, alive)
        if keep_out is not None and keep_out(retention):
            continue
        drafts.append((retention, group, tuple(m[2] for m in members), thread))
    del groups, liveness
    drafts.sort(key=lambda d: (-d[0].pinned_bytes, -d[0].tensors, d[0].holder))
    counted: set[Hashable] = set()
    findings = []
    for retention, group, group_paths, thread in drafts:
        shared, new_nodes = _graph.graph_memory([t.grad_fn for t in group], counted)  # each storage once, overall
        retention = dataclasses.replace(retention, pinned_bytes=shared, node_bytes=new_nodes * NODE_BYTES)
        findings.append(Finding(retention, retention.holder, group, group_paths, thread))
    findings.sort(key=lambda f: -(f.retention.pinned_bytes + f.retention.node_bytes))  # stable: ties keep the order
    # saved for backward by a graph found (torch keeps the Python object of a saved tensor): not lost
    untraced = [t for t in lost if id(t) not in inside]
    if untraced_out is not None:
        untraced_out.extend(untraced)
    return findings, len(untraced)


def _retention(
    key: str,
    example: str,
    path: Path,
    group: Sequence[torch.Tensor],
    nodes: int,
    pinned: int,
    thread: str | None,
    alive: bool,
) -> Retention:
    record = graph_record(group[0])
    return Retention(
        path=example,
        holder=key,
        kind=path[0].kind,
        grad_fn=record.grad_fn,
        shape=record.shape,
        dtype=record.dtype,
        device=record.device,
        tensors=len(group),
        nodes=nodes,
        pinned_bytes=pinned,
        fix=fix(path, group[0]),
        thread=thread,
        alive=alive,
        node_bytes=nodes * NODE_BYTES,
    )
