"""The boundary itself: a value published into a store goes through the active mode here.

Guarded stores, the ``forward_step`` decorator and the engine adapters all call :func:`publish` (one
record) or :func:`publish_many` (a batch that is stored all or nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._policy import OFF, RAISE, Mode, resolve
from ._report import count_clean, graph_seen
from ._tree import _detach_deep, _fast, _TooDeep, detach_counted, find_graphs

__all__ = ["publish", "publish_into", "publish_many"]

Offload = Callable[[Any], Any]


def publish_into(
    append: Callable[[Any], Any] | None,
    store: str,
    mode: Mode | None,
    offload: Offload | None,
    value: Any,
    skip: int = 0,
) -> Any:
    """Publish ``value`` into ``store`` under ``mode`` (``None``: the context's), then ``append`` it.

    Returns what was (or, without ``append``, what should be) stored. ``off`` stores ``value`` itself.
    Otherwise the value is detached lazily; a value that carried a graph is accounted to its call site
    and warned about (``warn``) or refused with :class:`GraphRetentionError` (``raise``, before anything
    is counted or stored). ``offload`` then moves what is stored (``offload="cpu"``).

    The call site: with ``append``, whoever called this function (a store's ``append``); else the
    first frame outside gradguard and wrapt, the search starting ``skip`` frames above the caller
    (frames the caller knows to be gradguard's own).

    This is the hot path of every guarded append: stores bind the first four arguments with
    ``functools.partial``, so no Python frame sits between the appending code and this one.
    """
    if mode is None:
        mode = resolve(None)
    if mode == OFF:
        new = value
    else:
        count = [0]
        try:  # detach_counted, inlined
            new = _fast(value, 0, count)
        except (_TooDeep, RecursionError):
            new = _detach_deep(value, count)
        if new is value:
            count_clean(store)
        else:
            graph_seen(store, mode, value, count[0], None if append is not None else skip)
        if offload is not None:
            new = offload(new)
    if append is not None:
        append(new)
    return new


def publish(store: str, mode: Mode, value: Any, offload: Offload | None = None) -> Any:
    """What ``store`` should hold for ``value`` under ``mode``: :func:`publish_into` without appending."""
    return publish_into(None, store, mode, offload, value)


def publish_many(store: str, mode: Mode, values: list[Any], offload: Offload | None = None) -> list[Any]:
    """:func:`publish` for a batch: in ``raise`` mode one offending value refuses the whole batch."""
    if mode == OFF:
        return values
    counts = [[0] for _ in values]
    news = [detach_counted(v, c) for v, c in zip(values, counts)]
    changed = [(v, c[0]) for v, n, c in zip(values, news, counts) if n is not v]
    if mode == RAISE:  # refuse the whole batch before counting any of it
        for original, _ in changed:
            if find_graphs(original):
                graph_seen(store, mode, original, 0)
    for original, n in changed:
        graph_seen(store, mode, original, n)
    if len(changed) < len(values):
        count_clean(store, len(values) - len(changed))
    return news if offload is None else [offload(n) for n in news]
