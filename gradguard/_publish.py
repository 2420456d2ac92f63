"""The boundary itself: a value published into a store goes through the active mode here.

Guarded stores, the ``forward_step`` decorator and the engine adapters all call :func:`publish` (one
record) or :func:`publish_many` (a batch that is stored all or nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._policy import OFF, RAISE, Mode
from ._report import caller, count_clean, graph_seen
from ._tree import _detach_deep, _fast, _TooDeep, detach_counted, find_graphs

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
    count = [0]
    try:  # detach_counted, inlined: this is the hot path of every guarded append
        new = _fast(value, 0, count)
    except (_TooDeep, RecursionError):
        new = _detach_deep(value, count)
    if new is value:
        count_clean(store)
    else:
        graph_seen(store, mode, value, count[0], caller())
    return new if offload is None else offload(new)


def publish_many(store: str, mode: Mode, values: list[Any], offload: Offload | None = None) -> list[Any]:
    """:func:`publish` for a batch: in ``raise`` mode one offending value refuses the whole batch."""
    if mode == OFF:
        return values
    counts = [[0] for _ in values]
    news = [detach_counted(v, c) for v, c in zip(values, counts)]
    changed = [(v, c[0]) for v, n, c in zip(values, news, counts) if n is not v]
    if changed:
        where = caller()
        if mode == RAISE:  # refuse the whole batch before counting any of it
            for original, _ in changed:
                if find_graphs(original):
                    graph_seen(store, mode, original, 0, where)
        for original, n in changed:
            graph_seen(store, mode, original, n, where)
    if len(changed) < len(values):
        count_clean(store, len(values) - len(changed))
    return news if offload is None else [offload(n) for n in news]
