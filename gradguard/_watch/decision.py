"""The one decision: what a boundary of either clock does next, and why.

A boundary of the step clock (``optimizer.step()`` returned) or of the micro-batch clock (a backward
returned) reads its signals in constant time (:class:`Signals`), and :func:`decide` answers with one
:class:`Decision`: do nothing; ask the collector whether the old graphs are only cyclic garbage; read the
holders found before by name; or search the heap, for a named reason. An answer of ``collect`` or
``read`` is a question: the caller does it, puts what it learned in the signals, and asks again, so one
boundary's whole path is a few calls of this one function:

    signals = Signals("step", 7, old=True, known=True)
    decide(signals, ...)                                   -> read
    decide(signals._replace(read=False), ...)              -> collect
    decide(signals._replace(read=False, collected="survived"), ...) -> search (old)

What each request may cost is the budget's (:class:`Budget`: one account, :mod:`gradguard._watch.governor`);
how often a signal that keeps finding nothing asks is its back-off's (:mod:`gradguard._watch.backoff`).
The rules, in the order they are tried: ``docs/how-it-works.md`` (*One decision*).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

from .backoff import Backoff
from .tuning import MICRO_FREE, QUIET, STEP_FREE

__all__ = ["Action", "Budget", "Clock", "Collected", "Decision", "Reason", "Signal", "Signals", "decide", "reason_of"]

Clock = Literal["step", "micro"]
Action = Literal["nothing", "collect", "read", "search"]
Reason = Literal["start", "old", "held", "retry", "memory", "time"]
Collected = Literal["garbage", "survived", "refused"]
Declined = Literal["", "signal", "collector"]


class Signals(NamedTuple):
    """What one boundary read, in constant time, and what its earlier answers learned.

    Attributes:
        clock: ``"step"`` or ``"micro"``.
        boundary: The boundary's number on its clock (from 1).
        startup: A start-up boundary of the step clock: searched whatever the signals say.
        old: A graph an earlier boundary left is alive that should be gone (step clock: it lived through
            two boundaries; micro-batch clock: an earlier backward ran through it).
        held: The parameters' reference count rose.
        retry: Old graphs no holder was found for are due to be looked for again.
        memory: The memory figure grew past its threshold.
        surge: It grew well past it (:data:`~gradguard._watch.tuning.MEMORY_FIRST` times, and twice as far
            as at the last audit it asked for): its request is served at once.
        refill: ``detach``: a holder repaired before fills again (read by name at every boundary).
        known: Holders found before can be read by name.
        hunting: ``every=N``: a request its back-off allows is served whatever it costs (step clock: on
            every N-th boundary only, see ``nth``).
        nth: With ``hunting``: this boundary is an N-th one.
        collected: What the collector said: ``"garbage"`` (it freed them, or has yet to run), ``"survived"``
            (they outlived a collection), ``"refused"`` (no collection fits the budget now), or ``None``.
        read: Whether the holders read by name keep every old graph (``None``: not read).
    """

    clock: Clock
    boundary: int
    startup: bool = False
    old: bool = False
    held: bool = False
    retry: bool = False
    memory: bool = False
    surge: bool = False
    refill: bool = False
    known: bool = False
    hunting: bool = False
    nth: bool = True
    collected: Collected | None = None
    read: bool | None = None


class Decision(NamedTuple):
    """One answer: the action, the signal it serves (``None``: none asked, or a read of the holders repaired
    before), why (the summary and the tests read it), and what declined a request: ``"signal"`` (its
    back-off or the watch's share), ``"collector"`` (no collection fits now), or ``""``."""

    action: Action
    reason: Reason | None
    why: str
    declined: Declined = ""


class Budget(Protocol):
    """The watch's one account, as of this boundary (see :class:`~gradguard._watch.governor.Governor`)."""

    def affords(self, estimate: float) -> bool:
        """Whether work estimated at ``estimate`` seconds fits the watch's share of the time now."""

    def solvent(self) -> bool:
        """Whether the work charged so far is within the share (the account is not overdrawn)."""

    def backstop(self) -> bool:
        """Whether an audit no signal asked for is due (for graphs no signal sees)."""


class Signal(Backoff):
    """One signal's requests on the step clock (a :class:`~gradguard._watch.backoff.Backoff`), when it last
    asked, and whether its next request follows up on graphs the last audit left pending."""

    def __init__(self, misses: int = 0) -> None:
        super().__init__(misses=misses)
        self.asked_at = 0
        self.follow = False


def decide(signals: Signals, backoff: Backoff, budget: Budget, *, free: int | None = None) -> Decision:
    """What boundary ``signals`` does next (see the module documentation).

    Args:
        signals: What the boundary read, and what its earlier answers learned.
        backoff: The back-off of the signal that asks (step clock: the first of old, held, retry, memory
            that asks; micro-batch clock: its one signal). Its ``asked_at`` is recorded here, on the step
            clock.
        budget: The account, as of this boundary.
        free: Requests in a row that find nothing served at once (the clock's own by default).

    Returns:
        The :class:`Decision`.
    """
    if signals.clock == "micro":
        return _micro(signals, backoff, budget, MICRO_FREE if free is None else free)
    decision = _step(signals, backoff, budget, STEP_FREE if free is None else free)
    if decision.action == "nothing" and signals.refill and signals.known and signals.read is None:
        return Decision("read", None, "detach: a holder repaired before fills again: read it by name")
    return decision


def reason_of(signals: Signals) -> Reason | None:
    """The step signal that asks, by priority: an old graph, the parameters' count, a retry, the memory figure."""
    if signals.old:
        return "old"
    if signals.held:
        return "held"
    if signals.retry:
        return "retry"
    if signals.memory:
        return "memory"
    return None


def _step(s: Signals, backoff: Backoff, budget: Budget, free: int) -> Decision:
    reason = reason_of(s)
    if reason is None and not s.startup:
        if s.hunting and not s.nth:
            return Decision("nothing", None, "every=N: not an N-th boundary")
        if budget.backstop():
            return Decision("search", "time", "no signal asked; the backstop is due (graphs no signal sees)")
        return Decision("nothing", None, "no signal asked")
    if not s.startup:
        if s.hunting and not s.nth:
            return Decision("nothing", None, "every=N: not an N-th boundary")
        if not s.hunting and not _served(reason, s, backoff, budget, free):  # type: ignore[arg-type]
            if budget.backstop():
                return Decision("search", "time", "a request was declined; the backstop is due", "signal")
            return Decision("nothing", reason, "declined: the signal's back-off or the watch's share", "signal")
    if reason is None:
        return Decision("search", "start", "a start-up boundary: the first steps are searched whatever they show")
    if not s.hunting and reason in ("old", "retry") and s.known:
        if s.read is None:
            return Decision("read", reason, "holders found before may keep the old graphs: read them by name first")
        if s.read:
            return Decision("nothing", reason, "the holders found before keep every old graph (acted on by name)")
    if not s.hunting and reason == "old":
        if s.collected is None:
            return Decision("collect", reason, "an old graph may be cyclic garbage: ask the collector")
        if s.collected == "refused":
            return Decision("nothing", reason, "declined: no collection of the young generations fits now", "collector")
        if s.collected == "garbage":
            return Decision("nothing", reason, "cyclic garbage: the collector freed it, or is yet to run")
    return Decision("search", reason, "a signal asked and the budget allows it")


def _served(reason: Reason, s: Signals, backoff: Backoff, budget: Budget, free: int) -> bool:
    """Whether a step signal's request runs now: at once while its audits find something new (or for the
    first ``free`` in a row that find nothing new, or to follow up on graphs left pending), else once its
    doubling gap went by and the budget allows. A signal quiet for :data:`QUIET` boundaries (and longer
    than its gap) starts afresh while the account is not overdrawn: a storm of stray requests is repaid
    before the next. The memory figure's request is served at once only when it grew well past its
    threshold (growth alone proves nothing: a replay buffer, a cache)."""
    signal = backoff if isinstance(backoff, Signal) else None
    if signal is not None:
        if reason != "retry" and s.boundary - signal.asked_at > max(QUIET, signal.gap) and budget.solvent():
            signal.misses, signal.gap, signal.next_at = 0, 1, 0  # quiet since: a new request is a new story
        signal.asked_at = s.boundary
    if reason == "memory":
        if s.surge:
            return True
    elif backoff.misses < free or (signal is not None and signal.follow):
        return True
    return s.boundary >= backoff.next_at and budget.affords(backoff.cost)


def _micro(s: Signals, backoff: Backoff, budget: Budget, free: int) -> Decision:
    if s.known and s.read is None:
        return Decision("read", None, "holders are followed by name: read them first")
    if not s.old:
        return Decision("nothing", None, "no graph of an earlier backward is alive")
    if s.read:
        return Decision("nothing", None, "the holders followed by name keep it")
    starting = backoff.misses < free
    if not starting:
        if s.boundary < backoff.next_at:
            return Decision("nothing", "old", "declined: the back-off's gap", "signal")
        if not s.hunting and not budget.affords(backoff.cost):
            return Decision("nothing", "old", "declined: the watch's share of the time", "signal")
    if not s.hunting:
        if s.collected is None:
            return Decision("collect", "old", "an old graph may be cyclic garbage: ask the collector first")
        if s.collected == "garbage" or (s.collected == "refused" and not starting):
            # No collection fits now: at start-up, the search itself tells a holder from garbage.
            refused: Declined = "collector" if s.collected == "refused" else ""
            return Decision("nothing", "old", "cyclic garbage, or no collection fits now", refused)
    if starting:
        return Decision("search", "old", "one of the signal's first requests, or the first after one found a holder")
    return Decision("search", "old", "the back-off's gap went by, within the watch's share of the time")
