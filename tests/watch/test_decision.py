"""The one decision of a boundary of either clock, driven directly: its signals and budget are given, its
answer read (see ``gradguard/_watch/decision.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from gradguard._watch.backoff import Backoff
from gradguard._watch.decision import Decision, Signal, Signals, decide
from gradguard._watch.tuning import MICRO_FREE, QUIET, STEP_FREE


@dataclasses.dataclass
class Budget:
    """A budget the test sets: what fits, whether the account is overdrawn, whether the backstop is due."""

    fits: bool = True
    overdrawn: bool = False
    due: bool = False
    asked: list[float] = dataclasses.field(default_factory=list)

    def affords(self, estimate: float) -> bool:
        self.asked.append(estimate)
        return self.fits

    def solvent(self) -> bool:
        return not self.overdrawn

    def backstop(self) -> bool:
        return self.due


def _spent(signal: Backoff, free: int, at: int = 10) -> Backoff:
    """``signal`` after ``free`` requests in a row that found nothing new, the last at boundary ``at``."""
    for _ in range(free):
        signal.handled(at, 0.25, False, free)
    if isinstance(signal, Signal):
        signal.asked_at = at
    return signal


def _path(signals: Signals, signal: Backoff, budget: Budget, answers: dict[str, object]) -> list[Decision]:
    """Every answer of one boundary: each ``collect`` or ``read`` is answered from ``answers``, as a caller
    does, and the decision asked again."""
    path = [decide(signals, signal, budget)]
    while path[-1].action in ("collect", "read"):
        field = "collected" if path[-1].action == "collect" else "read"
        signals = signals._replace(**{field: answers[field]})
        path.append(decide(signals, signal, budget))
    return path


# --------------------------------------------------------------------------------------------------
# The step clock
# --------------------------------------------------------------------------------------------------


def test_a_boundary_with_no_signal_does_nothing_unless_the_backstop_is_due() -> None:
    quiet = decide(Signals("step", 9), Signal(), Budget())
    assert quiet == Decision("nothing", None, "no signal asked")
    due = decide(Signals("step", 9), Signal(), Budget(due=True))
    assert (due.action, due.reason) == ("search", "time")


def test_a_start_up_boundary_searches_whatever_the_budget_says() -> None:
    budget = Budget(fits=False, overdrawn=True)
    assert decide(Signals("step", 1, startup=True), Signal(), budget)[:2] == ("search", "start")
    # a signal's request at a start-up boundary is served, as its own reason, and asked about first
    path = _path(Signals("step", 2, startup=True, old=True), Signal(), budget, {"collected": "survived"})
    assert [(d.action, d.reason) for d in path] == [("collect", "old"), ("search", "old")]
    assert not budget.asked


@pytest.mark.parametrize(
    ("collected", "read", "expected"),
    [
        ("survived", False, [("read", "old"), ("collect", "old"), ("search", "old")]),
        ("survived", True, [("read", "old"), ("nothing", "old")]),
        ("garbage", False, [("read", "old"), ("collect", "old"), ("nothing", "old")]),
        ("refused", False, [("read", "old"), ("collect", "old"), ("nothing", "old")]),
    ],
)
def test_an_old_graph_reads_the_holders_found_before_then_asks_the_collector_then_searches(
    collected: str, read: bool | None, expected: list[tuple[str, str]]
) -> None:
    # Read first: a holder known by name is read whatever a collection costs (the collector's ration had
    # refused every boundary, and a running sum's figures were never read again).
    signals = Signals("step", 9, old=True, known=True)
    path = _path(signals, Signal(), Budget(), {"collected": collected, "read": read})
    assert [(d.action, d.reason) for d in path] == expected
    assert path[-1].declined == ("collector" if collected == "refused" else "")


def test_a_retry_reads_the_holders_found_before_without_asking_the_collector() -> None:
    path = _path(Signals("step", 9, retry=True, known=True), Signal(), Budget(), {"read": False})
    assert [(d.action, d.reason) for d in path] == [("read", "retry"), ("search", "retry")]


def test_the_signals_ask_in_order_old_held_retry_memory() -> None:
    both = Signals("step", 9, held=True, retry=True, memory=True)
    assert decide(both, Signal(), Budget()).reason == "held"
    assert decide(both._replace(held=False), Signal(), Budget()).reason == "retry"
    assert decide(Signals("step", 9, memory=True, surge=True), Signal(), Budget()).reason == "memory"


def test_a_signal_that_keeps_finding_nothing_waits_for_its_gap_then_for_the_share() -> None:
    signal = _spent(Signal(), STEP_FREE)
    assert signal.next_at == 11
    signals = Signals("step", 10, held=True)
    early = decide(signals, signal, Budget())
    assert (early.action, early.declined) == ("nothing", "signal")
    assert decide(signals._replace(boundary=11), signal, Budget()).action == "search"
    unaffordable = decide(signals._replace(boundary=11), signal, Budget(fits=False))
    assert (unaffordable.action, unaffordable.declined) == ("nothing", "signal")
    # the estimate it asks the budget about is the signal's own last cost
    budget = Budget()
    decide(signals._replace(boundary=11), signal, budget)
    assert budget.asked == [0.25]


def test_a_declined_request_gives_way_to_a_due_backstop() -> None:
    signal = _spent(Signal(), STEP_FREE)
    decision = decide(Signals("step", 10, held=True), signal, Budget(due=True))
    assert (decision.action, decision.reason, decision.declined) == ("search", "time", "signal")


def test_a_signal_quiet_for_long_starts_afresh_only_while_the_account_is_not_overdrawn() -> None:
    late = 10 + QUIET + 5
    overdrawn = _spent(Signal(), STEP_FREE)
    assert decide(Signals("step", late, held=True), overdrawn, Budget(fits=False, overdrawn=True)).declined
    fresh = _spent(Signal(), STEP_FREE)
    decision = decide(Signals("step", late, held=True), fresh, Budget(fits=False))
    assert decision.action == "search" and fresh.misses == 0  # a new story: its first request is free
    assert fresh.asked_at == late


def test_the_memory_figure_is_served_at_once_only_when_it_surged() -> None:
    signal = Signal()
    grew = decide(Signals("step", 10, memory=True), signal, Budget(fits=False))
    assert (grew.action, grew.declined) == ("nothing", "signal")
    surged = decide(Signals("step", 10, memory=True, surge=True), signal, Budget(fits=False))
    assert surged.action == "search"


def test_hunting_acts_on_every_nth_boundary_whatever_it_costs() -> None:
    signal = _spent(Signal(), STEP_FREE)
    skipped = Signals("step", 11, old=True, hunting=True, nth=False)
    assert decide(skipped, signal, Budget()).why == "every=N: not an N-th boundary"
    served = decide(skipped._replace(nth=True, known=True), signal, Budget(fits=False))
    assert (served.action, served.reason) == ("search", "old")  # no collector, no read by name: a search


def test_a_holder_repaired_before_that_fills_again_is_read_at_a_quiet_boundary() -> None:
    signals = Signals("step", 9, refill=True, known=True)
    assert decide(signals, Signal(), Budget())[:2] == ("read", None)
    assert decide(signals._replace(read=True), Signal(), Budget()).action == "nothing"


# --------------------------------------------------------------------------------------------------
# The micro-batch clock
# --------------------------------------------------------------------------------------------------


def test_a_micro_batch_boundary_reads_its_followed_holders_first() -> None:
    signals = Signals("micro", 5, known=True)
    assert decide(signals, Backoff(), Budget()).action == "read"
    assert decide(signals._replace(read=False), Backoff(), Budget()).why == "no graph of an earlier backward is alive"
    explained = Signals("micro", 5, old=True, known=True, read=True)
    assert decide(explained, Backoff(), Budget()).why == "the holders followed by name keep it"


def test_its_first_searches_are_served_even_when_no_collection_fits() -> None:
    path = _path(Signals("micro", 5, old=True), Backoff(), Budget(fits=False), {"collected": "refused"})
    assert [d.action for d in path] == ["collect", "search"]
    spent = _spent(Backoff(), MICRO_FREE, at=2)
    later = _path(Signals("micro", 50, old=True), spent, Budget(), {"collected": "refused"})
    assert [d.action for d in later] == ["collect", "nothing"] and later[-1].declined == "collector"


def test_later_searches_wait_for_the_gap_and_the_share() -> None:
    spent = _spent(Backoff(), MICRO_FREE, at=2)
    signals = Signals("micro", spent.next_at - 1, old=True)
    assert decide(signals, spent, Budget()).declined == "signal"
    on_time = signals._replace(boundary=spent.next_at)
    assert decide(on_time, spent, Budget(fits=False)).why == "declined: the watch's share of the time"
    assert _path(on_time, spent, Budget(), {"collected": "survived"})[-1].action == "search"
    hunting = decide(on_time._replace(hunting=True), spent, Budget(fits=False))
    assert hunting.action == "search"  # every=N: no collection, whatever it costs
