"""The ledger's books: the earliest epoch whose counted stamp is alive, read in constant time, as stamps
die in any order, are judged, and fall at or below an audit's horizon."""

from __future__ import annotations

import gc
import threading

import torch

from gradguard._graph.stamps import Ledger, on_leaves


def _graph() -> torch.Tensor:
    x = torch.ones(2, requires_grad=True)
    return (x * 2).sum()


def test_the_earliest_epoch_alive_is_read_as_graphs_die_in_any_order() -> None:
    ledger = Ledger()
    kept = {}
    for epoch in range(5):
        kept[epoch] = _graph()
        assert ledger.stamp_roots((kept[epoch],), epoch)
    assert ledger.oldest_alive(10) == 0
    assert ledger.oldest_alive(-1) is None  # nothing that old
    del kept[0]
    assert ledger.oldest_alive(10) == 1
    del kept[3], kept[1]
    assert ledger.oldest_alive(10) == 2
    assert ledger.alive(10) == 2
    kept.clear()
    assert ledger.oldest_alive(10) is None and ledger.alive(10) == 0


def test_a_stamp_placed_at_an_earlier_epoch_than_the_last_is_still_the_earliest() -> None:
    ledger = Ledger()
    late, early = _graph(), _graph()
    ledger.place(late.grad_fn, 7)
    ledger.place(early.grad_fn, 3)  # an audit stamps what it found at an earlier boundary
    assert ledger.oldest_alive(10) == 3
    del early
    assert ledger.oldest_alive(10) == 7


def test_settled_and_judged_stamps_are_not_asked_about() -> None:
    ledger = Ledger()
    a, b, c = _graph(), _graph(), _graph()
    for epoch, t in enumerate((a, b, c)):
        ledger.place(t.grad_fn, epoch)
    ledger.settle(0)
    assert ledger.oldest_alive(10) == 1
    ledger.judged(b.grad_fn)
    assert ledger.oldest_alive(10) == 2
    assert ledger.alive(10) == 2  # a, settled, and c: judged ones are not counted
    ledger.settle(-1)  # an audit that looked at less: the settled one is asked about again
    assert ledger.oldest_alive(10) == 0


def test_a_stamp_that_dies_in_another_thread_or_in_a_cycle_leaves_the_books() -> None:
    ledger = Ledger()
    kept = [_graph()]
    ledger.place(kept[0].grad_fn, 1)
    cycle: dict[str, object] = {"out": _graph()}
    cycle["self"] = cycle
    ledger.place(cycle["out"].grad_fn, 0)  # type: ignore[attr-defined]
    del cycle
    assert ledger.oldest_alive(10) == 0
    gc.collect()
    assert ledger.oldest_alive(10) == 1
    worker = threading.Thread(target=kept.clear)
    worker.start()
    worker.join()
    assert ledger.oldest_alive(10) is None


def test_dead_stamps_behind_an_old_one_alive_do_not_pile_up_in_the_books() -> None:
    """A stamp alive at the front of the books (an old graph no audit settled yet) must not make the
    books grow with every step behind it: the dead ones are forgotten as stamps are made."""
    ledger = Ledger()
    kept = _graph()
    ledger.stamp_roots((kept,), 0)
    reused = _graph()
    for epoch in range(1, 3000):
        ledger.stamp_roots((_graph(),), epoch)  # each step's graph dies with its step
        ledger.stamp_roots((reused,), epoch)  # one graph backwarded at every step: a used stamp each
    assert ledger.oldest_alive(3000) == 0
    assert len(ledger._open) < 600 and len(ledger._index) < 600
    del kept, reused
    assert ledger.oldest_alive(3000) is None and ledger.alive(3000) == 0


def test_a_stamp_compares_by_identity_and_lists_its_nodes() -> None:
    from gradguard._graph.stamps import FRESH, Stamp

    a, b = Stamp(), Stamp()  # equal as lists, yet two stamps
    assert a != b and a == a and len({a, b}) == 2
    ledger = Ledger()
    kept = _graph()
    ledger.stamp_roots((kept,), 4)
    found = ledger.stamp(kept.grad_fn)
    assert found is not None and found.epoch == 4 and found.kind == FRESH and not found.used
    assert list(found) == [kept.grad_fn._sequence_nr()]
    assert ledger.keys() == frozenset(found)


def test_a_backwards_stamp_reaches_the_nodes_right_below_its_roots_but_not_the_models_own() -> None:
    ledger = Ledger()
    w = torch.nn.Parameter(torch.ones(2))
    x = torch.ones(2, requires_grad=True)
    product = (x * 3).sum() * w.sum()
    loss = product + (x * 5).sum()  # AddBackward: below it, a step's MulBackward and a SumBackward
    scaled, other = (child for child, _ in loss.grad_fn.next_functions)
    ledger.place(other, 0)  # an audit's stamp at an earlier epoch stays as it is
    new = ledger.stamp_roots((loss,), 1, micro=1, below=True)
    assert new == [loss.grad_fn]
    assert (ledger.epoch(scaled), ledger.epoch(other)) == (1, 0)
    assert all(ledger.epoch(child) is None for child, _ in scaled.next_functions)  # two down: the deep stamps'
    fresh = (x * 7).sum() * w.sum()
    ledger.stamp_roots((fresh,), 2, micro=2, below=True)
    step_sum, model_sum = (child for child, _ in fresh.grad_fn.next_functions)
    assert ledger.epoch(step_sum) == 2
    assert ledger.epoch(model_sum) is None  # on the parameter alone
    plain = Ledger()
    plain.stamp_roots((loss,), 1, micro=1)
    assert plain.epoch(scaled) is None and plain.epoch(other) is None


def test_on_leaves_tells_a_node_on_parameters_alone() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    x = torch.ones(2, requires_grad=True)
    assert on_leaves(w.t().grad_fn)
    assert not on_leaves((w * x * 2).grad_fn)  # below it: the product of w and x (a step's node)
    assert on_leaves((w * x).grad_fn)  # both leaves
    accumulate = torch.ones(2, requires_grad=True).sum().grad_fn.next_functions[0][0]
    assert not on_leaves(accumulate)  # nothing below it
