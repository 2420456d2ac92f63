"""The boundary itself: a value published into a store goes through the active mode here.

Guarded stores, the ``forward_step`` decorator and the engine adapters all call :func:`publish` (one
record) or :func:`publish_many` (a batch that is stored all or nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._policy import OFF, RAISE, Mode
from ._report import caller, count_clean, report_graphs
from ._tree import _iter_tensors, _record, detach_tree

__all__ = ["publish", "publish_many"]

Offload = Callable[[Any], Any]


def publish(store: str, mode: Mode, value: Any, offload: Offload | None = None) -> Any:
    """Return what ``store`` should hold for ``value`` under ``mode``.

    ``off`` returns ``value`` itself. Otherwise the value is detached lazily; a value that carried a
    graph is accounted to its call site and warned about (``warn``) or refused with
    :class:`GraphRetentionError` (``raise``, before anything is counted or stored).
    """
    if mode == OFF:
        return value
    new = detach_tree(value)
    if new is value:
        count_clean(store)
    else:
        _settle(store, mode, [(value, new)])
    return new if offload is None else offload(new)


def publish_many(store: str, mode: Mode, values: list[Any], offload: Offload | None = None) -> list[Any]:
    """:func:`publish` for a batch: in ``raise`` mode one offending value refuses the whole batch."""
    if mode == OFF:
        return values
    news = [detach_tree(v) for v in values]
    changed = [(v, n) for v, n in zip(values, news) if n is not v]
    clean = len(values) - len(changed)
    if changed:
        _settle(store, mode, changed)
    if clean:
        count_clean(store, clean)
    return news if offload is None else [offload(n) for n in news]


def _settle(store: str, mode: Mode, changed: list[tuple[Any, Any]]) -> None:
    where = caller()
    inspected = []
    for original, _ in changed:
        requiring = [(p, t) for p, t in _iter_tensors(original) if t.requires_grad]
        graphs = [_record(t, p) for p, t in requiring if t.grad_fn is not None]
        inspected.append((original, graphs, len(requiring)))
    if mode == RAISE:  # refuse before counting anything
        for original, graphs, n in inspected:
            if graphs:
                report_graphs(store, mode, original, graphs, n, where)
    for original, graphs, n in inspected:
        if graphs:  # may raise (a warning an "error" filter turns into an exception): count nothing else
            report_graphs(store, mode, original, graphs, n, where)
    leaves_only = sum(1 for _, graphs, _ in inspected if not graphs)
    if leaves_only:
        count_clean(store, leaves_only)  # only graph-less leaves that require grad were detached
